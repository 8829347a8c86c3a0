"""Rank bodies for tests/test_reliability.py: gloo ranks on the CPU, spawned like tests/comm_workers.py does."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch

from .comm_workers import expect_raises, spawn_checks


def spawn(check: str, world_size: int, tmp_path: Path, *, timeout_s: float = 120.0) -> None:
    """Runs ``CHECKS[check](rank, world_size, tmp_path)`` on ``world_size`` gloo ranks; re-raises a rank's error."""
    spawn_checks(__name__, check, world_size, tmp_path, timeout_s=timeout_s, destroy_group=False)


def _build(rank: int, **overrides):
    from flashinfer_a2a import MoeAlltoAll

    args = dict(max_num_tokens=64, top_k=4, num_experts=16, hidden_size=1024, dtype=torch.bfloat16)
    args.update(overrides)
    return MoeAlltoAll(None, **args)


def check_construction_mismatch(rank: int, world_size: int, tmp: Path) -> None:
    """Ranks built with other sizes raise the same ValueError on every rank, naming each field and every rank's
    value, before any CUDA call (this machine has no GPU: a CUDA call would raise something else)."""
    hidden = 1536 if rank == 1 else 1024
    dtype = torch.float16 if rank == world_size - 1 else torch.bfloat16
    exc = expect_raises(ValueError, "different arguments", _build, rank, hidden_size=hidden, dtype=dtype)
    text = str(exc)
    assert "hidden_size (rank 0: 1024, rank 1: 1536" in text, text
    last = world_size - 1
    assert f"rank {last}: torch.float16" in text and "rank 0: torch.bfloat16" in text, text
    for same in ("top_k", "num_experts", "max_num_tokens", "ep_size"):
        assert f"{same} (" not in text, (same, text)

    # One field at a time, each named: the fields the issue saw pass silently.
    for field, mine in [("max_num_tokens", 64 + rank), ("top_k", 2 + rank), ("num_experts", 16 * (rank + 1)),
                        ("dispatch_format", "fp8_block" if rank else None), ("push_combine", rank == 0)]:
        exc = expect_raises(ValueError, f"{field} (rank 0: ", _build, rank, **{field: mine})
        values = ", ".join(f"rank {r}: {v}" for r, v in enumerate(_values(field, world_size)))
        assert f"{field} ({values})" in str(exc), (field, str(exc))


def _values(field: str, world_size: int) -> list:
    table = {
        "max_num_tokens": [64 + r for r in range(world_size)],
        "top_k": [2 + r for r in range(world_size)],
        "num_experts": [16 * (r + 1) for r in range(world_size)],
        "dispatch_format": ["fp8_block" if r else None for r in range(world_size)],
        "push_combine": [r == 0 for r in range(world_size)],
    }
    return table[field]


def check_bad_argument_on_one_rank(rank: int, world_size: int, tmp: Path) -> None:
    """A bad value on one rank fails every rank (no rank left waiting in a collective)."""
    exc = expect_raises(ValueError, "top_k (rank 0: 4, rank 1: 40", _build, rank, top_k=40 if rank == 1 else 4)
    assert "different arguments" in str(exc)
    # Still in step afterwards.
    from flashinfer_a2a.comm import as_communicator

    assert as_communicator(None).allgather(b"%d" % rank) == [b"%d" % r for r in range(world_size)]


def check_destroy_with_dead_peer(rank: int, world_size: int, tmp: Path) -> None:
    """The last rank dies; the others' teardown frees their mappings within the timeout, with a warning."""
    from flashinfer_a2a.comm import as_communicator
    from flashinfer_a2a.memory.lifecycle import release_workspace

    comm = as_communicator(None)
    comm.barrier()
    if rank == world_size - 1:
        os._exit(0)  # gone without a word: no teardown, no collective
    freed = []
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        passed = release_workspace(lambda: freed.append(True), comm, torch.device("cpu"), 2.0)
    elapsed = time.monotonic() - start
    assert not passed and freed == [True], (passed, freed)
    assert elapsed < 2.0 + 5.0, elapsed
    messages = [str(w.message) for w in seen]
    assert any("could not reach every peer" in m and "freeing this rank's mappings" in m for m in messages), messages


def check_destroy_all_alive(rank: int, world_size: int, tmp: Path) -> None:
    """With every rank alive the teardown barrier passes and frees once, with no warning."""
    from flashinfer_a2a.comm import as_communicator
    from flashinfer_a2a.memory.lifecycle import release_workspace

    time.sleep(0.2 * rank)  # ranks arrive at different times: the barrier still passes
    freed = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert release_workspace(lambda: freed.append(True), as_communicator(None), torch.device("cpu"), 10.0)
    assert freed == [True]


def check_missing_peer_is_named(rank: int, world_size: int, tmp: Path) -> None:
    """Debug mode's wait for the peers: bounded by the given timeout (not the group's), naming the late rank."""
    from flashinfer_a2a.comm import as_communicator
    from flashinfer_a2a.memory.lifecycle import barrier_within

    comm = as_communicator(None)
    assert barrier_within(comm, 10.0) == (True, "")
    if rank == 1:
        time.sleep(4.0)  # misses the next barrier: longer than rank 0's timeout
        return
    start = time.monotonic()
    passed, reason = barrier_within(comm, 1.0)
    assert not passed and time.monotonic() - start < 3.5, (passed, time.monotonic() - start)
    if rank == 0:  # the monitoring rank names who did not arrive
        assert "1" in reason and "monitoredBarrier" in reason, reason


CHECKS = {
    "construction_mismatch": check_construction_mismatch,
    "bad_argument_on_one_rank": check_bad_argument_on_one_rank,
    "destroy_with_dead_peer": check_destroy_with_dead_peer,
    "destroy_all_alive": check_destroy_all_alive,
    "missing_peer_is_named": check_missing_peer_is_named,
}
