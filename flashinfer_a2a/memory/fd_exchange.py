"""Pass file descriptors between the ranks of one host over Unix-domain sockets (``SCM_RIGHTS``).

CUDA VMM exports a workspace as a POSIX file descriptor, which only means something inside the exporting process.
Sending it as ``SCM_RIGHTS`` ancillary data makes the kernel install a duplicate in the receiver, with no ptrace
privileges (unlike ``pidfd_getfd``) and no shared filesystem path.

Protocol of :func:`allgather_fds` (every rank makes exactly the same two collective calls, whatever fails locally,
so a caller that reports errors through a later collective stays in step):

1. rank 0 broadcasts 32 random bytes: half name the sockets, half are a secret that only the ranks know;
2. each rank binds a listening socket ``\\0flashinfer_a2a/<name>/<rank>`` in the Linux abstract namespace (no file
   to clean up, gone when closed) and allgathers "ready" or its error, which doubles as the barrier before connects;
3. one selectors loop, no threads: connect to every peer and send ``secret + own rank``; accept peers, check the
   hello and answer with this rank's fd; receive each peer's fd. Until ``timeout_s`` runs out.

The sockets are visible to every process of the network namespace (``/proc/net/unix``), so the secret, not the
name, decides who is given an fd. There is no closing barrier: a rank finishes once it has served every peer and
heard from every peer, and a barrier would let a hung peer block a rank past its timeout.
"""

from __future__ import annotations

import array
import os
import secrets
import selectors
import socket
import struct
import sys
import time
from pathlib import Path

from ..comm import Communicator

_SECRET_BYTES = 16
_HELLO = struct.Struct(f"<{_SECRET_BYTES}si")  # secret, sender's rank
_ACK = b"\x01"  # SCM_RIGHTS needs at least one byte of ordinary data to ride on


def host_id() -> str:
    """``hostname/boot_id``: equal for two processes only if they share one running kernel (a rebooted or cloned
    machine keeps its hostname but gets a new boot id)."""
    boot_id = Path("/proc/sys/kernel/random/boot_id")
    return socket.gethostname() + "/" + (boot_id.read_text().strip() if boot_id.exists() else "")


def same_host(comm: Communicator) -> bool:
    """Whether every rank of ``comm`` runs on this host. Collective; the same answer on every rank.

    Args:
        comm (Communicator): the ranks.
    """
    return len(set(comm.allgather(host_id().encode()))) == 1


def _check_args(fd: int, timeout_s: float) -> None:
    # Checked inside the protocol, not before it: a rank raising early would leave its peers in the broadcast.
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a number > 0, got {timeout_s!r}")
    try:
        os.fstat(fd)
    except (OSError, TypeError) as exc:
        raise ValueError(f"fd must be an open file descriptor, got {fd!r} ({exc})") from None


def _recv_fds(sock: socket.socket) -> tuple[bytes, list[int], int]:
    """(data, received fds, msg_flags) of one message with room for one fd, received close-on-exec.

    Not ``socket.recv_fds``: it drops its ``flags`` argument (CPython gh-107898; seen on 3.11), so MSG_CMSG_CLOEXEC
    would not reach the kernel and every received fd would leak into subprocesses started later (ninja, compilers).
    """
    fds = array.array("i")
    msg, ancdata, flags, _ = sock.recvmsg(len(_ACK), socket.CMSG_LEN(fds.itemsize), socket.MSG_CMSG_CLOEXEC)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds), flags


def _socket_name(name: str, rank: int) -> bytes:
    return f"\0flashinfer_a2a/{name}/{rank}".encode()


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


class _Exchange:
    """State of one :func:`allgather_fds` call; owns every socket and received fd until :meth:`close`."""

    def __init__(self, comm: Communicator, fd: int, name: str, secret: bytes) -> None:
        self.comm, self.fd, self.name, self.secret = comm, fd, name, secret
        self.peers = [r for r in range(comm.size) if r != comm.rank]
        self.listener: socket.socket | None = None
        self.selector = selectors.DefaultSelector()
        self.clients: dict[int, socket.socket] = {}  # peer -> our connection to it, until its fd arrives
        self.received: dict[int, int] = {}  # peer -> fd it sent
        self.unserved = set(self.peers)  # peers that have not yet fetched our fd
        self.accepted: dict[socket.socket, bytearray] = {}  # incoming connection -> hello bytes so far

    def listen(self) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(_socket_name(self.name, self.comm.rank))
        # Room for every peer at once, so a connect never waits for our accept loop.
        self.listener.listen(max(len(self.peers), 1))
        self.listener.setblocking(False)
        self.selector.register(self.listener, selectors.EVENT_READ, "listener")

    def connect_all(self, deadline: float) -> None:
        hello = _HELLO.pack(self.secret, self.comm.rank)
        # Start after our own rank so that not every rank queues on rank 0's listener first.
        for peer in sorted(self.peers, key=lambda r: (r - self.comm.rank) % self.comm.size):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.clients[peer] = sock
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            try:
                sock.connect(_socket_name(self.name, peer))
                sock.sendall(hello)  # 20 bytes: fits the socket buffer, never blocks for long
            except socket.timeout:
                raise TimeoutError(f"allgather_fds: rank {self.comm.rank} timed out connecting to rank {peer}")
            except OSError as exc:
                raise RuntimeError(
                    f"allgather_fds: rank {self.comm.rank} cannot reach rank {peer} ({exc}); are both on this host "
                    f"and in one network namespace? (abstract Unix sockets are per network namespace)"
                ) from exc
            sock.setblocking(False)
            self.selector.register(sock, selectors.EVENT_READ, peer)

    def run(self, deadline: float) -> None:
        while self.unserved or self.clients:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(self._timeout_message())
            for key, _ in self.selector.select(remaining):
                if key.data == "listener":
                    self._accept()
                elif isinstance(key.data, int):
                    self._receive(key.data, key.fileobj)
                else:
                    self._serve(key.fileobj)

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        conn.setblocking(False)
        self.accepted[conn] = bytearray()
        self.selector.register(conn, selectors.EVENT_READ, "incoming")

    def _serve(self, conn: socket.socket) -> None:
        buf = self.accepted[conn]
        try:
            chunk = conn.recv(_HELLO.size - len(buf))
            buf += chunk
            if chunk and len(buf) < _HELLO.size:
                return
            secret, peer = _HELLO.unpack(buf) if chunk else (b"", -1)
            # A stranger (wrong secret, early EOF) or a repeat gets no fd and does not count as a peer.
            if chunk and secrets.compare_digest(secret, self.secret) and peer in self.unserved:
                socket.send_fds(conn, [_ACK], [self.fd])
                self.unserved.discard(peer)
        except OSError:
            pass  # the connection broke: a real peer reports it; a stranger does not matter
        self._drop(conn)

    def _receive(self, peer: int, sock: socket.socket) -> None:
        try:
            msg, fds, flags = _recv_fds(sock)
        except OSError as exc:
            raise RuntimeError(f"allgather_fds: the connection from rank {self.comm.rank} to rank {peer} broke "
                               f"({exc})") from exc
        for extra in fds[1:]:  # room for one fd was offered, but never trust a count we did not ask for
            os.close(extra)
        if fds:
            self.received[peer] = fds[0]
        if msg != _ACK or len(fds) != 1 or flags & socket.MSG_CTRUNC:
            raise RuntimeError(f"allgather_fds: rank {peer} closed the connection without sending its fd to rank "
                               f"{self.comm.rank} (message {msg!r}, {len(fds)} fds, flags {flags:#x})")
        self.selector.unregister(sock)
        sock.close()
        del self.clients[peer]

    def _drop(self, conn: socket.socket) -> None:
        self.selector.unregister(conn)
        conn.close()
        del self.accepted[conn]

    def _timeout_message(self) -> str:
        parts = []
        if self.clients:
            parts.append(f"rank(s) {_ranks(self.clients)} did not send their fd")
        if self.unserved:
            parts.append(f"rank(s) {_ranks(self.unserved)} did not ask for this rank's fd")
        return f"allgather_fds on rank {self.comm.rank}: {'; '.join(parts)} (hung or failed peers?)"

    def close(self, keep_received: bool) -> None:
        for conn in list(self.accepted):
            self._drop(conn)
        for sock in self.clients.values():
            sock.close()
        self.clients.clear()
        if self.listener is not None:
            self.listener.close()
        self.selector.close()
        if not keep_received:
            for fd in self.received.values():
                os.close(fd)
            self.received.clear()


def allgather_fds(comm: Communicator, fd: int, *, timeout_s: float = 60.0) -> list[int]:
    """Every rank's file descriptor, received in this process. Collective over the ranks of ``comm``, which must
    all run on this host (see :func:`same_host`).

    Args:
        comm (Communicator): the ranks.
        fd (int): this rank's descriptor to share; stays open and owned by the caller.
        timeout_s (float): bound on the socket phase (connects and transfers), seconds.

    Returns:
        list[int]: length ``comm.size``, index = rank: new descriptors for each rank's object (this rank's entry is
        an ``os.dup`` of ``fd``). The caller owns and closes all of them.

    Raises:
        ValueError: ``fd`` is not an open descriptor, or ``timeout_s`` is not positive.
        TimeoutError: a peer did not answer in time; the message names it.
        RuntimeError: another rank could not take part (message names it), or a peer was unreachable.
    """
    if comm.size == 1:
        _check_args(fd, timeout_s)
        return [os.dup(fd)]
    seed = comm.broadcast(secrets.token_bytes(2 * _SECRET_BYTES) if comm.rank == 0 else None, 0)
    exchange = _Exchange(comm, fd, seed[:_SECRET_BYTES].hex(), seed[_SECRET_BYTES:])
    ok = False
    try:
        error, error_type = "", RuntimeError
        try:
            _check_args(fd, timeout_s)
        except ValueError as exc:
            error, error_type = str(exc), ValueError
        else:
            try:
                if not sys.platform.startswith("linux"):
                    raise OSError("passing fds through abstract Unix sockets needs Linux")
                exchange.listen()
            except OSError as exc:
                error = f"cannot listen: {type(exc).__name__}: {exc}"
        # Also the barrier: after it every listener exists, so a refused connect means a failed peer, not a slow one.
        errors = [e.decode() for e in comm.allgather(error.encode())]
        if error:
            raise error_type(f"allgather_fds on rank {comm.rank}: {error}")
        failed = {r: e for r, e in enumerate(errors) if e}
        if failed:
            raise RuntimeError(f"allgather_fds: ranks {sorted(failed)} could not take part: {failed}")
        deadline = time.monotonic() + timeout_s
        exchange.connect_all(deadline)
        exchange.run(deadline)
        fds = [exchange.received[r] if r != comm.rank else -1 for r in range(comm.size)]
        fds[comm.rank] = os.dup(fd)
        ok = True
        return fds
    finally:
        exchange.close(keep_received=ok)
