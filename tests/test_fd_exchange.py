"""allgather_fds: memfds shared over SCM_RIGHTS between spawned gloo ranks and mpirun ranks; failures and leaks."""

from __future__ import annotations

import os
import socket
import time

import pytest

from flashinfer_a2a.memory import fd_exchange
from flashinfer_a2a.memory.fd_exchange import allgather_fds, same_host

from .comm_workers import open_fds, spawn
from .test_comm import ListComm, check_under_mpirun


@pytest.mark.parametrize("world_size", [2, 3])
def test_fd_exchange_torch(tmp_path, world_size):
    spawn("fd_exchange", world_size, tmp_path)


def test_fd_exchange_mpirun():
    check_under_mpirun("fd_exchange")


def test_hung_peer_times_out_naming_it(tmp_path):
    spawn("fd_hung_peer", 3, tmp_path)


def test_bad_fd_fails_every_rank(tmp_path):
    spawn("fd_bad_fd", 2, tmp_path)


def test_same_host(tmp_path):
    spawn("same_host", 2, tmp_path)
    assert same_host(ListComm())


def test_single_rank_dups():
    fd = os.memfd_create("single")
    try:
        (own,) = allgather_fds(ListComm(), fd)
        assert own != fd and os.fstat(own).st_ino == os.fstat(fd).st_ino
        os.close(own)
    finally:
        os.close(fd)
    with pytest.raises(ValueError, match="fd must be an open file descriptor"):
        allgather_fds(ListComm(), fd)
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        allgather_fds(ListComm(), 0, timeout_s=0)


class TwoRankView(ListComm):
    """Rank 0 of a two-rank group, for driving one side of the exchange by hand."""

    size = 2


def test_stranger_gets_no_fd():
    """Anyone in the network namespace can see and connect to the socket; only the secret earns the fd."""
    fd = os.memfd_create("guarded")
    baseline = open_fds()
    exchange = fd_exchange._Exchange(TwoRankView(), fd, "strangertest", b"s" * fd_exchange._SECRET_BYTES)
    try:
        exchange.listen()
        exchange.clients.clear()  # serve only: nothing to fetch from "rank 1" in this test
        name = fd_exchange._socket_name("strangertest", 0)
        stranger, peer = socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)
        with stranger, peer:
            stranger.settimeout(5), peer.settimeout(5)
            stranger.connect(name)
            stranger.sendall(fd_exchange._HELLO.pack(b"x" * fd_exchange._SECRET_BYTES, 1))
            peer.connect(name)
            peer.sendall(fd_exchange._HELLO.pack(b"s" * fd_exchange._SECRET_BYTES, 1))
            exchange.run(time.monotonic() + 5)
            msg, fds, _, _ = socket.recv_fds(stranger, 1, 1)
            assert (msg, fds) == (b"", [])
            msg, fds, _, _ = socket.recv_fds(peer, 1, 1)
            assert msg == fd_exchange._ACK and len(fds) == 1
            assert os.fstat(fds[0]).st_ino == os.fstat(fd).st_ino
            os.close(fds[0])
    finally:
        exchange.close(keep_received=False)
    assert open_fds() == baseline
    os.close(fd)
