"""The active set of a workspace: which ranks take part in its steps.

Each rank keeps the complement, the inactive ranks, as a bitmask in its own metadata (``RankMetadata::inactive_ranks``,
bit r = rank r). Every kernel reads it when it starts, so a step captured in a CUDA graph follows the set in force
at replay. No kernel sends rows to an inactive rank, signals it or waits for it: tokens routed to its experts are
dropped (no top-k renormalisation), its receive count is 0, and it adds nothing to any combine.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from .layout import metadata_offsets

_WORD_BITS = 32


def inactive_bits(ranks: Optional[Iterable[int]], ep_size: int, ep_rank: int, name: str = "active_ranks") -> int:
    """The inactive bitmask of the active set ``ranks`` (None: every rank), checked: ints in ``[0, ep_size)`` that
    include ``ep_rank`` (a rank outside the set makes no calls)."""
    if ranks is None:
        return 0
    if isinstance(ranks, torch.Tensor) or isinstance(ranks, (str, bytes)):
        raise TypeError(f"{name} must be an iterable of rank ints (or None for every rank), got {type(ranks).__name__}")
    ranks, active = list(ranks), 0
    for r in ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"{name} must hold rank ints, got {r!r}")
        if not 0 <= r < ep_size:
            raise ValueError(f"{name} holds rank {r}, outside [0, ep_size={ep_size})")
        active |= 1 << r
    if not active >> ep_rank & 1:
        raise ValueError(f"{name}={sorted(ranks)} must include the calling rank {ep_rank}: a rank outside the "
                         "active set makes no calls")
    return ~active & _all(ep_size)


def _all(ep_size: int) -> int:
    return (1 << ep_size) - 1


def ranks_of(inactive: int, ep_size: int, invert: bool = False) -> tuple[int, ...]:
    """The active ranks of an inactive bitmask (``invert``: of an active one)."""
    return tuple(r for r in range(ep_size) if bool(inactive >> r & 1) == invert)


def write_inactive(workspace: torch.Tensor, ep_rank: int, inactive: int) -> None:
    """Stores the inactive bitmask into rank ``ep_rank``'s metadata, on the current stream (ordered after the steps
    before it and before those after it; no host synchronisation)."""
    offset = metadata_offsets()["inactive_ranks_offset"]
    words = workspace[ep_rank, offset: offset + 12].view(torch.int32)
    for w in range(3):
        value = inactive >> (_WORD_BITS * w) & 0xFFFFFFFF
        words[w].fill_(value - (1 << 32) if value >= 1 << 31 else value)


def read_epoch(workspace: torch.Tensor, ep_rank: int) -> int:
    """Rank ``ep_rank``'s dispatch epoch (a host synchronisation: for re-admitting ranks only)."""
    offset = metadata_offsets()["dispatch_epoch_offset"]
    return int(workspace[ep_rank, offset: offset + 4].view(torch.int32).item()) & 0xFFFFFFFF


def write_epoch(workspace: torch.Tensor, ep_rank: int, epoch: int) -> None:
    offset = metadata_offsets()["dispatch_epoch_offset"]
    workspace[ep_rank, offset: offset + 4].view(torch.int32).fill_(epoch - (1 << 32) if epoch >= 1 << 31 else epoch)


def latest_epoch(epochs: Iterable[int]) -> int:
    """The epoch every other one has not passed (wrap-safe, as the kernels' ``EpochReached``): the ranks that stayed
    active agree on it, and a returning rank's is behind."""
    epochs = list(epochs)
    return next(e for e in epochs if all(((e - o) & 0xFFFFFFFF) < 1 << 31 for o in epochs))
