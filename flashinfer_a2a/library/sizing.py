"""Workspace sizes from a model's shape: what one MoE layer dispatches and combines per token, so nobody adds up
payload bytes by hand.

A dispatch row carries the hidden state (``dtype``, or values and scales of a wire format), the top-k ids and the
top-k weights (and ``extra_bytes_per_token`` for anything else); a combine row is one ``hidden x dtype`` partial
(twice that, or the FP8 landing row, for the pushed combine). The result is a
:class:`flashinfer_a2a.functional.WorkspaceConfig`; its ``bytes_per_rank`` is one rank's memory.
"""

from __future__ import annotations

from typing import Optional

import torch

from .constants import MAX_TOP_K
from .layout import WorkspaceConfig
from .wire_formats import check_combine_format, push_combine_bytes_per_token, wire_format

_ID_DTYPES = (torch.int32, torch.int64)


def dispatch_bytes_per_token(hidden_size: int, top_k: int, *, dtype: torch.dtype = torch.bfloat16,
                             wire: Optional[str] = None, max_num_tokens: int = 1, swizzled_scales: bool = False,
                             ids_dtype: torch.dtype = torch.int32, extra_bytes_per_token: int = 0) -> int:
    """Bytes of one token's dispatch row: hidden state, ``[top_k]`` ids of ``ids_dtype``, ``[top_k]`` fp32 weights
    and ``extra_bytes_per_token``.

    ``wire`` (``"fp8_block"``, ``"mxfp8"``, ``"nvfp4"``) sizes the hidden state as that format's values and scales
    instead of ``hidden_size x dtype``; ``swizzled_scales`` adds the 128-row tile padding of a block of
    ``max_num_tokens`` rows.
    """
    _check_positive(hidden_size=hidden_size, max_num_tokens=max_num_tokens)
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be in [1, {MAX_TOP_K}], got {top_k}")
    if ids_dtype not in _ID_DTYPES:
        raise TypeError(f"ids_dtype must be torch.int32 or torch.int64, got {ids_dtype}")
    if extra_bytes_per_token < 0:
        raise ValueError(f"extra_bytes_per_token must be >= 0, got {extra_bytes_per_token}")
    hidden_bytes = hidden_bytes_per_token(hidden_size, dtype, wire, max_num_tokens, swizzled_scales, "wire")
    return hidden_bytes + top_k * ids_dtype.itemsize + top_k * 4 + extra_bytes_per_token


def hidden_bytes_per_token(hidden_size: int, dtype: torch.dtype, wire: Optional[str] = None, max_num_tokens: int = 1,
                           swizzled_scales: bool = False, argument: str = "dispatch_format") -> int:
    """Dispatch bytes of one token's hidden state: ``hidden_size x dtype``, or the values and scales of ``wire``
    (ValueError naming ``argument`` for an unknown format)."""
    if wire is None:
        return hidden_size * dtype.itemsize
    return wire_format(wire, argument).dispatch_bytes_per_token(hidden_size, max_num_tokens, swizzled_scales)


def combine_bytes_per_token(hidden_size: int, dtype: torch.dtype, combine_format: Optional[str] = None,
                            push_combine: bool = False) -> int:
    """Combine bytes of one token: a ``hidden_size x dtype`` partial, or, when the combine is pushed
    (``push_combine``, or an FP8 ``combine_format``), the partial and its landing row
    (:func:`flashinfer_a2a.library.wire_formats.push_combine_bytes_per_token`)."""
    check_combine_format(combine_format)
    if push_combine or combine_format is not None:
        return push_combine_bytes_per_token(hidden_size, dtype, None if push_combine else combine_format)
    return hidden_size * dtype.itemsize


def workspace_config(ep_size: int, max_num_tokens: int, hidden_size: int, top_k: int, *,
                     dtype: torch.dtype = torch.bfloat16, wire: Optional[str] = None, swizzled_scales: bool = False,
                     ids_dtype: torch.dtype = torch.int32, extra_bytes_per_token: int = 0,
                     combine_format: Optional[str] = None, push_combine: bool = False) -> WorkspaceConfig:
    """The :class:`WorkspaceConfig` of one MoE layer.

    Args:
        ep_size: ranks in the expert-parallel group.
        max_num_tokens: most tokens any rank dispatches in one call.
        hidden_size, top_k: the model's shape (e.g. DeepSeek-V3: 7168, 8).
        dtype: activation dtype (dispatched unless ``wire`` is set; always the combine dtype).
        wire: dispatch the hidden states quantized: ``"fp8_block"``, ``"mxfp8"`` or ``"nvfp4"``.
        swizzled_scales: the scales arrive in the 128x4-tile layout.
        ids_dtype: dtype of the top-k ids payload (int32 or int64).
        extra_bytes_per_token: further dispatch payload bytes per token.
        combine_format, push_combine: size the combine region for the pushed combine (see
            :class:`flashinfer_a2a.MoeAlltoAll`).

    Example: DeepSeek-V3 on 8 ranks, 4096 tokens, FP8 block wire::

        cfg = workspace_config(8, 4096, 7168, 8, wire="fp8_block")
        cfg.dispatch_bytes_per_token  # 7168 + 56 * 4 + 8 * 4 + 8 * 4 = 7456
    """
    _check_positive(ep_size=ep_size)
    dispatch = dispatch_bytes_per_token(hidden_size, top_k, dtype=dtype, wire=wire, max_num_tokens=max_num_tokens,
                                        swizzled_scales=swizzled_scales, ids_dtype=ids_dtype,
                                        extra_bytes_per_token=extra_bytes_per_token)
    combine = combine_bytes_per_token(hidden_size, dtype, combine_format, push_combine)
    return WorkspaceConfig(ep_size=ep_size, max_num_tokens=max_num_tokens, dispatch_bytes_per_token=dispatch,
                           combine_bytes_per_token=combine, top_k=top_k)


def union(*configs: WorkspaceConfig) -> WorkspaceConfig:
    """The smallest config every one of ``configs`` fits in: the maximum of each size (one ``ep_size``)."""
    if not configs:
        raise ValueError("union: pass at least one WorkspaceConfig")
    sizes = {c.ep_size for c in configs}
    if len(sizes) != 1:
        raise ValueError(f"union: the configs are for different ep_size values {sorted(sizes)}")
    return WorkspaceConfig(ep_size=configs[0].ep_size, max_num_tokens=max(c.max_num_tokens for c in configs),
                           dispatch_bytes_per_token=max(c.dispatch_bytes_per_token for c in configs),
                           combine_bytes_per_token=max(c.combine_bytes_per_token for c in configs),
                           top_k=max(c.top_k for c in configs))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
