"""Helpers of the GPU tests that drive MoeAlltoAll objects of simulated ranks from one thread."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import torch

T = TypeVar("T")


def on_streams(streams: Sequence[torch.cuda.Stream], fn: Callable[[int], T]) -> list[T]:
    """``fn(rank)`` for each rank on that rank's stream (after the current stream's work); the current stream then
    waits for all. No host sync in between: a rank's kernels wait on peers launched after it."""
    current = torch.cuda.current_stream()
    out = []
    for rank, stream in enumerate(streams):
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            out.append(fn(rank))
    for stream in streams:
        current.wait_stream(stream)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error of ``got`` against ``want``."""
    want = want.float()
    return float((got.float() - want).norm() / want.norm().clamp_min(1e-30))


def warm_up(streams: Sequence[torch.cuda.Stream], fn: Callable[[], object]) -> None:
    """Runs ``fn`` on the current stream and on each rank's stream, then waits: the kernels (and each stream's
    cuBLAS workspace) are loaded before any rank's kernel spins on a peer. Loading one later, while a peer's kernel
    spins on this rank, could wait on that kernel."""
    fn()
    for stream in streams:
        with torch.cuda.stream(stream):
            fn()
    torch.cuda.synchronize()
