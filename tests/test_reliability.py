"""Ranks that disagree, peers that die, misuse: caught before a launch, named, and survived (CPU, gloo ranks)."""

from __future__ import annotations

import time

import pytest

from flashinfer_a2a.agreement import check_agreement, construction_record
from flashinfer_a2a.memory.lifecycle import bounded

from .reliability_workers import spawn


@pytest.mark.parametrize("world_size", [2, 3])
def test_construction_mismatch_raises_on_every_rank(tmp_path, world_size):
    spawn("construction_mismatch", world_size, tmp_path)


def test_bad_argument_on_one_rank_fails_every_rank(tmp_path):
    spawn("bad_argument_on_one_rank", 2, tmp_path)


def test_destroy_frees_locally_when_a_peer_is_dead(tmp_path):
    spawn("destroy_with_dead_peer", 3, tmp_path)


def test_destroy_with_every_peer_alive(tmp_path):
    spawn("destroy_all_alive", 2, tmp_path)


def test_missing_peer_is_named_within_the_timeout(tmp_path):
    spawn("missing_peer_is_named", 2, tmp_path)


class Gathered:
    """A Communicator whose allgather returns records given up front (rank 0 is this process)."""

    rank, size = 0, 3

    def __init__(self, records):
        self.records = records

    def allgather(self, data: bytes) -> list[bytes]:
        import json

        assert json.loads(data) == self.records[0]
        return [json.dumps(r).encode() for r in self.records]


def test_agreement_names_every_differing_field_and_value():
    base = construction_record(hidden_size=1024, top_k=8, dtype="torch.bfloat16", dispatch_format=None)
    other = dict(base, hidden_size="1536")
    third = dict(base, dtype="torch.float16", top_k="8")
    check_agreement(Gathered([base, base, base]), base)  # all equal: silent
    with pytest.raises(ValueError) as info:
        check_agreement(Gathered([base, other, third]), base)
    text = str(info.value)
    assert "hidden_size (rank 0: 1024, rank 1: 1536, rank 2: 1024)" in text
    assert "dtype (rank 0: torch.bfloat16, rank 1: torch.bfloat16, rank 2: torch.float16)" in text
    assert "top_k (" not in text and "dispatch_format (" not in text


def test_agreement_names_a_field_one_rank_lacks():
    base = construction_record(hidden_size=1024)
    with pytest.raises(ValueError, match=r"namespace \(rank 0: <missing>, rank 1: a, rank 2: <missing>\)"):
        check_agreement(Gathered([base, dict(base, namespace="a"), base]), base)


def test_bounded_reports_a_hang_and_an_error():
    start = time.monotonic()
    assert bounded(lambda: time.sleep(5), 0.2) == (False, "no answer within 0.2 s")
    assert time.monotonic() - start < 2
    assert bounded(lambda: 7, 1.0) == (True, 7)
    ok, reason = bounded(lambda: 1 / 0, 1.0)
    assert not ok and reason.startswith("ZeroDivisionError")


def test_stream_order_waits_for_the_previous_steps_stream(monkeypatch):
    """The ordering logic with the CUDA calls stubbed (tests/gpu/test_reliability.py and the engines' graph flows
    run it on real streams): a step on a new stream waits for the previous eager step's stream, once; a captured step
    waits only for an earlier captured step's stream that is still capturing; the steady state waits for nothing."""
    import torch

    from flashinfer_a2a.memory import call_order

    class Stream:
        def __init__(self, handle):
            self.cuda_stream, self.waited = handle, []

        def wait_stream(self, other):
            self.waited.append(other.cuda_stream)

    streams = {h: Stream(h) for h in (0x10, 0x20, 0x30, 0x40)}
    now = {"stream": 0x10, "capturing": set()}
    monkeypatch.setattr(call_order, "_stream_getter", lambda device: lambda: now["stream"])
    monkeypatch.setattr(call_order, "_capturing", lambda s: s.cuda_stream in now["capturing"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[now["stream"]])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: now["stream"] in now["capturing"])
    order = call_order.StreamOrder(torch.device("cuda", 0))

    def step(handle):
        now["stream"] = handle
        order.order()
        return streams[handle].waited

    assert step(0x10) == [] and order.stream == 0x10  # the first step waits for nothing
    assert step(0x10) == []
    assert step(0x20) == [0x10]  # another stream: it waits for the previous step's, once
    assert step(0x20) == [0x10]
    assert step(0x10) == [0x20]
    now["capturing"] = {0x30, 0x40}
    assert step(0x30) == []  # a capture after eager work: the caller's (torch.cuda.graph synchronizes)
    assert step(0x40) == [0x30]  # another stream of the capture: an edge of the graph
    assert order.stream == 0x10  # captured steps leave the eager order alone
    now["capturing"] = set()
    assert step(0x20) == [0x10, 0x10]  # eager again: waits for the last eager step's stream
    now["capturing"] = {0x40}
    streams[0x40].waited.clear()
    assert step(0x40) == []  # the last captured stream (0x40) is this one
    now["capturing"] = {0x30}
    assert step(0x30) == []  # 0x40's capture ended: nothing of it to wait for
    now["capturing"] = set()
    order.rebind(streams[0x40])  # the caller ordered the streams: no wait
    assert step(0x40) == [] and order.stream == 0x40