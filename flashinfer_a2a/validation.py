"""Host-side argument checks: what the C++ entry points check, done in Python where the C++ never runs.

The fake implementations (``ops.py``) call these while ``torch.compile`` traces, so a wrong dtype, shape or
``ep_rank`` fails at trace time with the error the GPU call would give, not first on the GPU. The eager path runs
only :func:`check_dispatch_inputs` (a few ``isinstance`` calls): the C++ checks everything else before it launches.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from .combine_mode import check_combine_mode_code
from .constants import MAX_PAYLOADS, MAX_TIMEOUT_S, check_sizes

_IDS = (torch.int32, torch.int64)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(value: Any, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")


def check_optional_tensor(value: Any, name: str) -> None:
    """TypeError naming ``name`` unless ``value`` is a tensor or None."""
    if value is not None and not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(value).__name__}")


def check_combine_tensors(partials: Any, out: Any) -> None:
    """TypeError naming ``partials`` or ``out`` when either is neither a tensor nor None."""
    check_optional_tensor(partials, "partials")
    check_optional_tensor(out, "out")


def check_dispatch_inputs(topk_ids: Any, payloads: Any) -> None:
    """TypeError naming ``topk_ids`` or the payload that is not a tensor (None included)."""
    check_tensor(topk_ids, "topk_ids")
    if isinstance(payloads, torch.Tensor) or not isinstance(payloads, (list, tuple)):
        raise TypeError(f"payloads must be a list or tuple of tensors, got {type(payloads).__name__}")
    for i, p in enumerate(payloads):
        check_tensor(p, f"payloads[{i}]")


def _check_workspace(workspace: torch.Tensor, ep_rank: int, ep_size: int) -> None:
    if workspace.dtype != torch.uint8:
        raise TypeError(f"workspace must be uint8, got {workspace.dtype}")
    if workspace.dim() != 2 or workspace.shape[0] != ep_size:
        raise ValueError(f"workspace must have shape [ep_size={ep_size}, bytes_per_rank], got {tuple(workspace.shape)}")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}), got {ep_rank}")


def _check_counts(recv_counts: torch.Tensor, ep_size: int) -> None:
    if recv_counts.dtype != torch.int32 or recv_counts.dim() != 1 or recv_counts.shape[0] != ep_size:
        raise ValueError(f"recv_counts must be int32 of shape [ep_size={ep_size}], got {recv_counts.dtype} "
                         f"{tuple(recv_counts.shape)}")


def _check_runtime_max(runtime_max: int, max_num_tokens: int) -> None:
    if not 0 <= runtime_max <= max_num_tokens:
        raise ValueError(f"runtime_max_tokens_per_rank must be in [0, max_num_tokens={max_num_tokens}], got "
                         f"{runtime_max}")


def _check_timeout(timeout_s: float) -> None:
    if not 0 < timeout_s < MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in (0, 1e6) seconds, got {timeout_s}")


def check_split_args(op: str, phase: int, phases: Sequence[str], num_sms: int) -> None:
    """The split-phase selector and the SM budget, as the C++ entries check them (``phases[i]`` names phase i)."""
    if not 0 <= phase < len(phases):
        named = [f"{i} ({name})" for i, name in enumerate(phases)]
        raise ValueError(f"{op} phase must be {', '.join(named[:-1])} or {named[-1]}, got {phase}")
    if num_sms < 0:
        raise ValueError(f"num_sms must be >= 0 (0: every multiprocessor), got {num_sms}")


def check_dispatch_recv_args(workspace: torch.Tensor, recv_counts: torch.Tensor, ep_rank: int, sizes: Sequence[int],
                             runtime_max: int, timeout_s: float) -> None:
    """What the ``dispatch_recv`` entry checks."""
    check_sizes(*sizes)
    _check_workspace(workspace, ep_rank, sizes[0])
    _check_counts(recv_counts, sizes[0])
    _check_runtime_max(runtime_max, sizes[1])
    _check_timeout(timeout_s)


def check_initialize_args(workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int, sizes: Sequence[int]) -> None:
    check_sizes(*sizes)
    _check_workspace(workspace, ep_rank, sizes[0])
    if metainfo.dtype != torch.int64 or metainfo.dim() != 1:
        raise ValueError(f"metainfo must be a 1-D int64 tensor, got {metainfo.dtype} {tuple(metainfo.shape)}")


def check_dispatch_args(workspace: torch.Tensor, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor],
                        recv_counts: torch.Tensor, ep_rank: int, sizes: Sequence[int], runtime_max: int,
                        num_experts: int, timeout_s: float, quant_format: int,
                        global_scale: Optional[torch.Tensor]) -> None:
    """The checks of the C++ ``Dispatch`` entry that depend only on shapes, dtypes and sizes."""
    check_sizes(*sizes)
    ep_size, max_num_tokens, top_k = sizes[0], sizes[1], sizes[2]
    _check_workspace(workspace, ep_rank, ep_size)
    check_dispatch_inputs(topk_ids, payloads)
    if topk_ids.dtype not in _IDS:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [num_tokens, top_k], got {topk_ids.dim()} dims")
    if not 1 <= topk_ids.shape[1] <= top_k:
        raise ValueError(f"topk_ids has top_k={topk_ids.shape[1]}, the workspace was built for top_k <= {top_k}")
    _check_runtime_max(runtime_max, max_num_tokens)
    num_tokens = topk_ids.shape[0]
    if num_tokens > runtime_max:
        raise ValueError(f"topk_ids has {num_tokens} tokens, more than runtime_max_tokens_per_rank={runtime_max}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    _check_counts(recv_counts, ep_size)
    _check_timeout(timeout_s)
    if quant_format not in range(4):
        raise ValueError(f"quant_format must be 0 (none), 1 (fp8_block), 2 (mxfp8) or 3 (nvfp4), got {quant_format}")
    most = MAX_PAYLOADS - (quant_format != 0)
    if len(payloads) > most:
        raise ValueError(f"at most {most} payloads per dispatch, got {len(payloads)}")
    for i, p in enumerate(payloads):
        if p.dim() < 1 or p.shape[0] != num_tokens:
            raise ValueError(f"payloads[{i}] must have num_tokens={num_tokens} rows like topk_ids, got "
                             f"{tuple(p.shape)}")
    if quant_format != 0:
        if not payloads or payloads[0].dim() != 2 or payloads[0].dtype not in (torch.bfloat16, torch.float16):
            raise TypeError("payloads[0] (the hidden states to quantize) must be [num_tokens, hidden] bfloat16 or "
                            "float16")
    if (global_scale is not None) != (quant_format == 3):
        raise ValueError("quant_format nvfp4 needs global_scale" if quant_format == 3
                         else "global_scale is only used by quant_format nvfp4")


def check_combine_args(workspace: torch.Tensor, partials: Optional[torch.Tensor], recv_counts: torch.Tensor,
                       out: torch.Tensor, ep_rank: int, sizes: Sequence[int], runtime_max: int, timeout_s: float,
                       quant_format: int, one_gpu_per_rank: bool = False, combine_mode: int = 0) -> None:
    """The checks of the C++ ``Combine`` entry that depend only on shapes, dtypes and sizes."""
    check_sizes(*sizes)
    ep_size, max_num_tokens, combine_bytes = sizes[0], sizes[1], sizes[4]
    _check_workspace(workspace, ep_rank, ep_size)
    _check_counts(recv_counts, ep_size)
    _check_runtime_max(runtime_max, max_num_tokens)
    check_tensor(out, "out")
    check_optional_tensor(partials, "partials")
    if out.dtype not in _FLOATS:
        raise TypeError(f"out must be bfloat16, float16 or float32, got {out.dtype}")
    if out.dim() != 2 or out.shape[0] > runtime_max:
        raise ValueError(f"out must be [num_tokens, hidden] with num_tokens <= runtime_max_tokens_per_rank="
                         f"{runtime_max}, got {tuple(out.shape)}")
    hidden = out.shape[1]
    if hidden < 1 or hidden * out.dtype.itemsize > combine_bytes:
        raise ValueError(f"combine rows of hidden={hidden} need {hidden * out.dtype.itemsize} bytes, the workspace "
                         f"was sized for combine_bytes_per_token={combine_bytes}")
    _check_timeout(timeout_s)
    if quant_format not in (0, 1):
        raise ValueError(f"combine quant_format must be 0 (none) or 1 (fp8_block), got {quant_format}")
    if quant_format == 1 and out.dtype == torch.float32:
        raise TypeError("an FP8-wire combine needs bfloat16 or float16 out")
    if partials is not None:
        if partials.dtype != out.dtype:
            raise TypeError(f"partials must have the dtype of out ({out.dtype}), got {partials.dtype}")
        if tuple(partials.shape) != (ep_size, runtime_max, hidden):
            raise ValueError(f"partials must be [ep_size={ep_size}, runtime_max_tokens_per_rank={runtime_max}, "
                             f"hidden={hidden}], got {tuple(partials.shape)}")
    check_combine_mode_code(combine_mode, one_gpu_per_rank, hidden, out.dtype, combine_bytes, quant_format)


def check_sanitize_args(recv_topk_ids: torch.Tensor, recv_counts: torch.Tensor) -> None:
    if recv_topk_ids.dtype not in _IDS:
        raise TypeError(f"recv_topk_ids must be int32 or int64, got {recv_topk_ids.dtype}")
    if recv_topk_ids.dim() != 3:
        raise ValueError(f"recv_topk_ids must be [ep_size, runtime_max, top_k], got {tuple(recv_topk_ids.shape)}")
    _check_counts(recv_counts, recv_topk_ids.shape[0])


def check_topk_ids_on_host(topk_ids: torch.Tensor, num_experts: int) -> None:
    """ValueError naming the first expert id outside -1 and ``[0, num_experts)`` (reads the ids on the host: a
    synchronization with this rank's stream, for debug mode only)."""
    if topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        raise ValueError(f"topk_ids holds expert id {bad}; valid ids are -1 (no expert) and 0..{num_experts - 1}")
