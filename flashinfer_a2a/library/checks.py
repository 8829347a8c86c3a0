"""Host-side argument checks: what the C++ entry points check, done in Python where the C++ never runs.

The fake implementations (``ops.py``) call these while ``torch.compile`` traces, so every rule the C++ entries
(csrc/*.cu, csrc/*.h) check on shapes, dtypes, sizes, devices and layout fails at trace time with the error type the
GPU call would give, not first on the GPU; tests/test_fake_checks.py walks the C++ checks and refuses an input of
each through the fakes. A meta tensor stands for a CUDA one (tracing without a GPU). The eager path runs only
:func:`check_dispatch_inputs` and :func:`check_optional_tensor` (a few ``isinstance`` calls): the C++ checks
everything else before it launches.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence

import torch

from .combine_mode import check_combine_mode_code
from .constants import (FP8_WIRE_HIDDEN_MULTIPLE, FP8_WIRE_MAX_HIDDEN, MAX_EP_SIZE, MAX_EPLB_EXPERTS, MAX_NUM_TOKENS_LIMIT,
                        MAX_PAYLOADS, MAX_TIMEOUT_S, MAX_TOP_K, QUANT_FORMAT_CODES, check_sizes)
from .nccl_wire import WIRE_ALIGN, NcclWire, dispatch_wire, quant_row_bytes
from .wire_formats import WIRE_FORMATS, WireFormat, fp8_wire_row_bytes, wire_format

_IDS = (torch.int32, torch.int64)
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_GPU = ("cuda", "meta")  # the devices a kernel's tensors may be on while tracing: meta stands for CUDA
_WIRES = {f.code: f for f in WIRE_FORMATS.values()}  # quant_format code -> its wire format
_MAX_NUM_EXPERTS = 1 << 31  # exclusive: the kernels hold expert ids in int32
_MAX_QUANT_HIDDEN = 1 << 30  # exclusive (MakeQuantRequest in csrc/workspace.h)


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


def _check_contiguous(t: torch.Tensor, name: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())} for shape {tuple(t.shape)}")


def _check_same_device(t: torch.Tensor, ref: torch.Tensor, name: str, ref_name: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} must be on the same device as {ref_name} ({ref.device}), got {t.device}")


def _check_on_gpu(t: torch.Tensor, name: str) -> None:
    if t.device.type not in _GPU:
        raise ValueError(f"{name} must be a CUDA tensor, got a tensor on {t.device}")


def _offset_aligned(t: torch.Tensor, alignment: int) -> bool:
    """Whether ``t`` starts on an ``alignment``-byte boundary, as far as a traced tensor can tell: by its byte offset
    into its storage, since CUDA memory (torch's allocator, symmetric memory) starts on 512-byte or coarser
    boundaries. A CPU tensor is left to the C++, which reads the pointer (CPU allocations align to 64 bytes only)."""
    return t.device.type == "cpu" or t.storage_offset() * t.element_size() % alignment == 0


@functools.lru_cache(maxsize=256)
def _workspace_bytes(sizes: tuple[int, ...]) -> int:
    """Bytes of one rank's workspace, from the C++ layout (host arithmetic; imported here, as ops imports us)."""
    from ..jit import get_a2a_module

    return int(get_a2a_module().get_workspace_size(*sizes))


def _check_workspace(workspace: torch.Tensor, ep_rank: int, sizes: Sequence[int], devices=_GPU) -> None:
    """``CheckCudaWorkspace`` (csrc/workspace.h): the rank, the device, then ``CheckWorkspace`` (csrc/common.h).
    ``devices``: where the entry accepts it (initialize also takes a CPU workspace)."""
    ep_size = sizes[0]
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}), got {ep_rank}")
    if workspace.device.type not in devices:
        where = "a CUDA (or CPU) tensor" if "cpu" in devices else "a CUDA tensor"
        raise ValueError(f"workspace must be {where}, got a tensor on {workspace.device}")
    if workspace.dtype != torch.uint8:
        raise TypeError(f"workspace must be uint8, got {workspace.dtype}")
    if workspace.dim() != 2 or workspace.shape[0] != ep_size:
        raise ValueError(f"workspace must have shape [ep_size={ep_size}, bytes_per_rank], got {tuple(workspace.shape)}")
    if workspace.stride(1) != 1:
        raise ValueError(f"workspace rows must be contiguous, got strides {tuple(workspace.stride())}")
    needed = _workspace_bytes(tuple(sizes))
    if workspace.shape[1] < needed:
        raise ValueError(f"workspace has {workspace.shape[1]} bytes per rank, the layout needs {needed} (see "
                         "get_workspace_size)")
    if not _offset_aligned(workspace, 128) or workspace.stride(0) % 128:
        raise ValueError(f"workspace rows must start on 128-byte boundaries, got storage offset "
                         f"{workspace.storage_offset()} and row stride {workspace.stride(0)}")


def _check_counts(recv_counts: torch.Tensor, ep_size: int, ref: torch.Tensor, ref_name: str = "workspace") -> None:
    """``CheckRecvCounts`` (csrc/common.h): ``[ep_size] int32``, contiguous, on the device of ``ref``."""
    if recv_counts.dtype != torch.int32 or recv_counts.dim() != 1 or recv_counts.shape[0] != ep_size:
        raise ValueError(f"recv_counts must be int32 of shape [ep_size={ep_size}], got {recv_counts.dtype} "
                         f"{tuple(recv_counts.shape)}")
    _check_contiguous(recv_counts, "recv_counts")
    _check_same_device(recv_counts, ref, "recv_counts", ref_name)


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
    _check_workspace(workspace, ep_rank, sizes)
    _check_counts(recv_counts, sizes[0], workspace)
    _check_runtime_max(runtime_max, sizes[1])
    _check_timeout(timeout_s)


def check_initialize_args(workspace: torch.Tensor, metainfo: torch.Tensor, ep_rank: int, sizes: Sequence[int],
                          num_metainfo: int) -> None:
    """What the ``initialize`` entry checks; ``num_metainfo``: the entries of the metainfo tensor."""
    check_sizes(*sizes)
    _check_workspace(workspace, ep_rank, sizes, ("cuda", "meta", "cpu"))
    if (metainfo.dtype != torch.int64 or metainfo.dim() != 1 or metainfo.shape[0] != num_metainfo
            or not metainfo.is_contiguous() or metainfo.device.type != "cpu"):
        raise ValueError(f"metainfo must be a contiguous CPU int64 tensor of shape [{num_metainfo}], got "
                         f"{metainfo.dtype} {tuple(metainfo.shape)} on {metainfo.device}")


def check_dispatch_args(workspace: torch.Tensor, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor],
                        recv_counts: torch.Tensor, ep_rank: int, sizes: Sequence[int], runtime_max: int,
                        num_experts: int, timeout_s: float, quant_format: int,
                        global_scale: Optional[torch.Tensor], swizzled_scales: bool = False,
                        eplb_local_stats: Optional[torch.Tensor] = None) -> None:
    """The checks of the C++ ``Dispatch`` entry (all but the data pointers': see :func:`_offset_aligned`)."""
    check_sizes(*sizes)
    ep_size, max_num_tokens, top_k = sizes[0], sizes[1], sizes[2]
    _check_workspace(workspace, ep_rank, sizes)
    check_dispatch_inputs(topk_ids, payloads)
    if topk_ids.dtype not in _IDS:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [num_tokens, top_k], got {topk_ids.dim()} dims")
    _check_contiguous(topk_ids, "topk_ids")
    _check_same_device(topk_ids, workspace, "topk_ids", "workspace")
    if not 1 <= topk_ids.shape[1] <= top_k:
        raise ValueError(f"topk_ids has top_k={topk_ids.shape[1]}, the workspace was built for top_k <= {top_k}")
    _check_runtime_max(runtime_max, max_num_tokens)
    num_tokens = topk_ids.shape[0]
    if num_tokens > runtime_max:
        raise ValueError(f"topk_ids has {num_tokens} tokens, more than runtime_max_tokens_per_rank={runtime_max}")
    if not 1 <= num_experts < _MAX_NUM_EXPERTS:
        raise ValueError(f"num_experts must be in [1, 2^31), got {num_experts}")
    _check_counts(recv_counts, ep_size, workspace)
    _check_timeout(timeout_s)
    if eplb_local_stats is not None:
        check_eplb_local_stats(eplb_local_stats, workspace)
    _check_quant_format(quant_format)
    most = MAX_PAYLOADS - (quant_format != 0)
    if len(payloads) > most:
        raise ValueError(f"at most {most} payloads per dispatch, got {len(payloads)}")
    for i, p in enumerate(payloads):
        if p.dim() < 1 or p.shape[0] != num_tokens:
            raise ValueError(f"payloads[{i}] must have num_tokens={num_tokens} rows like topk_ids, got "
                             f"{tuple(p.shape)}")
        _check_contiguous(p, f"payloads[{i}]")
        _check_same_device(p, workspace, f"payloads[{i}]", "workspace")
    _check_quant_request(payloads, quant_format, global_scale, swizzled_scales, workspace)
    _check_payload_bytes(payloads, sizes, runtime_max, quant_format, swizzled_scales)


def check_eplb_local_stats(stats: torch.Tensor, ref: torch.Tensor, ref_name: str = "workspace",
                           num_experts: Optional[int] = None) -> None:
    """The C++ ``Dispatch`` entry's checks of ``eplb_local_stats``; with ``num_experts`` (a layer's
    ``eplb_stats_num_experts``) its length too."""
    check_tensor(stats, "eplb_local_stats")
    if stats.dtype != torch.int32:
        raise TypeError(f"eplb_local_stats must be int32, got dtype {stats.dtype}")
    length = stats.shape[0] if stats.dim() > 0 else 0
    if stats.dim() != 1 or not 1 <= length <= MAX_EPLB_EXPERTS:
        raise ValueError(f"eplb_local_stats must be [eplb_stats_num_experts] with 1 to {MAX_EPLB_EXPERTS} entries, "
                         f"got {stats.dim()} dims of {length} entries")
    if num_experts is not None and length != num_experts:
        raise ValueError(f"eplb_local_stats must be [eplb_stats_num_experts={num_experts}] int32, got {length} "
                         "entries")
    _check_contiguous(stats, "eplb_local_stats")
    _check_same_device(stats, ref, "eplb_local_stats", ref_name)


def _check_quant_format(quant_format: int) -> None:
    """``ToQuantFormat`` (csrc/workspace.h)."""
    if quant_format not in QUANT_FORMAT_CODES:
        raise ValueError(f"quant_format must be 0 (none), 1 (fp8_block), 2 (mxfp8) or 3 (nvfp4), got {quant_format}")


def _check_quant_request(payloads: Sequence[torch.Tensor], quant_format: int, global_scale: Optional[torch.Tensor],
                         swizzled_scales: bool, ref: torch.Tensor, ref_name: str = "workspace") -> None:
    """``CheckQuantPayload`` and ``MakeQuantRequest`` (csrc/workspace.h); ``ref``: the tensor whose device the
    global scale must be on."""
    wire = _WIRES.get(quant_format)
    if wire is not None:
        if not payloads or payloads[0].dim() != 2 or payloads[0].dtype not in (torch.bfloat16, torch.float16):
            raise TypeError("payloads[0] (the hidden states to quantize) must be [num_tokens, hidden] bfloat16 or "
                            "float16")
    nvfp4 = wire is not None and wire.name == "nvfp4"
    if (global_scale is not None) != nvfp4:
        raise ValueError("quant_format nvfp4 needs global_scale" if nvfp4
                         else "global_scale is only used by quant_format nvfp4")
    if nvfp4:
        if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
            raise ValueError(f"global_scale must be a float32 tensor of one element, got {global_scale.dtype} "
                             f"{tuple(global_scale.shape)}")
        _check_same_device(global_scale, ref, "global_scale", ref_name)
    _check_quant_shape(wire, payloads[0].shape[1] if wire is not None else 0, swizzled_scales)


def _check_quant_shape(wire: Optional[WireFormat], hidden: int, swizzled_scales: bool) -> None:
    """``MakeQuantRequest`` (csrc/workspace.h): what quantizing ``hidden`` elements into ``wire`` allows."""
    if wire is None:
        if swizzled_scales:
            raise ValueError("swizzled_scales needs a quant_format")
        return
    if not 1 <= hidden < _MAX_QUANT_HIDDEN:
        raise ValueError(f"the hidden size to quantize must be in [1, 2^30), got {hidden}")
    if swizzled_scales and wire.name == "fp8_block":
        raise ValueError("swizzled_scales needs one-byte scales (mxfp8 or nvfp4); fp8_block scales are fp32")


def _check_payload_bytes(payloads: Sequence[torch.Tensor], sizes: Sequence[int], runtime_max: int, quant_format: int,
                         swizzled_scales: bool) -> None:
    """The row and block sizes ``PlanRecvRegions`` (csrc/workspace.h) checks against the workspace's sizes; a
    quantized first payload counts as its values and scales (wire_formats, pinned to the C++ layout by
    tests/test_dynamic_shapes.py)."""
    max_num_tokens, dispatch_bytes = sizes[1], sizes[3]
    wire = _WIRES.get(quant_format)
    token_bytes = block_bytes = 0
    for i, p in enumerate(payloads):
        row = p.element_size() * math.prod(p.shape[1:])
        if row < 1:
            raise ValueError(f"payloads[{i}] has empty rows: shape {tuple(p.shape)}")
        if i == 0 and wire is not None:
            hidden = p.shape[1]
            values, scales = wire.value_bytes(hidden), wire.scale_bytes_per_token(hidden)
            token_bytes += values + scales
            block_bytes += runtime_max * values + (wire.swizzled_scale_bytes(runtime_max, hidden) if swizzled_scales
                                                   else runtime_max * scales)
        else:
            token_bytes += row
            block_bytes += runtime_max * row
    if token_bytes > dispatch_bytes:
        raise ValueError(f"payloads need {token_bytes} bytes per token, the workspace was sized for "
                         f"dispatch_bytes_per_token={dispatch_bytes}")
    if block_bytes > max_num_tokens * dispatch_bytes:
        raise ValueError(f"swizzled scales pad each source block to 128 rows: the payloads need {block_bytes} bytes "
                         f"per source block, the workspace holds max_num_tokens * dispatch_bytes_per_token = "
                         f"{max_num_tokens * dispatch_bytes}")


def check_combine_args(workspace: torch.Tensor, partials: Optional[torch.Tensor], recv_counts: torch.Tensor,
                       out: torch.Tensor, ep_rank: int, sizes: Sequence[int], runtime_max: int, timeout_s: float,
                       quant_format: int, one_gpu_per_rank: bool = False, combine_mode: int = 0) -> None:
    """The checks of the C++ ``Combine`` entry (all but the data pointers': see :func:`_offset_aligned`)."""
    check_sizes(*sizes)
    ep_size, max_num_tokens, combine_bytes = sizes[0], sizes[1], sizes[4]
    _check_workspace(workspace, ep_rank, sizes)
    _check_counts(recv_counts, ep_size, workspace)
    _check_runtime_max(runtime_max, max_num_tokens)
    check_tensor(out, "out")
    check_optional_tensor(partials, "partials")
    if out.dtype not in _FLOATS:
        raise TypeError(f"out must be bfloat16, float16 or float32, got {out.dtype}")
    if out.dim() != 2 or out.shape[0] > runtime_max:
        raise ValueError(f"out must be [num_tokens, hidden] with num_tokens <= runtime_max_tokens_per_rank="
                         f"{runtime_max}, got {tuple(out.shape)}")
    _check_contiguous(out, "out")
    _check_same_device(out, workspace, "out", "workspace")
    hidden = out.shape[1]
    if hidden < 1 or hidden * out.dtype.itemsize > combine_bytes:
        raise ValueError(f"combine rows of hidden={hidden} need {hidden * out.dtype.itemsize} bytes, the workspace "
                         f"was sized for combine_bytes_per_token={combine_bytes}")
    _check_timeout(timeout_s)
    if quant_format not in (0, 1):
        raise ValueError(f"combine quant_format must be 0 (none) or 1 (fp8_block), got {quant_format}")
    fp8_wire = quant_format == 1
    if fp8_wire:
        if out.dtype == torch.float32:
            raise TypeError("an FP8-wire combine needs bfloat16 or float16 out")
        if hidden % FP8_WIRE_HIDDEN_MULTIPLE or hidden > FP8_WIRE_MAX_HIDDEN:
            raise ValueError(f"an FP8-wire combine needs hidden % {FP8_WIRE_HIDDEN_MULTIPLE} == 0 and hidden <= "
                             f"{FP8_WIRE_MAX_HIDDEN}, got hidden={hidden}")
        if not _offset_aligned(out, 16):
            raise ValueError("an FP8-wire combine needs out 16-byte aligned")
    if partials is not None:
        if partials.dtype != out.dtype:
            raise TypeError(f"partials must have the dtype of out ({out.dtype}), got {partials.dtype}")
        if tuple(partials.shape) != (ep_size, runtime_max, hidden):
            raise ValueError(f"partials must be [ep_size={ep_size}, runtime_max_tokens_per_rank={runtime_max}, "
                             f"hidden={hidden}], got {tuple(partials.shape)}")
        _check_contiguous(partials, "partials")
        _check_same_device(partials, workspace, "partials", "workspace")
        # The C++ skips this for partials that are the workspace's combine region, which is 128-byte aligned.
        if fp8_wire and not _offset_aligned(partials, 16):
            raise ValueError("an FP8-wire combine needs partials 16-byte aligned")
    check_combine_mode_code(combine_mode, one_gpu_per_rank, hidden, out.dtype, combine_bytes, quant_format)


def check_sanitize_args(recv_topk_ids: torch.Tensor, recv_counts: torch.Tensor, invalid_id: int) -> None:
    """What the ``sanitize_expert_ids`` entry checks."""
    _check_on_gpu(recv_topk_ids, "recv_topk_ids")
    if recv_topk_ids.dtype not in _IDS:
        raise TypeError(f"recv_topk_ids must be int32 or int64, got {recv_topk_ids.dtype}")
    if recv_topk_ids.dim() != 3:
        raise ValueError(f"recv_topk_ids must be [ep_size, runtime_max, top_k], got {tuple(recv_topk_ids.shape)}")
    _check_contiguous(recv_topk_ids, "recv_topk_ids")
    _check_counts(recv_counts, recv_topk_ids.shape[0], recv_topk_ids, "recv_topk_ids")
    if recv_topk_ids.dtype == torch.int32 and not -(1 << 31) <= invalid_id < 1 << 31:
        raise ValueError(f"invalid_id={invalid_id} does not fit int32 recv_topk_ids")


# ---- the nccl transport's kernels (csrc/nccl.cu)


def _check_nccl_input(t: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    """``CheckNcclInput``: on the GPU, contiguous, on the device of ``ref``."""
    _check_on_gpu(t, name)
    _check_contiguous(t, name)
    _check_same_device(t, ref, name, ref_name)


def _check_nccl_aligned(t: torch.Tensor, name: str) -> None:
    """``CheckNcclAligned``: what the kernels move in 16-byte vectors."""
    if not _offset_aligned(t, WIRE_ALIGN):
        raise ValueError(f"{name} must start on a 16-byte boundary")


def _check_nccl_buffer(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    """``CheckNcclBuffer``: a uint8 buffer of the transport's of ``shape``."""
    if t.dtype != torch.uint8 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be uint8 of shape [{', '.join(map(str, shape))}] (the nccl transport's "
                         f"layout), got {t.dtype} {tuple(t.shape)}")


def _check_nccl_sizes(ep_size: int, runtime_max: int) -> None:
    if not 1 <= ep_size <= MAX_EP_SIZE:
        raise ValueError(f"ep_size must be in [1, {MAX_EP_SIZE}], got {ep_size}")
    if not 0 <= runtime_max < MAX_NUM_TOKENS_LIMIT:
        raise ValueError(f"runtime_max_tokens_per_rank must be in [0, 2^24), got {runtime_max}")


def _nccl_layout(ep_size: int, runtime_max: int, wire: Optional[WireFormat], hidden: int, swizzled: bool,
                 payload_rows: Sequence[int]) -> NcclWire:
    """``NcclLayoutOf``: the payload count, then the layout."""
    most = MAX_PAYLOADS - (wire is not None)
    if len(payload_rows) > most:
        raise ValueError(f"at most {most} payloads per dispatch{' that quantizes' if wire else ''}, got "
                         f"{len(payload_rows)}")
    return dispatch_wire(ep_size, runtime_max, payload_rows, wire, hidden, swizzled)


def _check_nccl_counts(recv_counts: torch.Tensor, ep_size: int, ref: torch.Tensor, ref_name: str) -> None:
    if recv_counts.dtype != torch.int32 or recv_counts.dim() != 1 or recv_counts.shape[0] != ep_size:
        raise ValueError(f"recv_counts must be int32 of shape [ep_size={ep_size}], got {recv_counts.dtype} "
                         f"{tuple(recv_counts.shape)}")
    _check_nccl_input(recv_counts, "recv_counts", ref, ref_name)


def check_nccl_pack_args(send: torch.Tensor, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], ep_size: int,
                         runtime_max: int, num_experts: int, quant_format: int, global_scale: Optional[torch.Tensor],
                         swizzled_scales: bool) -> None:
    """The checks of the C++ ``NcclPack`` entry."""
    check_dispatch_inputs(topk_ids, payloads)
    _check_nccl_sizes(ep_size, runtime_max)
    _check_on_gpu(send, "send")
    if topk_ids.dtype not in _IDS:
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2 or not 1 <= topk_ids.shape[1] <= MAX_TOP_K:
        raise ValueError(f"topk_ids must be [num_tokens, top_k] with top_k in [1, {MAX_TOP_K}], got "
                         f"{tuple(topk_ids.shape)}")
    _check_nccl_input(topk_ids, "topk_ids", send, "send")
    num_tokens = topk_ids.shape[0]
    if num_tokens > runtime_max:
        raise ValueError(f"topk_ids has {num_tokens} tokens, more than runtime_max_tokens_per_rank={runtime_max}")
    if not 1 <= num_experts < _MAX_NUM_EXPERTS:
        raise ValueError(f"num_experts must be in [1, 2^31), got {num_experts}")
    _check_quant_format(quant_format)
    _check_quant_request(payloads, quant_format, global_scale, swizzled_scales, send, "send")
    rows = []
    for i, p in enumerate(payloads[:MAX_PAYLOADS]):
        if p.dim() < 1 or p.shape[0] != num_tokens:
            raise ValueError(f"payloads[{i}] must have num_tokens={num_tokens} rows like topk_ids, got "
                             f"{tuple(p.shape)}")
        _check_nccl_input(p, f"payloads[{i}]", send, "send")
        rows.append(p.element_size() * math.prod(p.shape[1:]))
        if rows[-1] < 1:
            raise ValueError(f"payloads[{i}] has empty rows: shape {tuple(p.shape)}")
    rows += [1] * (len(payloads) - len(rows))  # counted, never laid out: more than the layout takes
    wire = _WIRES.get(quant_format)
    hidden = payloads[0].shape[1] if wire is not None else 0
    layout = _nccl_layout(ep_size, runtime_max, wire, hidden, swizzled_scales, rows)
    _check_nccl_buffer(send, "send", (layout.total_bytes,))
    _check_contiguous(send, "send")
    _check_nccl_aligned(send, "send")


def check_nccl_select_args(gathered: torch.Tensor, recv: Sequence[torch.Tensor], recv_counts: torch.Tensor,
                           ep_rank: int, runtime_max: int, quant_format: int, quant_hidden: int,
                           swizzled_scales: bool) -> None:
    """The checks of the C++ ``NcclSelect`` entry."""
    for i, r in enumerate(recv):
        check_tensor(r, f"recv[{i}]")
    if gathered.device.type not in _GPU or gathered.dim() != 2:
        raise ValueError(f"gathered must be a CUDA tensor of shape [ep_size, send bytes], got {tuple(gathered.shape)} "
                         f"on {gathered.device}")
    ep_size = gathered.shape[0]
    _check_nccl_sizes(ep_size, runtime_max)
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}), got {ep_rank}")
    _check_quant_format(quant_format)
    wire = _WIRES.get(quant_format)
    _check_quant_shape(wire, quant_hidden, swizzled_scales)
    least = 2 if wire is not None else 0
    if not least <= len(recv) <= MAX_PAYLOADS:
        raise ValueError(f"recv must hold one tensor per received segment: at most {MAX_PAYLOADS}"
                         f"{', at least 2' if least else ''}, got {len(recv)}")
    expected = quant_row_bytes(wire, quant_hidden, swizzled_scales) if wire is not None else (0, 0)
    payload_rows = [0] if wire is not None else []
    for s, r in enumerate(recv):
        name = f"recv[{s}]"
        _check_nccl_input(r, name, gathered, "gathered")
        _check_nccl_aligned(r, name)
        tiles = swizzled_scales and s == 1
        row_bytes = r.element_size() * math.prod(r.shape[1:])
        if tiles:
            shaped = r.dim() == 2 and r.shape[0] == ep_size and row_bytes == wire.swizzled_scale_bytes(runtime_max,
                                                                                                      quant_hidden)
        else:
            shaped = r.dim() >= 2 and r.shape[0] == ep_size and r.shape[1] == runtime_max
        if not shaped:
            raise ValueError(f"{name} must be [ep_size={ep_size}, "
                             f"{'swizzled scale bytes of one source block' if tiles else 'runtime_max'}, ...], got "
                             f"{tuple(r.shape)}")
        row = expected[1] if tiles else r.element_size() * math.prod(r.shape[2:])
        if wire is not None and s < 2 and row != expected[s]:
            raise ValueError(f"{name} must hold {expected[s]}-byte rows (the {'values' if s == 0 else 'scales'} of "
                             f"hidden={quant_hidden})")
        if wire is None or s >= 2:
            payload_rows.append(row)
    layout = _nccl_layout(ep_size, runtime_max, wire, quant_hidden, swizzled_scales, payload_rows)
    _check_nccl_buffer(gathered, "gathered", (ep_size, layout.total_bytes))
    _check_contiguous(gathered, "gathered")
    _check_nccl_aligned(gathered, "gathered")
    _check_nccl_counts(recv_counts, ep_size, gathered, "gathered")


def _check_nccl_partials(partials: torch.Tensor, ep_rank: int, fp8_wire: bool) -> tuple[int, int, int, int]:
    """``CheckNcclPartials``: ``(ep_size, runtime_max, hidden, wire row bytes)``."""
    half = partials.dtype in (torch.bfloat16, torch.float16)
    if not (half or (not fp8_wire and partials.dtype == torch.float32)):
        raise TypeError(f"partials must be bfloat16, float16{' (the FP8 wire)' if fp8_wire else ' or float32'}, got "
                        f"{partials.dtype}")
    if partials.dim() != 3:
        raise ValueError(f"partials must be [ep_size, runtime_max, hidden], got {tuple(partials.shape)}")
    _check_on_gpu(partials, "partials")
    _check_contiguous(partials, "partials")
    if fp8_wire:
        _check_nccl_aligned(partials, "partials")
    ep_size, runtime_max, hidden = partials.shape
    _check_nccl_sizes(ep_size, runtime_max)
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank must be in [0, ep_size={ep_size}), got {ep_rank}")
    if hidden < 1 or (fp8_wire and hidden % FP8_WIRE_HIDDEN_MULTIPLE):
        raise ValueError(f"partials' hidden={hidden} must be "
                         f"{'a positive multiple of 8 (the FP8 wire)' if fp8_wire else '>= 1'}")
    return ep_size, runtime_max, hidden, fp8_wire_row_bytes(hidden) if fp8_wire else hidden * partials.element_size()


def check_nccl_combine_wire_args(wire: torch.Tensor, partials: torch.Tensor, recv_counts: torch.Tensor,
                                 ep_rank: int) -> None:
    """The checks of the C++ ``NcclCombineWire`` entry."""
    ep_size, runtime_max, _, row = _check_nccl_partials(partials, ep_rank, True)
    _check_nccl_buffer(wire, "wire", (ep_size * runtime_max, row))
    _check_nccl_input(wire, "wire", partials, "partials")
    _check_nccl_aligned(wire, "wire")
    _check_nccl_counts(recv_counts, ep_size, partials, "partials")


def check_nccl_combine_sum_args(out: torch.Tensor, returned: torch.Tensor, send: torch.Tensor, partials: torch.Tensor,
                                ep_rank: int, fp8_wire: bool) -> None:
    """The checks of the C++ ``NcclCombineSum`` entry."""
    ep_size, runtime_max, hidden, row = _check_nccl_partials(partials, ep_rank, fp8_wire)
    if out.dtype != partials.dtype:
        raise TypeError(f"out must have the partials' dtype ({partials.dtype}), got {out.dtype}")
    if out.dim() != 2 or out.shape[1] != hidden or out.shape[0] > runtime_max:
        raise ValueError(f"out must be [num_tokens, hidden={hidden}] with num_tokens <= runtime_max={runtime_max}, "
                         f"got {tuple(out.shape)}")
    _check_nccl_input(out, "out", partials, "partials")
    if fp8_wire:
        _check_nccl_aligned(out, "out")
    _check_nccl_buffer(returned, "returned", (ep_size * runtime_max, row))
    _check_nccl_input(returned, "returned", partials, "partials")
    _check_nccl_aligned(returned, "returned")
    mask_bytes = -(-ep_size // 8) * -(-runtime_max // WIRE_ALIGN) * WIRE_ALIGN
    if send.dtype != torch.uint8 or send.dim() != 1 or send.shape[0] < mask_bytes:
        raise ValueError(f"send must be the uint8 send buffer of the dispatch (its mask planes first), got "
                         f"{send.dtype} {tuple(send.shape)}")
    _check_nccl_input(send, "send", partials, "partials")
    _check_nccl_aligned(send, "send")


def check_topk_ids_on_host(topk_ids: torch.Tensor, num_experts: int) -> None:
    """ValueError naming the first expert id outside -1 and ``[0, num_experts)`` (reads the ids on the host: a
    synchronization with this rank's stream, for debug mode only)."""
    if topk_ids.numel() == 0:
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < -1 or high >= num_experts:
        bad = low if low < -1 else high
        raise ValueError(f"topk_ids holds expert id {bad}; valid ids are -1 (no expert) and 0..{num_experts - 1}")


def quant_format_of(name: Optional[str]) -> Optional[WireFormat]:
    return None if name is None else wire_format(name, "quant_format")


def global_scale_tensor(global_scale, workspace: torch.Tensor) -> Optional[torch.Tensor]:
    if global_scale is None or isinstance(global_scale, torch.Tensor):
        return global_scale
    return torch.full((1,), float(global_scale), dtype=torch.float32, device=workspace.device)


def check_dispatch_call(topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max_tokens_per_rank: int,
                        quant_format: Optional[str] = None) -> Optional[WireFormat]:
    """The host checks of a dispatch's tensors (kinds, token counts, payload count; the C++ checks the rest) with
    errors in the caller's terms; returns the quantization format asked for."""
    check_dispatch_inputs(topk_ids, payloads)
    fmt = quant_format_of(quant_format)
    if len(payloads) > MAX_PAYLOADS - (fmt is not None):
        raise ValueError(f"payloads: at most {MAX_PAYLOADS - (fmt is not None)} tensors per dispatch"
                         f"{' that quantizes' if fmt else ''}, got {len(payloads)}")
    num_tokens = topk_ids.shape[0] if topk_ids.dim() == 2 else -1
    if num_tokens < 0 or num_tokens > runtime_max_tokens_per_rank:
        raise ValueError(
            f"topk_ids must be [num_tokens, top_k] with num_tokens <= runtime_max_tokens_per_rank="
            f"{runtime_max_tokens_per_rank}, got {tuple(topk_ids.shape)}"
        )
    for i, p in enumerate(payloads):
        if p.dim() < 1 or p.shape[0] != num_tokens:
            raise ValueError(f"payloads[{i}] must be [num_tokens={num_tokens}, ...], got {tuple(p.shape)}")
    return fmt
