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


#: Partials are pushed only from this many tokens per rank (the call's ``runtime_max``), over either wire: below it
#: the pulled combine is the faster one. Pair of the slowest rank in graph mode, pulled / pushed, plain partials:
#: 2xH200 (2026-11-26) 2048 tokens 185.0 / 190.3 us, 4096 tokens 353.7 / 350.8, 8192 tokens 690.0 / 673.0; 2xH100
#: 1024 tokens 104.8 / 113.0, 128 tokens 26.4 / 34.6. Over the FP8 wire (bf16 dispatch, 2xH100, 2026-11-27): 1 token
#: 21.2 / 25.0 us, 16 tokens 22.5 / 29.4, 128 tokens 31.3 / 36.9, 1024 tokens 100.8 / 102.8, 4096 tokens
#: 321.5 / 305.0, 8192 tokens 610.5 / 576.5.
PUSH_MIN_TOKENS = 4096


def chosen_mode(quant_format: Optional[str], pushed: frozenset, one_gpu_per_rank: bool, runtime_max: int) -> str:
    """``"push"`` or ``"pull"`` for a combine of ``quant_format`` after a dispatch of ``runtime_max`` tokens per rank,
    by a workspace that pushes the wires ``pushed`` (:func:`pushed_wires`). Every rank decides alike: the inputs are
    the construction's and the call's ``runtime_max``, the same on every rank."""
    if quant_format not in pushed or not one_gpu_per_rank:
        return "pull"
    return "push" if runtime_max >= PUSH_MIN_TOKENS else "pull"


def default_push_combine(max_num_tokens: int, transport: str) -> bool:
    """What ``MoeAlltoAll(push_combine=None)`` (the default) takes: room for the pushed combine of plain partials on
    the nvlink transport when the layer may dispatch PUSH_MIN_TOKENS tokens per rank or more, where pushing is the
    faster combine; below, it would never push, and the room would be wasted."""
    return transport == "nvlink" and max_num_tokens >= PUSH_MIN_TOKENS


def pushed_wires(push_combine: bool, combine_format: Optional[str]) -> frozenset:
    """The combine wires (None: the partials' dtype, ``"fp8_block"``) a MoeAlltoAll built with these arguments
    pushes when every rank has a GPU of its own: ``push_combine`` sizes room for both, ``combine_format`` for its
    own wire only."""
    if push_combine:
        return frozenset({None, "fp8_block"})
    return frozenset() if combine_format is None else frozenset({combine_format})
