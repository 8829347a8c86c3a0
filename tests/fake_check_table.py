"""Inputs each C++ check of the ops' entries refuses (:data:`TABLE`, keyed as :mod:`tests.cxx_checks` names the
checks), built as fake or real tensors by whoever calls them."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import functional as F
from flashinfer_a2a.jit import get_a2a_module
from flashinfer_a2a.library import ops as fa_ops

_METAINFO = len(fa_ops.METAINFO_NAMES)
SIZES = dict(ep_size=2, max_num_tokens=16, top_k=4, dispatch_bytes_per_token=4096, combine_bytes_per_token=512)


def tensor(dtype: torch.dtype, shape: tuple, device: str = "cuda", *, strides: Optional[tuple] = None,
           offset: int = 0) -> torch.Tensor:
    """An uninitialized tensor: ``strides`` and a storage ``offset`` (in elements) make a view."""
    if strides is None:
        strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    extent = offset + (1 + sum((n - 1) * s for n, s in zip(shape, strides)) if all(shape) else 0)
    return torch.empty(extent, dtype=dtype, device=device).as_strided(shape, strides, offset)


def ws_bytes(**sizes) -> int:
    return fa.get_workspace_size(*dict(SIZES, **sizes).values())


def workspace(device: str = "cuda", sizes: Optional[dict] = None, **view) -> torch.Tensor:
    sizes = SIZES if sizes is None else sizes
    return tensor(torch.uint8, (sizes["ep_size"], ws_bytes(**sizes)), device, **view)


def _foreign_workspace() -> torch.Tensor:
    """A fake workspace on a device that is neither CUDA nor the CPU (XPU). Some torch builds initialize the device's
    runtime even for a fake tensor and refuse (torch 2.11: 'Torch not compiled with XPU enabled'): skipped there."""
    try:
        return workspace("xpu")
    except (AssertionError, RuntimeError) as exc:
        pytest.skip(f"this torch cannot make a fake XPU tensor ({exc})")


def ids(*shape: int, dtype=torch.int32, device="cuda", **view) -> torch.Tensor:
    return tensor(dtype, shape, device, **view)


def rows(*shape: int, dtype=torch.bfloat16, device="cuda", **view) -> torch.Tensor:
    return tensor(dtype, shape, device, **view)


def counts(n: int = 2, dtype=torch.int32, device="cuda", **view) -> torch.Tensor:
    return tensor(dtype, (n,), device, **view)


def valid_args(op: str, sizes: dict, given: dict) -> dict:
    """The arguments of ``op`` (keywords of its schema), each taken from ``given`` or else one its fake and its C++
    entry accept with ``sizes``."""
    def arg(name, make):
        return given[name] if name in given else make()

    if op == "get_workspace_size":
        return dict(sizes)
    if op.startswith("nccl_"):
        from .fake_check_table_nccl import valid_args as nccl_valid_args

        return nccl_valid_args(op, sizes, given)
    if op == "sanitize_expert_ids":
        return dict(recv_topk_ids=arg("recv_topk_ids", lambda: ids(2, 16, 4)), recv_counts=arg("recv_counts", counts),
                    invalid_id=given.get("invalid_id", -1))
    args = dict(workspace=arg("workspace", lambda: workspace(sizes=sizes)), ep_rank=given.get("ep_rank", 0), **sizes)
    if op == "initialize":
        args["metainfo"] = arg("metainfo", lambda: tensor(torch.int64, (len(fa_ops.METAINFO_NAMES),), "cpu"))
        return args
    args["recv_counts"] = arg("recv_counts", counts)
    defaults = {
        "dispatch": dict(topk_ids=lambda: ids(5, 4), payloads=lambda: [rows(5, 256)], runtime_max_tokens_per_rank=16,
                         num_experts=8, timeout_s=10.0, quant_format=0, global_scale=None, swizzled_scales=False,
                         phase=0, num_sms=0, eplb_local_stats=None),
        "dispatch_recv": dict(runtime_max_tokens_per_rank=16, timeout_s=10.0),
        "combine": dict(partials=lambda: rows(2, 16, 128), out=lambda: rows(5, 128), runtime_max_tokens_per_rank=16,
                        timeout_s=10.0, one_gpu_per_rank=False, quant_format=0, combine_mode=0, phase=0, num_sms=0),
    }[op]
    for name, default in defaults.items():
        args[name] = arg(name, default if callable(default) else lambda default=default: default)
    return args


def call_op(op: str, change: dict) -> None:
    """Calls ``op`` with the arguments of :func:`valid_args` but those in ``change`` (sizes included)."""
    change = dict(change)
    sizes = {name: change.pop(name, value) for name, value in SIZES.items()}
    getattr(torch.ops.flashinfer_a2a, op)(**valid_args(op, sizes, change))


@dataclasses.dataclass(frozen=True)
class Bad:
    """An input of ``op`` with one mistake: ``change`` (called where the tensors are made) returns the arguments
    that differ from :func:`valid_args`, sizes included. The refusal must be ``error`` with a message matching
    ``match``. ``real``: the input exists on a GPU too (the library is then asked to refuse it as well)."""

    op: str
    change: Callable[[], dict]
    error: type
    match: str
    real: bool = True

    def run(self) -> None:
        call_op(self.op, self.change())

    run_real = run


@dataclasses.dataclass(frozen=True)
class Before(Bad):
    """A mistake no op argument can carry (the dispatcher takes no None in a ``Tensor[]``): the Python layer refuses
    it before the op (``call``, under FakeTensorMode); ``library_call`` hands it to the C++ entry itself."""

    call: Callable[[], None] = None
    library_call: Callable[[], None] = None

    def run(self) -> None:
        self.call()

    def run_real(self) -> None:
        self.library_call()


@dataclasses.dataclass(frozen=True)
class Unreachable:
    """A C++ check that no input of the op can fail: an earlier check (``earlier``, the key of its row) refuses
    every input that would. ``attempts`` break this check's condition; each must be refused with ``earlier``'s
    message and with none of this check's (tests/test_fake_checks.py runs them through the fake, and on a GPU
    through the library)."""

    why: str
    earlier: str = ""
    attempts: tuple[Bad, ...] = ()


def quantizing(fmt: int, hidden: int = 256, tokens: int = 5, **change) -> dict:
    """A dispatch quantizing ``payloads[0]`` ``[tokens, hidden]`` bf16 (code 1 fp8_block, 2 mxfp8, 3 nvfp4)."""
    out = dict(quant_format=fmt, topk_ids=ids(tokens, 4), payloads=[rows(tokens, hidden)])
    if fmt == 3:
        out["global_scale"] = tensor(torch.float32, (1,))
    return dict(out, **change)


def fp8_combine(**change) -> dict:
    """A combine over the FP8 wire (zero-copy input unless ``partials`` is given)."""
    return dict(dict(quant_format=1, partials=None), **change)


def push_combine(**change) -> dict:
    return dict(dict(combine_mode=1, one_gpu_per_rank=True, partials=None), **change)


def _dispatch_with_none() -> None:
    F.dispatch(workspace(), 0, F.WorkspaceConfig(**SIZES), ids(5, 4), [rows(5, 256), None], 16, 8)


def _library_dispatch_with_none() -> None:
    get_a2a_module().dispatch(workspace(), ids(5, 4), [rows(5, 256), None], counts(), 0, *SIZES.values(), 16, 8,
                              10.0, 0, None, False, 0, 0, False)


_MAKE_CONFIG = ("MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, "
                "combine_bytes_per_token)")
_CUDA_WORKSPACE = "CheckCudaWorkspace(workspace, ep_rank, config)"
_COUNTS = "CheckRecvCounts(recv_counts, workspace, ep_size)"
_T = (5, 4)  # the strides of a [4, 5] tensor's transpose: a [5, 4] view that is not contiguous
_QUANT_PAYLOAD = ("CheckQuantPayload: !payloads.empty() && TensorView(payloads[0]).ndim() == 2 && "
                  "(IsDType(payloads[0], kDLBfloat, 16) || IsDType(payloads[0], kDLFloat, 16))")

#: every C++ check an op's entry reaches -> the inputs that fail it (or why none can)
TABLE: dict[str, Bad | tuple[Bad, ...] | Unreachable] = {
    # ---- sizes: MakeWorkspaceConfig (csrc/workspace.h), in every entry
    "MakeWorkspaceConfig: ep_size >= 1 && ep_size <= kMaxRanks": (
        Bad("get_workspace_size", lambda: dict(ep_size=0), ValueError, r"ep_size must be in \[1, 72\], got 0"),
        Bad("get_workspace_size", lambda: dict(ep_size=73), ValueError, "ep_size must be in")),
    "MakeWorkspaceConfig: max_num_tokens >= 1 && max_num_tokens < (int64_t{1} << kRouteSlotBits)": (
        Bad("get_workspace_size", lambda: dict(max_num_tokens=0), ValueError, "max_num_tokens must be in"),
        Bad("get_workspace_size", lambda: dict(max_num_tokens=1 << 24), ValueError, "max_num_tokens must be in")),
    "MakeWorkspaceConfig: top_k >= 1 && top_k <= kMaxTopK": (
        Bad("get_workspace_size", lambda: dict(top_k=0), ValueError, "top_k must be in"),
        Bad("get_workspace_size", lambda: dict(top_k=33), ValueError, "top_k must be in")),
    "MakeWorkspaceConfig: dispatch_bytes_per_token >= 0":
        Bad("get_workspace_size", lambda: dict(dispatch_bytes_per_token=-1), ValueError, "dispatch_bytes_per_token"),
    "MakeWorkspaceConfig: combine_bytes_per_token >= 0":
        Bad("get_workspace_size", lambda: dict(combine_bytes_per_token=-1), ValueError, "combine_bytes_per_token"),
    f"GetWorkspaceSize: {_MAKE_CONFIG}":
        Bad("get_workspace_size", lambda: dict(top_k=40), ValueError, "top_k must be in"),
    f"Initialize: {_MAKE_CONFIG}":
        Bad("initialize", lambda: dict(ep_size=80, workspace=workspace()), ValueError, "ep_size must be in"),
    f"Dispatch: {_MAKE_CONFIG}":
        Bad("dispatch", lambda: dict(max_num_tokens=0, workspace=workspace()), ValueError, "max_num_tokens"),
    f"DispatchRecv: {_MAKE_CONFIG}":
        Bad("dispatch_recv", lambda: dict(top_k=0, workspace=workspace()), ValueError, "top_k must be in"),
    f"Combine: {_MAKE_CONFIG}":
        Bad("combine", lambda: dict(combine_bytes_per_token=-2, workspace=workspace()), ValueError,
            "combine_bytes_per_token must be >= 0"),
    # ---- the workspace: CheckCudaWorkspace (csrc/workspace.h), CheckRank and CheckWorkspace (csrc/common.h)
    "CheckRank: ep_rank >= 0 && ep_rank < ep_size": (
        Bad("dispatch", lambda: dict(ep_rank=2), ValueError, r"ep_rank must be in \[0, ep_size=2\), got 2"),
        Bad("combine", lambda: dict(ep_rank=-1), ValueError, r"ep_rank must be in \[0, ep_size=2\), got -1")),
    "CheckCudaWorkspace: CheckRank(ep_rank, config.ep_size)":
        Bad("dispatch_recv", lambda: dict(ep_rank=5), ValueError, "ep_rank must be in"),
    "Initialize: CheckRank(ep_rank, ep_size)":
        Bad("initialize", lambda: dict(ep_rank=2), ValueError, "ep_rank must be in"),
    "CheckCudaWorkspace: IsCuda(workspace)":
        Bad("dispatch", lambda: dict(workspace=workspace("cpu")), ValueError, "workspace must be a CUDA tensor"),
    "CheckCudaWorkspace: CheckWorkspace(workspace, config.ep_size, layout.total_bytes)":
        Bad("combine", lambda: dict(workspace=tensor(torch.int8, (2, ws_bytes()))), TypeError,
            "workspace must be uint8"),
    f"Dispatch: {_CUDA_WORKSPACE}":
        Bad("dispatch", lambda: dict(workspace=workspace("cpu"), ep_rank=1), ValueError, "must be a CUDA tensor"),
    f"DispatchRecv: {_CUDA_WORKSPACE}":
        Bad("dispatch_recv", lambda: dict(workspace=workspace("cpu")), ValueError, "workspace must be a CUDA tensor"),
    f"Combine: {_CUDA_WORKSPACE}":
        Bad("combine", lambda: dict(workspace=workspace("cpu")), ValueError, "workspace must be a CUDA tensor"),
    "Initialize: CheckWorkspace(workspace, ep_size, layout.total_bytes)":
        Bad("initialize", lambda: dict(workspace=tensor(torch.uint8, (2, ws_bytes() - 128))), ValueError,
            "the layout needs"),
    "CheckWorkspace: IsDType(workspace, kDLUInt, 8)":
        Bad("dispatch", lambda: dict(workspace=tensor(torch.int8, (2, ws_bytes()))), TypeError,
            "workspace must be uint8"),
    "CheckWorkspace: workspace.ndim() == 2 && workspace.size(0) == ep_size": (
        Bad("dispatch", lambda: dict(workspace=tensor(torch.uint8, (3, ws_bytes()))), ValueError,
            r"workspace must have shape \[ep_size=2"),
        Bad("combine", lambda: dict(workspace=tensor(torch.uint8, (2 * ws_bytes(),))), ValueError,
            r"workspace must have shape \[ep_size=2")),
    "CheckWorkspace: workspace.stride(1) == 1":
        Bad("dispatch", lambda: dict(workspace=workspace(strides=(2 * ws_bytes(), 2))), ValueError,
            "workspace rows must be contiguous"),
    "CheckWorkspace: workspace.size(1) >= required_bytes":
        Bad("combine", lambda: dict(workspace=tensor(torch.uint8, (2, ws_bytes() - 128))), ValueError,
            "bytes per rank, the layout needs"),
    "CheckWorkspace: reinterpret_cast<uintptr_t>(BytePtr(workspace)) % 128 == 0 && workspace.stride(0) % 128 == 0": (
        Bad("dispatch", lambda: dict(workspace=workspace(offset=64)), ValueError, "128-byte boundaries"),
        Bad("dispatch_recv", lambda: dict(workspace=workspace(strides=(ws_bytes() + 64, 1))), ValueError,
            "128-byte boundaries")),
    # ---- the counts and the helpers every tensor goes through (csrc/common.h)
    "CheckRecvCounts: IsDType(recv_counts, kDLInt, 32) && recv_counts.ndim() == 1 && recv_counts.size(0) == ep_size": (
        Bad("dispatch", lambda: dict(recv_counts=counts(dtype=torch.int64)), ValueError, "recv_counts must be int32"),
        Bad("dispatch_recv", lambda: dict(recv_counts=ids(2, 1)), ValueError, r"shape \[ep_size=2\]"),
        Bad("combine", lambda: dict(recv_counts=counts(3)), ValueError, r"shape \[ep_size=2\]")),
    'CheckRecvCounts: CheckContiguous(recv_counts, "recv_counts")':
        Bad("dispatch", lambda: dict(recv_counts=counts(strides=(2,))), ValueError, "recv_counts must be contiguous"),
    'CheckRecvCounts: CheckSameDevice(recv_counts, workspace, "recv_counts", "workspace")':
        Bad("dispatch_recv", lambda: dict(recv_counts=counts(device="cpu")), ValueError,
            "recv_counts must be on the same device as workspace"),
    f"Dispatch: {_COUNTS}": Bad("dispatch", lambda: dict(recv_counts=counts(1)), ValueError, "recv_counts"),
    f"DispatchRecv: {_COUNTS}":
        Bad("dispatch_recv", lambda: dict(recv_counts=counts(dtype=torch.uint8)), ValueError, "recv_counts"),
    f"Combine: {_COUNTS}": Bad("combine", lambda: dict(recv_counts=counts(device="cpu")), ValueError, "recv_counts"),
    "CheckContiguous: t.IsContiguous()":
        Bad("combine", lambda: dict(out=rows(5, 128, strides=(1, 5))), ValueError, "out must be contiguous"),
    "CheckSameDevice: t.device().device_type == ref.device().device_type && t.device().device_id == "
    "ref.device().device_id":
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 4, device="cpu")), ValueError,
            "topk_ids must be on the same device as workspace"),
    "CheckSmBudget: num_sms >= 0": Bad("dispatch", lambda: dict(num_sms=-1), ValueError, "num_sms must be >= 0"),
    "TimeoutNs: timeout_s > 0 && timeout_s < 1e6": (
        Bad("dispatch_recv", lambda: dict(timeout_s=0.0), ValueError, r"timeout_s must be in \(0, 1e6\)"),
        Bad("dispatch_recv", lambda: dict(timeout_s=1e6), ValueError, "timeout_s must be in")),
    # ---- Initialize (csrc/workspace.cu)
    "Initialize: IsDType(metainfo, kDLInt, 64) && metainfo.ndim() == 1 && metainfo.size(0) == kNumMetainfo && "
    "metainfo.IsContiguous() && metainfo.device().device_type == kDLCPU": (
        Bad("initialize", lambda: dict(metainfo=tensor(torch.int32, (_METAINFO,), "cpu")), ValueError, "metainfo must be"),
        Bad("initialize", lambda: dict(metainfo=tensor(torch.int64, (_METAINFO, 1), "cpu")), ValueError, "metainfo must be"),
        Bad("initialize", lambda: dict(metainfo=tensor(torch.int64, (_METAINFO - 1,), "cpu")), ValueError, rf"shape \[{_METAINFO}\]"),
        Bad("initialize", lambda: dict(metainfo=tensor(torch.int64, (_METAINFO,), "cpu", strides=(2,))), ValueError,
            "metainfo must be a contiguous"),
        Bad("initialize", lambda: dict(metainfo=tensor(torch.int64, (16,))), ValueError, "CPU int64")),
    # A real tensor here is on CUDA or the CPU; a fake one may claim another device.
    "Initialize: IsCuda(workspace)":
        Bad("initialize", lambda: dict(workspace=_foreign_workspace()), ValueError,
            r"workspace must be a CUDA \(or CPU\) tensor", real=False),
    # ---- Dispatch (csrc/dispatch.cu)
    "Dispatch: payloads[p].defined()":
        Before("dispatch", dict, TypeError, r"payloads\[1\] must be a", call=_dispatch_with_none,
               library_call=_library_dispatch_with_none),
    "Dispatch: phase == 0 || phase == 1":
        Bad("dispatch", lambda: dict(phase=2), ValueError, "dispatch phase must be 0"),
    "Dispatch: IsDType(topk_ids, kDLInt, 32) || IsDType(topk_ids, kDLInt, 64)": (
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 4, dtype=torch.float32)), TypeError, "topk_ids must be int32"),
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 4, dtype=torch.int16)), TypeError, "topk_ids must be int32")),
    "Dispatch: topk_ids.ndim() == 2": (
        Bad("dispatch", lambda: dict(topk_ids=ids(5)), ValueError, r"topk_ids must be \[num_tokens, top_k\]"),
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 4, 1)), ValueError, r"topk_ids must be \[num_tokens, top_k\]")),
    "Dispatch: topk_ids.size(1) >= 1 && topk_ids.size(1) <= top_k": (
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 6)), ValueError, "top_k <= 4"),
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 0)), ValueError, "topk_ids has top_k=0")),
    "Dispatch: num_tokens <= runtime_max_tokens_per_rank":
        Bad("dispatch", lambda: dict(runtime_max_tokens_per_rank=4), ValueError,
            "more than runtime_max_tokens_per_rank=4"),
    "Dispatch: num_experts >= 1 && num_experts < (int64_t{1} << 31)": (
        Bad("dispatch", lambda: dict(num_experts=0), ValueError, r"num_experts must be in \[1, 2\^31\)"),
        Bad("dispatch", lambda: dict(num_experts=1 << 31), ValueError, "num_experts must be in")),
    "Dispatch: payload.ndim() >= 1 && payload.size(0) == num_tokens": (
        Bad("dispatch", lambda: dict(payloads=[rows(4, 256)]), ValueError, r"payloads\[0\] must have num_tokens=5"),
        Bad("dispatch", lambda: dict(payloads=[rows(5, 8), rows()]), ValueError, r"payloads\[1\] must have")),
    "Dispatch: payload.IsContiguous()":
        Bad("dispatch", lambda: dict(payloads=[rows(5, 4, strides=_T)]), ValueError,
            r"payloads\[0\] must be contiguous"),
    "Dispatch: payload.device().device_type == workspace.device().device_type && payload.device().device_id == "
    "workspace.device().device_id":
        Bad("dispatch", lambda: dict(payloads=[rows(5, 8), rows(5, 8, device="cpu")]), ValueError,
            r"payloads\[1\] must be on the same device as workspace"),
    "Dispatch: CheckSmBudget(num_sms)": Bad("dispatch", lambda: dict(num_sms=-2), ValueError, "num_sms"),
    'Dispatch: CheckContiguous(topk_ids, "topk_ids")':
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 4, strides=_T)), ValueError, "topk_ids must be contiguous"),
    'Dispatch: CheckSameDevice(topk_ids, workspace, "topk_ids", "workspace")':
        Bad("dispatch", lambda: dict(topk_ids=ids(5, 4, device="cpu")), ValueError, "topk_ids must be on the same"),
    "Dispatch: TimeoutNs(timeout_s)": Bad("dispatch", lambda: dict(timeout_s=-1.0), ValueError, "timeout_s"),
    "Dispatch: IsDType(stats, kDLInt, 32)":
        Bad("dispatch", lambda: dict(eplb_local_stats=ids(8, dtype=torch.int64)), TypeError,
            "eplb_local_stats must be int32"),
    "Dispatch: stats.ndim() == 1 && stats.size(0) >= 1 && stats.size(0) <= kMaxEplbExperts": (
        Bad("dispatch", lambda: dict(eplb_local_stats=ids(2, 4)), ValueError,
            r"eplb_local_stats must be \[eplb_stats_num_experts\]"),
        Bad("dispatch", lambda: dict(eplb_local_stats=ids(0)), ValueError, "with 1 to 1024 entries"),
        Bad("dispatch", lambda: dict(eplb_local_stats=ids(1025)), ValueError, "got 1 dims of 1025 entries")),
    'Dispatch: CheckContiguous(stats, "eplb_local_stats")':
        Bad("dispatch", lambda: dict(eplb_local_stats=ids(8, strides=(2,))), ValueError,
            "eplb_local_stats must be contiguous"),
    'Dispatch: CheckSameDevice(stats, workspace, "eplb_local_stats", "workspace")':
        Bad("dispatch", lambda: dict(eplb_local_stats=ids(8, device="cpu")), ValueError,
            "eplb_local_stats must be on the same device as workspace"),
    'Dispatch: CheckQuantPayload(ToQuantFormat(quant_format), payloads, global_scale, workspace, "workspace", '
    'swizzled_scales)':
        Bad("dispatch", lambda: quantizing(3, global_scale=None), ValueError, "quant_format nvfp4 needs global_scale"),
    "Dispatch: ToQuantFormat(quant_format)": Bad("dispatch", lambda: dict(quant_format=4), ValueError, "quant_format"),
    "Dispatch: PlanRecvRegions(config, layout, runtime_max_tokens_per_rank, rows, quant)":
        # issue #43: rows wider than the workspace's, refused only on the GPU before
        Bad("dispatch", lambda: dict(payloads=[rows(5, 2049)]), ValueError,
            "payloads need 4098 bytes per token, the workspace was sized for dispatch_bytes_per_token=4096"),
    "ToQuantFormat: format >= 0 && format <= 3": (
        Bad("dispatch", lambda: dict(quant_format=5), ValueError, r"quant_format must be 0 \(none\)"),
        Bad("dispatch", lambda: dict(quant_format=-1), ValueError, "quant_format must be 0")),
    _QUANT_PAYLOAD: (
        Bad("dispatch", lambda: quantizing(1, payloads=[]), TypeError,
            r"payloads\[0\] \(the hidden states to quantize"),
        Bad("dispatch", lambda: quantizing(2, payloads=[rows(5, 2, 128)]), TypeError, r"payloads\[0\] \(the hidden"),
        Bad("dispatch", lambda: quantizing(1, payloads=[rows(5, 256, dtype=torch.float32)]), TypeError,
            "bfloat16 or float16")),
    "CheckQuantPayload: global_scale.has_value() == nvfp4": (
        Bad("dispatch", lambda: quantizing(3, global_scale=None), ValueError, "nvfp4 needs global_scale"),
        Bad("dispatch", lambda: quantizing(2, global_scale=tensor(torch.float32, (1,))), ValueError,
            "global_scale is only used by quant_format nvfp4"),
        Bad("dispatch", lambda: dict(global_scale=tensor(torch.float32, (1,))), ValueError, "only used by")),
    "CheckQuantPayload: IsDType(gs, kDLFloat, 32) && gs.numel() == 1": (
        Bad("dispatch", lambda: quantizing(3, global_scale=tensor(torch.float16, (1,))), ValueError,
            "global_scale must be a float32 tensor of one element"),
        Bad("dispatch", lambda: quantizing(3, global_scale=tensor(torch.float32, (2,))), ValueError,
            "global_scale must be a float32 tensor of one element")),
    'CheckQuantPayload: CheckSameDevice(gs, ref, "global_scale", ref_name)':
        Bad("dispatch", lambda: quantizing(3, global_scale=tensor(torch.float32, (1,), "cpu")), ValueError,
            "global_scale must be on the same device as workspace"),
    "CheckQuantPayload: MakeQuantRequest(format, hidden, swizzled_scales)":
        Bad("dispatch", lambda: quantizing(2, hidden=0), ValueError, "the hidden size to quantize"),
    "MakeQuantRequest: !swizzled":
        Bad("dispatch", lambda: dict(swizzled_scales=True), ValueError, "swizzled_scales needs a quant_format"),
    "MakeQuantRequest: hidden >= 1 && hidden < (int64_t{1} << 30)": (
        Bad("dispatch", lambda: quantizing(3, hidden=0), ValueError,
            r"the hidden size to quantize must be in \[1, 2\^30\)"),
        Bad("dispatch", lambda: quantizing(1, hidden=1 << 30, tokens=0), ValueError, "the hidden size to quantize")),
    "MakeQuantRequest: !swizzled || q.format != QuantFormat::kFp8Block":
        Bad("dispatch", lambda: quantizing(1, swizzled_scales=True), ValueError,
            "swizzled_scales needs one-byte scales"),
    # ---- PlanRecvRegions (csrc/workspace.h): the payloads against the workspace's sizes
    "PlanRecvRegions: runtime_max >= 0 && runtime_max <= config.max_num_tokens":
        Bad("dispatch", lambda: dict(runtime_max_tokens_per_rank=17), ValueError,
            r"runtime_max_tokens_per_rank must be in \[0, max_num_tokens=16\]"),
    "PlanRecvRegions: num_payloads <= max_payloads": (
        Bad("dispatch", lambda: dict(payloads=[rows(5, 8)] * 9), ValueError, "at most 8 payloads per dispatch"),
        Bad("dispatch", lambda: quantizing(1, payloads=[rows(5, 256)] + [rows(5, 8)] * 7), ValueError,
            "at most 7 payloads")),
    "PlanRecvRegions: !quantize || num_payloads >= 1":
        Unreachable("CheckQuantPayload refuses a quantizing dispatch without payloads[0] first (TypeError)",
                    _QUANT_PAYLOAD, (Bad("dispatch", lambda: quantizing(1, payloads=[]), TypeError,
                                         r"payloads\[0\] \(the hidden states to quantize"),
                                     Bad("dispatch", lambda: quantizing(3, payloads=[]), TypeError,
                                         r"payloads\[0\] \(the hidden states to quantize"))),
    # The C++ says "payload 0 has empty rows", the fake "payloads[0] has empty rows": the pattern takes what both say.
    "PlanRecvRegions: row >= 1": (
        Bad("dispatch", lambda: dict(payloads=[rows(5, 0)]), ValueError, "has empty rows"),
        Bad("dispatch", lambda: dict(payloads=[rows(5, 8), ids(5, 2, 0)]), ValueError, "has empty rows")),
    "PlanRecvRegions: row == 2 * quant.hidden":
        Unreachable("CheckQuantPayload takes hidden from payloads[0], which it requires to be 2-D bf16|fp16",
                    _QUANT_PAYLOAD, (
                        Bad("dispatch", lambda: quantizing(2, payloads=[rows(5, 2, 128)]), TypeError,
                            "bfloat16 or float16"),
                        Bad("dispatch", lambda: quantizing(1, payloads=[rows(5, 256, dtype=torch.float32)]), TypeError,
                            "bfloat16 or float16"))),
    "PlanRecvRegions: token_bytes <= config.dispatch_bytes_per_token": (
        Bad("dispatch", lambda: dict(payloads=[rows(5, 2049)]), ValueError, "payloads need 4098 bytes per token"),
        Bad("dispatch", lambda: dict(payloads=[rows(5, 2048), ids(5, 4)]), ValueError, "payloads need 4112 bytes"),
        # nvfp4 of 256 elements: 128 value bytes and 16 scales
        Bad("dispatch", lambda: quantizing(3, dispatch_bytes_per_token=143), ValueError, "payloads need 144 bytes")),
    # mxfp8 of 128: 132 bytes a token, but 16 rows of swizzled scales take a whole 128-row tile
    "PlanRecvRegions: total_block_bytes <= config.max_num_tokens * config.dispatch_bytes_per_token":
        Bad("dispatch", lambda: quantizing(2, hidden=128, swizzled_scales=True, dispatch_bytes_per_token=132),
            ValueError, "swizzled scales pad each source block to 128 rows"),
    # ---- DispatchRecv (csrc/dispatch.cu)
    "DispatchRecv: runtime_max_tokens_per_rank >= 0 && runtime_max_tokens_per_rank <= max_num_tokens": (
        Bad("dispatch_recv", lambda: dict(runtime_max_tokens_per_rank=17), ValueError,
            "runtime_max_tokens_per_rank must be in"),
        Bad("dispatch_recv", lambda: dict(runtime_max_tokens_per_rank=-1), ValueError,
            "runtime_max_tokens_per_rank must be in")),
    "DispatchRecv: TimeoutNs(timeout_s)": Bad("dispatch_recv", lambda: dict(timeout_s=2e6), ValueError, "timeout_s"),
    # ---- Combine (csrc/combine.cu)
    "Combine: phase >= 0 && phase <= 2": Bad("combine", lambda: dict(phase=3), ValueError, "combine phase must be"),
    "Combine: runtime_max_tokens_per_rank >= 0 && runtime_max_tokens_per_rank <= max_num_tokens": (
        Bad("combine", lambda: dict(runtime_max_tokens_per_rank=17, partials=None), ValueError,
            "runtime_max_tokens_per_rank must be in"),
        Bad("combine", lambda: dict(runtime_max_tokens_per_rank=-1, partials=None), ValueError,
            "runtime_max_tokens_per_rank must be in")),
    "Combine: out.ndim() == 2 && out.size(0) <= runtime_max_tokens_per_rank": (
        Bad("combine", lambda: dict(out=rows(5, 128, 1), partials=None), ValueError, r"out must be \[num_tokens"),
        Bad("combine", lambda: dict(out=rows(17, 128), partials=None), ValueError,
            "num_tokens <= runtime_max_tokens_per_rank=16")),
    "Combine: hidden >= 1 && row_bytes <= combine_bytes_per_token": (
        Bad("combine", lambda: dict(out=rows(5, 0), partials=None), ValueError, "combine rows of hidden=0"),
        Bad("combine", lambda: dict(out=rows(5, 257), partials=None), ValueError,
            "need 514 bytes, the workspace was sized for combine_bytes_per_token=512")),
    "Combine: combine_mode == static_cast<int64_t>(CombineMode::kPull) || "
    "combine_mode == static_cast<int64_t>(CombineMode::kPush)":
        Bad("combine", lambda: dict(combine_mode=2), ValueError, r"combine_mode must be 0 \(pull\) or 1 \(push\)"),
    "Combine: quant_format == 0 || quant_format == 1":
        Bad("combine", lambda: dict(quant_format=2), ValueError, "combine quant_format must be 0"),
    "Combine: type != FloatType::kFloat32":
        Bad("combine", lambda: fp8_combine(out=rows(5, 64, dtype=torch.float32)), TypeError,
            "an FP8-wire combine needs bfloat16 or float16 out"),
    "Combine: hidden % kQuantLaneElems == 0 && hidden <= kFp8WireMaxCols * quant::kFp8Block": (
        Bad("combine", lambda: fp8_combine(out=rows(5, 124)), ValueError, "an FP8-wire combine needs hidden % 8 == 0"),
        Bad("combine", lambda: fp8_combine(out=rows(5, 32776), combine_bytes_per_token=2 * 32776), ValueError,
            "hidden <= 32768, got hidden=32776")),
    "Combine: reinterpret_cast<uintptr_t>(BytePtr(out)) % 16 == 0":
        Bad("combine", lambda: fp8_combine(out=rows(5, 128, offset=1)), ValueError, "needs out 16-byte aligned"),
    "Combine: in.dtype() == out.dtype()":
        Bad("combine", lambda: dict(partials=rows(2, 16, 128, dtype=torch.float16)), TypeError,
            "partials must have the dtype of out"),
    "Combine: in.ndim() == 3 && in.size(0) == ep_size && in.size(1) == runtime_max_tokens_per_rank && "
    "in.size(2) == hidden": (
        Bad("combine", lambda: dict(partials=rows(32, 128)), ValueError, r"partials must be \[ep_size=2"),
        Bad("combine", lambda: dict(partials=rows(3, 16, 128)), ValueError, r"partials must be \[ep_size=2"),
        Bad("combine", lambda: dict(partials=rows(2, 8, 128)), ValueError, "runtime_max_tokens_per_rank=16"),
        Bad("combine", lambda: dict(partials=rows(2, 16, 64)), ValueError, "hidden=128")),
    "Combine: !fp8_wire || reinterpret_cast<uintptr_t>(input) % 16 == 0":
        Bad("combine", lambda: fp8_combine(partials=rows(2, 16, 128, offset=1)), ValueError,
            "needs partials 16-byte aligned"),
    "Combine: phase == 0": Bad("combine", lambda: push_combine(phase=1), ValueError, r"\(push\) cannot be split"),
    "Combine: one_gpu_per_rank":
        Bad("combine", lambda: push_combine(one_gpu_per_rank=False), ValueError, r"\(push\) needs one_gpu_per_rank"),
    "Combine: needed <= combine_bytes_per_token":
        Bad("combine", lambda: push_combine(out=rows(5, 256)), ValueError, "needs combine_bytes_per_token >= 1024"),
    "Combine: CheckSmBudget(num_sms)": Bad("combine", lambda: dict(num_sms=-3), ValueError, "num_sms"),
    'Combine: CombineFloatType(out, "out")':
        Bad("combine", lambda: dict(out=rows(5, 128, dtype=torch.int32), partials=None), TypeError,
            "out must be bfloat16, float16 or float32"),
    'Combine: CheckContiguous(out, "out")':
        Bad("combine", lambda: dict(out=rows(5, 4, strides=_T), partials=None), ValueError, "out must be contiguous"),
    'Combine: CheckSameDevice(out, workspace, "out", "workspace")':
        Bad("combine", lambda: dict(out=rows(5, 128, device="cpu"), partials=None), ValueError,
            "out must be on the same device as workspace"),
    "Combine: TimeoutNs(timeout_s)": Bad("combine", lambda: dict(timeout_s=float("nan")), ValueError, "timeout_s"),
    'Combine: CheckContiguous(in, "partials")':
        Bad("combine", lambda: dict(partials=rows(2, 16, 128, strides=(2048, 1, 16))), ValueError,
            "partials must be contiguous"),
    'Combine: CheckSameDevice(in, workspace, "partials", "workspace")':
        Bad("combine", lambda: dict(partials=rows(2, 16, 128, device="cpu")), ValueError,
            "partials must be on the same device as workspace"),
    "CombineFloatType: IsDType(t, kDLFloat, 32)":
        Bad("combine", lambda: dict(out=rows(5, 32, dtype=torch.float64), partials=None), TypeError,
            "out must be bfloat16, float16 or float32"),
    # ---- SanitizeExpertIds (csrc/combine.cu)
    "SanitizeExpertIds: IsCuda(recv_topk_ids)":
        Bad("sanitize_expert_ids", lambda: dict(recv_topk_ids=ids(2, 16, 4, device="cpu")), ValueError,
            "recv_topk_ids must be a CUDA tensor"),
    "SanitizeExpertIds: is_int64 || IsDType(recv_topk_ids, kDLInt, 32)": (
        Bad("sanitize_expert_ids", lambda: dict(recv_topk_ids=ids(2, 16, 4, dtype=torch.float32)), TypeError,
            "recv_topk_ids must be int32 or int64"),
        Bad("sanitize_expert_ids", lambda: dict(recv_topk_ids=ids(2, 16, 4, dtype=torch.int16)), TypeError,
            "recv_topk_ids must be int32 or int64")),
    "SanitizeExpertIds: recv_topk_ids.ndim() == 3":
        Bad("sanitize_expert_ids", lambda: dict(recv_topk_ids=ids(2, 64)), ValueError,
            r"recv_topk_ids must be \[ep_size"),
    "SanitizeExpertIds: is_int64 || (invalid_id >= INT32_MIN && invalid_id <= INT32_MAX)": (
        Bad("sanitize_expert_ids", lambda: dict(invalid_id=1 << 31), ValueError,
            "invalid_id=2147483648 does not fit int32 recv_topk_ids"),
        Bad("sanitize_expert_ids", lambda: dict(invalid_id=-(1 << 31) - 1), ValueError, "does not fit int32")),
    'SanitizeExpertIds: CheckContiguous(recv_topk_ids, "recv_topk_ids")':
        Bad("sanitize_expert_ids", lambda: dict(recv_topk_ids=ids(2, 16, 4, strides=(64, 1, 16))), ValueError,
            "recv_topk_ids must be contiguous"),
    # CheckRecvCounts names its reference "workspace" whatever it is; the fake names recv_topk_ids.
    "SanitizeExpertIds: CheckRecvCounts(recv_counts, recv_topk_ids, ep_size)": (
        Bad("sanitize_expert_ids", lambda: dict(recv_counts=counts(3)), ValueError, r"shape \[ep_size=2\]"),
        Bad("sanitize_expert_ids", lambda: dict(recv_counts=counts(device="cpu")), ValueError,
            "recv_counts must be on the same device as")),
}


from .fake_check_table_nccl import TABLE as _NCCL_TABLE  # noqa: E402 (it builds on the helpers above)

TABLE.update(_NCCL_TABLE)


def cases(unreachable: bool = False) -> list:
    """Every input of :data:`TABLE` as a pytest parameter ``(key, case)`` named after its row; with
    ``unreachable``, the attempts of the :class:`Unreachable` rows instead."""
    params = []
    for key, row in TABLE.items():
        if isinstance(row, Unreachable) == unreachable:
            inputs = row.attempts if unreachable else row if isinstance(row, tuple) else (row,)
            params += [pytest.param(key, case, id=f"{key[:70]}#{i}") for i, case in enumerate(inputs)]
    return params
