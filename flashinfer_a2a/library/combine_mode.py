"""How combine moves the partials, named by the caller: ``"pull"`` or ``"push"`` (docs/semantics.md#combine).

The library checks the choice and launches what it is told; the workspace's sizes never imply it. ``"push"`` needs a
combine region with a landing row per token after the partials
(:func:`flashinfer_a2a.library.wire_formats.push_combine_bytes_per_token`) and every rank on a GPU of its own.
"""

from __future__ import annotations

from typing import Optional

import torch

from .constants import COMBINE_PULL, COMBINE_PUSH
from .wire_formats import push_combine_bytes_per_token

#: mode name -> the code the ``combine`` op takes (CombineMode in include/flashinfer_a2a/workspace_layout.cuh)
COMBINE_MODES = {"pull": COMBINE_PULL, "push": COMBINE_PUSH}


def combine_mode_code(mode: str, argument: str = "combine_mode") -> int:
    """The op's code for ``mode``; ValueError naming ``argument`` otherwise."""
    if mode not in COMBINE_MODES:
        raise ValueError(f"{argument} must be one of {', '.join(map(repr, COMBINE_MODES))}, got {mode!r}")
    return COMBINE_MODES[mode]


def check_combine_mode_code(combine_mode: int, one_gpu_per_rank: bool, hidden: int, dtype: torch.dtype,
                            combine_bytes_per_token: int, quant_format: int) -> None:
    """The C++ ``Combine`` entry's checks of ``combine_mode`` (run by the fake implementation while tracing)."""
    if combine_mode not in COMBINE_MODES.values():
        raise ValueError(f"combine_mode must be {COMBINE_PULL} (pull) or {COMBINE_PUSH} (push), got {combine_mode}")
    if combine_mode != COMBINE_PUSH:
        return
    if not one_gpu_per_rank:
        raise ValueError(f"combine_mode={combine_mode} (push) needs one_gpu_per_rank: with ranks sharing a GPU the "
                         f"pushing blocks can hold every multiprocessor a peer on that GPU still needs; use "
                         f"combine_mode={COMBINE_PULL} (pull)")
    wire = "fp8_block" if quant_format == 1 else None
    needed = push_combine_bytes_per_token(hidden, dtype, wire)
    if needed > combine_bytes_per_token:
        raise ValueError(f"combine_mode={combine_mode} (push) of hidden={hidden}"
                         f"{' over the FP8 wire' if wire else ''} needs combine_bytes_per_token >= {needed} (the "
                         f"partial and its landing row), the workspace was sized for {combine_bytes_per_token}")


#: The ``runtime_max`` (tokens per rank) from which a combine pushes its partials, by wire (None: as they are;
#: ``"fp8_block"``), on two ranks and on three or more; below it the pulled combine is the faster one. On more ranks
#: each rank pulls from several peers at once, which the links carry more slowly than stores (the link probe on
#: 4xH200: loads from 3 peers 266 GB/s, stores 330, at 14.7 MB a GPU), so pushing pays from fewer tokens; the FP8
#: wire's pull also quantizes every row before any peer may read it, which its push overlaps with the transfer.
#: Pair of the slowest rank in graph mode, pulled / pushed, DeepSeek-V3 rows (2026-11-27, H200s of one host):
#: - 2 ranks, plain: 1024 tokens 98.7 / 107.6 us, 2048 185.2 / 188.5, 3072 269.1 / 269.3, 4096 354.2 / 349.5;
#: - 2 ranks, FP8 wire: 1024 tokens 83.2 / 85.5, 2048 138.1 / 132.8, 3072 193.5 / 180.3, 4096 246.2 / 228.0;
#: - 4 ranks, plain: 1024 tokens 252.2 / 254.4, 2048 487.8 / 479.4, 3072 721.5 / 702.0, 4096 957.2 / 929.7;
#: - 4 ranks, FP8 wire: 128 tokens 41.2 / 40.5, 256 62.0 / 60.8, 512 108.3 / 103.2, 1024 185.3 / 164.4.
#: Three ranks were not measured (the probe's loads from 2 peers ran as slowly as from 3).
PUSH_MIN_TOKENS = {None: (4096, 2048), "fp8_block": (2048, 128)}


def push_min_tokens(ep_size: int, wire: Optional[str] = None) -> int:
    """The ``runtime_max`` from which a combine over ``ep_size`` ranks pushes ``wire`` (when the workspace pushes it at
    all: :func:`pushed_wires`)."""
    two_ranks, more_ranks = PUSH_MIN_TOKENS[wire]
    return two_ranks if ep_size <= 2 else more_ranks


def chosen_mode(quant_format: Optional[str], pushed: frozenset, one_gpu_per_rank: bool, ep_size: int,
                runtime_max: int) -> str:
    """``"push"`` or ``"pull"`` for a combine of ``quant_format`` after a dispatch of ``runtime_max`` tokens per rank
    over ``ep_size`` ranks, by a workspace that pushes the wires ``pushed`` (:func:`pushed_wires`). Every rank decides
    alike: the inputs are the construction's and the call's ``runtime_max``, the same on every rank."""
    if quant_format not in pushed or not one_gpu_per_rank:
        return "pull"
    return "push" if runtime_max >= push_min_tokens(ep_size, quant_format) else "pull"


def default_push_combine(max_num_tokens: int, ep_size: int, transport: str) -> bool:
    """What ``MoeAlltoAll(push_combine=None)`` (the default) takes: room for the pushed combine of plain partials on
    the nvlink transport when the layer may dispatch :func:`push_min_tokens` tokens per rank or more, where pushing
    is the faster combine; below, it would never push, and the room would be wasted."""
    return transport == "nvlink" and max_num_tokens >= push_min_tokens(ep_size)


def pushed_wires(push_combine: bool, combine_format: Optional[str]) -> frozenset:
    """The combine wires (None: the partials' dtype, ``"fp8_block"``) a MoeAlltoAll built with these arguments
    pushes when every rank has a GPU of its own: ``push_combine`` sizes room for both, ``combine_format`` for its
    own wire only."""
    if push_combine:
        return frozenset({None, "fp8_block"})
    return frozenset() if combine_format is None else frozenset({combine_format})
