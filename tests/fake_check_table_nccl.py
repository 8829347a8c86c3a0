"""The rows of tests/fake_check_table.py for the nccl transport's entries (csrc/nccl.cu): their valid arguments
(:func:`valid_args`) and, per C++ check, inputs it refuses (:data:`TABLE`)."""

from __future__ import annotations

import math

import torch

from flashinfer_a2a.library import checks
from flashinfer_a2a.library.nccl_wire import dispatch_wire
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS, fp8_wire_row_bytes
from flashinfer_a2a.jit import get_a2a_module

from .fake_check_table import _T, Bad, Before, Unreachable, counts, ids, rows, tensor

_WIRES = {f.code: f for f in WIRE_FORMATS.values()}
_RUNTIME_MAX, _EXPERTS = 16, 8


def _row_bytes(t: torch.Tensor, first: int = 1) -> int:
    return t.element_size() * math.prod(t.shape[first:])


def _wire_bytes(ep_size: int, runtime_max: int, payload_rows: list, code: int, hidden: int, swizzled: bool) -> int:
    """Bytes of a send buffer for these arguments, or 16 where they make no layout (the check refuses first)."""
    try:
        return dispatch_wire(ep_size, runtime_max, payload_rows, _WIRES.get(code), hidden, swizzled).total_bytes
    except (ValueError, TypeError, ZeroDivisionError, IndexError):
        return 16


def valid_args(op: str, sizes: dict, given: dict) -> dict:
    """The arguments of nccl op ``op``: those in ``given``, else ones its fake and its C++ entry accept (``sizes``:
    fake_check_table's, of which ep_size is used)."""
    def arg(name, make):
        return given[name] if name in given else make()

    if op == "nccl_pack":
        args = dict(topk_ids=arg("topk_ids", lambda: ids(5, 4)), payloads=arg("payloads", lambda: [rows(5, 256)]),
                    ep_size=sizes["ep_size"], runtime_max_tokens_per_rank=given.get("runtime_max_tokens_per_rank",
                                                                                    _RUNTIME_MAX),
                    num_experts=given.get("num_experts", _EXPERTS), quant_format=given.get("quant_format", 0),
                    global_scale=given.get("global_scale"), swizzled_scales=given.get("swizzled_scales", False))
        code, payloads = args["quant_format"], args["payloads"]
        hidden = payloads[0].shape[-1] if payloads and code in _WIRES else 0
        size = _wire_bytes(args["ep_size"], args["runtime_max_tokens_per_rank"], [_row_bytes(p) for p in payloads],
                           code, hidden, args["swizzled_scales"])
        return dict(send=arg("send", lambda: tensor(torch.uint8, (size,))), **args)
    if op == "nccl_select":
        args = dict(recv=arg("recv", lambda: [rows(2, 16, 256)]), recv_counts=arg("recv_counts", counts),
                    ep_rank=given.get("ep_rank", 0),
                    runtime_max_tokens_per_rank=given.get("runtime_max_tokens_per_rank", _RUNTIME_MAX),
                    quant_format=given.get("quant_format", 0), quant_hidden=given.get("quant_hidden", 0),
                    swizzled_scales=given.get("swizzled_scales", False))
        code, recv = args["quant_format"], args["recv"]
        payload_rows = ([0] if code in _WIRES else []) + [_row_bytes(r, 2) for r in recv[2 if code in _WIRES else 0:]]
        size = _wire_bytes(2, args["runtime_max_tokens_per_rank"], payload_rows, code, args["quant_hidden"],
                           args["swizzled_scales"])
        return dict(gathered=arg("gathered", lambda: tensor(torch.uint8, (2, size))), **args)
    partials = arg("partials", lambda: rows(2, 16, 128))
    fp8_wire = op == "nccl_combine_wire" or given.get("fp8_wire", False)
    shape = tuple(partials.shape) if partials.dim() == 3 else (2, 16, 128)
    row = fp8_wire_row_bytes(shape[2]) if fp8_wire else shape[2] * partials.element_size()
    buffer = lambda: tensor(torch.uint8, (shape[0] * shape[1], row))  # noqa: E731
    if op == "nccl_combine_wire":
        return dict(wire=arg("wire", buffer), partials=partials, recv_counts=arg("recv_counts", counts),
                    ep_rank=given.get("ep_rank", 0))
    return dict(out=arg("out", lambda: rows(5, 128)), returned=arg("returned", buffer),
                send=arg("send", lambda: tensor(torch.uint8, (16,))), partials=partials,
                ep_rank=given.get("ep_rank", 0), fp8_wire=fp8_wire)


def quantizing(fmt: int, hidden: int = 256, swizzled: bool = False, **change) -> dict:
    """An nccl_pack quantizing ``payloads[0]`` ``[5, hidden]`` bf16 (code 1 fp8_block, 2 mxfp8, 3 nvfp4)."""
    out = dict(quant_format=fmt, payloads=[rows(5, hidden)], swizzled_scales=swizzled)
    if fmt == 3:
        out["global_scale"] = tensor(torch.float32, (1,))
    return dict(out, **change)


def selecting(fmt: int, hidden: int = 256, swizzled: bool = False, **change) -> dict:
    """An nccl_select of a quantized first payload of ``hidden`` elements (its values and scales as recv[0:2])."""
    wire = _WIRES[fmt]
    values = tensor(wire.value_dtype, (2, 16, wire.value_bytes(hidden)))
    cols = wire.scale_cols(hidden)
    scales = tensor(wire.scale_dtype, (2, wire.swizzled_scale_bytes(16, hidden)) if swizzled else (2, 16, cols))
    return dict(dict(quant_format=fmt, quant_hidden=hidden, swizzled_scales=swizzled, recv=[values, scales]), **change)


def _pack_bytes() -> int:
    return _wire_bytes(2, _RUNTIME_MAX, [512], 0, 0, False)


def _select_bytes() -> int:
    return _wire_bytes(2, _RUNTIME_MAX, [512], 0, 0, False)


def _pack_with_none() -> None:
    checks.check_nccl_pack_args(tensor(torch.uint8, (_pack_bytes(),)), ids(5, 4), [rows(5, 256), None], 2,
                                _RUNTIME_MAX, _EXPERTS, 0, None, False)


def _library_pack_with_none() -> None:
    get_a2a_module().nccl_pack(tensor(torch.uint8, (_pack_bytes(),)), ids(5, 4), [rows(5, 256), None], 2,
                               _RUNTIME_MAX, _EXPERTS, 0, None, False)


def _select_with_none() -> None:
    checks.check_nccl_select_args(tensor(torch.uint8, (2, _select_bytes())), [None], counts(), 0, _RUNTIME_MAX, 0, 0,
                                  False)


def _library_select_with_none() -> None:
    get_a2a_module().nccl_select(tensor(torch.uint8, (2, _select_bytes())), [None], counts(), 0, _RUNTIME_MAX, 0, 0,
                                 False)


def _send(**view) -> torch.Tensor:
    return tensor(torch.uint8, (_pack_bytes(),), **view)


def _gathered(**view) -> torch.Tensor:
    return tensor(torch.uint8, (2, _select_bytes()), **view)


_PAYLOAD_CPU = 'NcclPack: CheckNcclInput(payload, name, send, "send")'
_RETURNED = 'NcclCombineSum: CheckNcclBuffer(returned, "returned", {ep_size * runtime_max, p.wire_row_bytes})'
_WIRE = 'NcclCombineWire: CheckNcclBuffer(wire, "wire", {rows, p.wire_row_bytes})'
_SEGMENTS = "NcclSelect: recv.size() <= kNcclMaxSegments && recv.size() >= (quantize ? 2u : 0u)"
_TILES = ("NcclSelect: tiles ? r.ndim() == 2 && r.size(0) == ep_size && NcclRowBytes(r) == swizzled_block : "
          "r.ndim() >= 2 && r.size(0) == ep_size && r.size(1) == runtime_max")


def _combine_buffer_rows(op: str, entry: str, name: str, shape_key: str, width: int) -> dict:
    """The rows of a combine's ``[32, width]`` uint8 buffer argument: its shape, its device, its alignment."""
    return {
        shape_key: Bad(op, lambda: {name: tensor(torch.uint8, (32, width - 1))}, ValueError,
                       rf"{name} must be uint8 of shape \[32, {width}\]"),
        f'{entry}: CheckNcclInput({name}, "{name}", partials, "partials")':
            Bad(op, lambda: {name: tensor(torch.uint8, (32, width), "cpu")}, ValueError,
                f"{name} must be a CUDA tensor"),
        f'{entry}: CheckNcclAligned({name}, "{name}")':
            Bad(op, lambda: {name: tensor(torch.uint8, (32, width), offset=8)}, ValueError,
                f"{name} must start on a 16-byte boundary"),
    }


#: every C++ check the nccl entries reach (but the shared helpers' own, in fake_check_table.TABLE) -> the inputs
#: that fail it
TABLE: dict = {
    # ---- helpers (csrc/nccl.cu)
    "CheckNcclAligned: reinterpret_cast<uintptr_t>(BytePtr(t)) % kNcclWireAlign == 0": (
        Bad("nccl_pack", lambda: dict(send=_send(offset=1)), ValueError, "send must start on a 16-byte boundary"),
        Bad("nccl_combine_sum", lambda: dict(fp8_wire=True, out=rows(5, 128, offset=4)), ValueError,
            "out must start on a 16-byte boundary")),
    "CheckNcclBuffer: same": (
        Bad("nccl_pack", lambda: dict(send=tensor(torch.uint8, (_pack_bytes() + 16,))), ValueError,
            r"send must be uint8 of shape \[8208\]"),
        Bad("nccl_select", lambda: dict(gathered=tensor(torch.int8, (2, _select_bytes()))), ValueError,
            r"gathered must be uint8 of shape \[2, 8208\]")),
    "CheckNcclInput: IsCuda(t)":
        Bad("nccl_pack", lambda: dict(topk_ids=ids(5, 4, device="cpu")), ValueError, "topk_ids must be a CUDA tensor"),
    "CheckNcclInput: CheckContiguous(t, name.c_str())":
        Bad("nccl_pack", lambda: dict(topk_ids=ids(5, 4, strides=_T)), ValueError, "topk_ids must be contiguous"),
    # A real second device needs a second GPU.
    "CheckNcclInput: CheckSameDevice(t, ref, name.c_str(), ref_name)":
        Bad("nccl_pack", lambda: dict(payloads=[rows(5, 256, device="cuda:1")]), ValueError,
            r"payloads\[0\] must be on the same device as send", real=False),
    "CheckNcclSizes: ep_size >= 1 && ep_size <= kMaxRanks": (
        Bad("nccl_pack", lambda: dict(ep_size=0), ValueError, r"ep_size must be in \[1, 72\], got 0"),
        Bad("nccl_select", lambda: dict(gathered=tensor(torch.uint8, (73, 16))), ValueError, "ep_size must be in")),
    "CheckNcclSizes: runtime_max >= 0 && runtime_max < (int64_t{1} << kRouteSlotBits)": (
        Bad("nccl_pack", lambda: dict(runtime_max_tokens_per_rank=1 << 24, send=_send()), ValueError,
            r"runtime_max_tokens_per_rank must be in \[0, 2\^24\)"),
        Bad("nccl_select", lambda: dict(runtime_max_tokens_per_rank=-1, gathered=_gathered()), ValueError,
            "runtime_max_tokens_per_rank must be in")),
    "NcclLayoutOf: num_payloads <= most": (
        Bad("nccl_pack", lambda: dict(payloads=[rows(5, 8)] * 9), ValueError, "at most 8 payloads per dispatch"),
        Bad("nccl_pack", lambda: quantizing(1, payloads=[rows(5, 256)] + [rows(5, 8)] * 7), ValueError,
            "at most 7 payloads per dispatch that quantizes")),
    "CheckNcclPartials: half || (!fp8_wire && IsDType(partials, kDLFloat, 32))": (
        Bad("nccl_combine_wire", lambda: dict(partials=rows(2, 16, 128, dtype=torch.float32)), TypeError,
            r"partials must be bfloat16, float16 \(the FP8 wire\)"),
        Bad("nccl_combine_sum", lambda: dict(partials=rows(2, 16, 128, dtype=torch.int32)), TypeError,
            "partials must be bfloat16, float16 or float32")),
    "CheckNcclPartials: partials.ndim() == 3":
        Bad("nccl_combine_wire", lambda: dict(partials=rows(32, 128)), ValueError,
            r"partials must be \[ep_size, runtime_max, hidden\]"),
    "CheckNcclPartials: IsCuda(partials)":
        Bad("nccl_combine_sum", lambda: dict(partials=rows(2, 16, 128, device="cpu")), ValueError,
            "partials must be a CUDA tensor"),
    "CheckNcclPartials: hidden >= 1 && (!fp8_wire || hidden % kQuantLaneElems == 0)": (
        Bad("nccl_combine_wire", lambda: dict(partials=rows(2, 16, 124)), ValueError,
            "partials' hidden=124 must be a positive multiple of 8"),
        Bad("nccl_combine_sum", lambda: dict(partials=rows(2, 16, 0)), ValueError, "partials' hidden=0 must be >= 1")),
    'CheckNcclPartials: CheckContiguous(partials, "partials")':
        Bad("nccl_combine_wire", lambda: dict(partials=rows(2, 16, 128, strides=(2048, 1, 16))), ValueError,
            "partials must be contiguous"),
    'CheckNcclPartials: CheckNcclAligned(partials, "partials")':
        Bad("nccl_combine_wire", lambda: dict(partials=rows(2, 16, 128, offset=1)), ValueError,
            "partials must start on a 16-byte boundary"),
    "CheckNcclPartials: CheckNcclSizes(partials.size(0), partials.size(1))":
        Bad("nccl_combine_wire", lambda: dict(partials=rows(73, 1, 128)), ValueError, r"ep_size must be in \[1, 72\]"),
    "CheckNcclPartials: CheckRank(ep_rank, partials.size(0))":
        Bad("nccl_combine_sum", lambda: dict(ep_rank=2), ValueError, r"ep_rank must be in \[0, ep_size=2\), got 2"),
    # ---- NcclPack
    "NcclPack: payloads[p].defined()":
        Before("nccl_pack", dict, TypeError, r"payloads\[1\] must be a", call=_pack_with_none,
               library_call=_library_pack_with_none),
    "NcclPack: IsCuda(send)":
        Bad("nccl_pack", lambda: dict(send=tensor(torch.uint8, (_pack_bytes(),), "cpu")), ValueError,
            "send must be a CUDA tensor"),
    "NcclPack: IsDType(topk_ids, kDLInt, 32) || IsDType(topk_ids, kDLInt, 64)":
        Bad("nccl_pack", lambda: dict(topk_ids=ids(5, 4, dtype=torch.float32)), TypeError,
            "topk_ids must be int32 or int64"),
    "NcclPack: topk_ids.ndim() == 2 && topk_ids.size(1) >= 1 && topk_ids.size(1) <= kMaxTopK": (
        Bad("nccl_pack", lambda: dict(topk_ids=ids(5)), ValueError, r"topk_ids must be \[num_tokens, top_k\]"),
        Bad("nccl_pack", lambda: dict(topk_ids=ids(5, 33)), ValueError, r"top_k in \[1, 32\]"),
        Bad("nccl_pack", lambda: dict(topk_ids=ids(5, 0)), ValueError, r"top_k in \[1, 32\]")),
    "NcclPack: num_tokens <= runtime_max_tokens_per_rank":
        Bad("nccl_pack", lambda: dict(topk_ids=ids(17, 4), payloads=[rows(17, 256)]), ValueError,
            "topk_ids has 17 tokens, more than runtime_max_tokens_per_rank=16"),
    "NcclPack: num_experts >= 1 && num_experts < (int64_t{1} << 31)":
        Bad("nccl_pack", lambda: dict(num_experts=0), ValueError, r"num_experts must be in \[1, 2\^31\)"),
    "NcclPack: payload.ndim() >= 1 && payload.size(0) == num_tokens":
        Bad("nccl_pack", lambda: dict(payloads=[rows(4, 256)]), ValueError, r"payloads\[0\] must have num_tokens=5"),
    "NcclPack: rows[p] >= 1":
        Bad("nccl_pack", lambda: dict(payloads=[rows(5, 256), rows(5, 0)]), ValueError, r"payloads\[1\] has empty"),
    "NcclPack: CheckNcclSizes(ep_size, runtime_max_tokens_per_rank)":
        Bad("nccl_pack", lambda: dict(ep_size=80), ValueError, "ep_size must be in"),
    'NcclPack: CheckNcclInput(topk_ids, "topk_ids", send, "send")':
        Bad("nccl_pack", lambda: dict(topk_ids=ids(5, 4, strides=_T)), ValueError, "topk_ids must be contiguous"),
    'NcclPack: CheckQuantPayload(ToQuantFormat(quant_format), payloads, global_scale, send, "send", '
    'swizzled_scales)': (
        Bad("nccl_pack", lambda: quantizing(3, global_scale=None), ValueError, "quant_format nvfp4 needs global_scale"),
        Bad("nccl_pack", lambda: quantizing(3, global_scale=tensor(torch.float32, (1,), "cpu")), ValueError,
            "global_scale must be on the same device as send"),
        Bad("nccl_pack", lambda: quantizing(1, swizzled=True), ValueError, "swizzled_scales needs one-byte scales")),
    "NcclPack: ToQuantFormat(quant_format)":
        Bad("nccl_pack", lambda: dict(quant_format=4), ValueError, r"quant_format must be 0 \(none\)"),
    _PAYLOAD_CPU:
        Bad("nccl_pack", lambda: dict(payloads=[rows(5, 256), ids(5, 4, device="cpu")]), ValueError,
            r"payloads\[1\] must be a CUDA tensor"),
    "NcclPack: NcclLayoutOf(ep_size, runtime_max_tokens_per_rank, quant, rows, static_cast<int>(payloads.size()))":
        Bad("nccl_pack", lambda: dict(payloads=[rows(5, 8)] * 10), ValueError, "at most 8 payloads"),
    'NcclPack: CheckNcclBuffer(send, "send", {wire.total_bytes})':
        Bad("nccl_pack", lambda: dict(send=tensor(torch.uint8, (16,))), ValueError, r"send must be uint8 of shape"),
    'NcclPack: CheckContiguous(send, "send")':
        Bad("nccl_pack", lambda: dict(send=_send(strides=(2,))), ValueError, "send must be contiguous"),
    'NcclPack: CheckNcclAligned(send, "send")':
        Bad("nccl_pack", lambda: dict(send=_send(offset=8)), ValueError, "send must start on a 16-byte boundary"),
    # ---- NcclSelect
    "NcclSelect: recv[s].defined()":
        Before("nccl_select", dict, TypeError, r"recv\[0\] must be a", call=_select_with_none,
               library_call=_library_select_with_none),
    "NcclSelect: IsCuda(gathered) && gathered.ndim() == 2": (
        Bad("nccl_select", lambda: dict(gathered=tensor(torch.uint8, (2, _select_bytes()), "cpu")), ValueError,
            r"gathered must be a CUDA tensor of shape \[ep_size, send bytes\]"),
        Bad("nccl_select", lambda: dict(gathered=tensor(torch.uint8, (2 * _select_bytes(),))), ValueError,
            "gathered must be a CUDA tensor of shape")),
    _SEGMENTS: (
        Bad("nccl_select", lambda: dict(recv=[rows(2, 16, 8)] * 9), ValueError,
            "recv must hold one tensor per received segment"),
        Bad("nccl_select", lambda: selecting(1, recv=[rows(2, 16, 128)]), ValueError, "at least 2, got 1")),
    _TILES: (
        Bad("nccl_select", lambda: dict(recv=[rows(3, 16, 256)]), ValueError,
            r"recv\[0\] must be \[ep_size=2, runtime_max"),
        Bad("nccl_select", lambda: dict(recv=[rows(2, 8, 256)]), ValueError, r"recv\[0\] must be \[ep_size=2"),
        Bad("nccl_select", lambda: selecting(2, swizzled=True, recv=[tensor(torch.uint8, (2, 16, 256)),
                                                                      tensor(torch.uint8, (2, 512))]),
            ValueError, r"recv\[1\] must be \[ep_size=2, swizzled scale bytes")),
    "NcclSelect: s >= 2 || !quantize || row == expected[s]": (
        Bad("nccl_select", lambda: selecting(1, recv=[tensor(torch.uint8, (2, 16, 255)), tensor(torch.float32,
                                                                                              (2, 16, 2))]),
            ValueError, r"recv\[0\] must hold 256-byte rows \(the values of hidden=256\)"),
        Bad("nccl_select", lambda: selecting(3, recv=[tensor(torch.uint8, (2, 16, 128)), tensor(torch.uint8,
                                                                                              (2, 16, 8))]),
            ValueError, r"recv\[1\] must hold 16-byte rows \(the scales")),
    "NcclSelect: IsDType(recv_counts, kDLInt, 32) && recv_counts.ndim() == 1 && recv_counts.size(0) == ep_size":
        Bad("nccl_select", lambda: dict(recv_counts=counts(3)), ValueError,
            r"recv_counts must be int32 of shape \[ep_size=2\]"),
    "NcclSelect: CheckNcclSizes(ep_size, runtime_max)":
        Bad("nccl_select", lambda: dict(gathered=tensor(torch.uint8, (0, 16))), ValueError, "ep_size must be in"),
    "NcclSelect: CheckRank(ep_rank, ep_size)":
        Bad("nccl_select", lambda: dict(ep_rank=2), ValueError, r"ep_rank must be in \[0, ep_size=2\)"),
    "NcclSelect: MakeQuantRequest(ToQuantFormat(quant_format), quant_hidden, swizzled_scales)": (
        Bad("nccl_select", lambda: dict(swizzled_scales=True), ValueError, "swizzled_scales needs a quant_format"),
        Bad("nccl_select", lambda: selecting(1, quant_hidden=0), ValueError, "the hidden size to quantize")),
    "NcclSelect: ToQuantFormat(quant_format)":
        Bad("nccl_select", lambda: dict(quant_format=7), ValueError, "quant_format must be 0"),
    'NcclSelect: CheckNcclInput(r, name, gathered, "gathered")':
        Bad("nccl_select", lambda: dict(recv=[rows(2, 16, 256, device="cpu")]), ValueError,
            r"recv\[0\] must be a CUDA tensor"),
    "NcclSelect: CheckNcclAligned(r, name)":
        Bad("nccl_select", lambda: dict(recv=[rows(2, 16, 256, offset=1)]), ValueError,
            r"recv\[0\] must start on a 16-byte boundary"),
    "NcclSelect: NcclLayoutOf(ep_size, runtime_max, quant, payload_rows, num_payloads)":
        Unreachable("recv holds at most kNcclMaxSegments tensors, and a quantized payload two of them: never more "
                    "payloads than the layout takes", _SEGMENTS,
                    (Bad("nccl_select", lambda: dict(recv=[rows(2, 16, 8)] * 9), ValueError,
                         "recv must hold one tensor per received segment"),
                     Bad("nccl_select", lambda: selecting(2, recv=selecting(2)["recv"] + [rows(2, 16, 8)] * 7),
                         ValueError, "recv must hold one tensor per received segment"))),
    'NcclSelect: CheckNcclBuffer(gathered, "gathered", {ep_size, wire.total_bytes})':
        Bad("nccl_select", lambda: dict(gathered=tensor(torch.uint8, (2, 16))), ValueError,
            r"gathered must be uint8 of shape \[2, 8208\]"),
    'NcclSelect: CheckContiguous(gathered, "gathered")':
        Bad("nccl_select", lambda: dict(gathered=_gathered(strides=(_select_bytes() + 16, 1))), ValueError,
            "gathered must be contiguous"),
    'NcclSelect: CheckNcclAligned(gathered, "gathered")':
        Bad("nccl_select", lambda: dict(gathered=_gathered(offset=4)), ValueError,
            "gathered must start on a 16-byte boundary"),
    'NcclSelect: CheckNcclInput(recv_counts, "recv_counts", gathered, "gathered")':
        Bad("nccl_select", lambda: dict(recv_counts=counts(device="cpu")), ValueError,
            "recv_counts must be a CUDA tensor"),
    # ---- NcclCombineWire
    "NcclCombineWire: IsDType(recv_counts, kDLInt, 32) && recv_counts.ndim() == 1 && recv_counts.size(0) == ep_size":
        Bad("nccl_combine_wire", lambda: dict(recv_counts=counts(dtype=torch.int64)), ValueError,
            r"recv_counts must be int32 of shape \[ep_size=2\]"),
    "NcclCombineWire: CheckNcclPartials(partials, ep_rank, true)":
        Bad("nccl_combine_wire", lambda: dict(ep_rank=-1), ValueError, "ep_rank must be in"),
    **_combine_buffer_rows("nccl_combine_wire", "NcclCombineWire", "wire", _WIRE, 144),
    'NcclCombineWire: CheckNcclInput(recv_counts, "recv_counts", partials, "partials")':
        Bad("nccl_combine_wire", lambda: dict(recv_counts=counts(strides=(2,))), ValueError,
            "recv_counts must be contiguous"),
    # ---- NcclCombineSum
    "NcclCombineSum: out.dtype() == partials.dtype()":
        Bad("nccl_combine_sum", lambda: dict(out=rows(5, 128, dtype=torch.float16)), TypeError,
            "out must have the partials' dtype"),
    "NcclCombineSum: out.ndim() == 2 && out.size(1) == hidden && out.size(0) <= runtime_max": (
        Bad("nccl_combine_sum", lambda: dict(out=rows(5, 64)), ValueError, r"out must be \[num_tokens, hidden=128\]"),
        Bad("nccl_combine_sum", lambda: dict(out=rows(17, 128)), ValueError, "num_tokens <= runtime_max=16")),
    "NcclCombineSum: IsDType(send, kDLUInt, 8) && send.ndim() == 1 && send.size(0) >= (ep_size + 7) / 8 * "
    "plane_stride": (
        Bad("nccl_combine_sum", lambda: dict(send=tensor(torch.uint8, (8,))), ValueError,
            r"send must be the uint8 send buffer of the dispatch \(its mask planes first\)"),
        Bad("nccl_combine_sum", lambda: dict(send=tensor(torch.int8, (16,))), ValueError, "send must be the uint8")),
    "NcclCombineSum: CheckNcclPartials(partials, ep_rank, fp8_wire)":
        Bad("nccl_combine_sum", lambda: dict(fp8_wire=True, partials=rows(2, 16, 124)), ValueError,
            "must be a positive multiple of 8"),
    'NcclCombineSum: CheckNcclInput(out, "out", partials, "partials")':
        Bad("nccl_combine_sum", lambda: dict(out=rows(5, 128, device="cpu")), ValueError, "out must be a CUDA tensor"),
    'NcclCombineSum: CheckNcclAligned(out, "out")':
        Bad("nccl_combine_sum", lambda: dict(fp8_wire=True, out=rows(5, 128, offset=1)), ValueError,
            "out must start on a 16-byte boundary"),
    **_combine_buffer_rows("nccl_combine_sum", "NcclCombineSum", "returned", _RETURNED, 256),
    'NcclCombineSum: CheckNcclInput(send, "send", partials, "partials")':
        Bad("nccl_combine_sum", lambda: dict(send=tensor(torch.uint8, (16,), strides=(2,))), ValueError,
            "send must be contiguous"),
    'NcclCombineSum: CheckNcclAligned(send, "send")':
        Bad("nccl_combine_sum", lambda: dict(send=tensor(torch.uint8, (16,), offset=1)), ValueError,
            "send must start on a 16-byte boundary"),
}
