"""The nccl transport's local steps in torch ops: what runs where the kernels do not (CPU tensors on gloo ranks, eagerly
or while ``torch.compile`` traces), and the twins the CUDA kernels are checked against, bit for bit
(tests/gpu/test_nccl_kernels.py). Both read and write the same wire (:mod:`flashinfer_a2a.library.nccl_wire`):

- :func:`pack` = ``nccl_pack``: a rank's send buffer (mask planes, values and scales, payload rows);
- :func:`select` = ``nccl_select``: per source block of the gathered buffers, the rows naming this rank, in token
  order, and the counts;
- :func:`combine_wire` = ``nccl_combine_wire``: partials as FP8 values and fp32 scales per 128, each row
  ``fp8_wire_row_bytes(hidden)`` bytes (here every row; the kernel only those a peer reads);
- :func:`ordered_sum` = ``nccl_combine_sum``: each token's rows summed in increasing rank order in fp32.

Rows the contract leaves unspecified (past a source's count, a send row past ``num_tokens``) may differ between
the two. Dtype views between sizes go through :mod:`.nccl_traced` while tracing (see there).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ..library.nccl_wire import NcclWire
from ..library.wire_formats import WireFormat, fp8_wire_row_bytes
from ..reference import quant
from . import nccl_traced as traced


def rank_mask(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """``[num_tokens, ep_size] bool``: which ranks own one of each token's experts. An id of -1 is skipped; so is
    any id outside ``[0, num_experts)`` (debug mode reports those on the host before the call)."""
    base, rem = divmod(num_experts, ep_size)
    ranks = torch.arange(ep_size, device=topk_ids.device)
    first = ranks * base + torch.clamp(ranks, max=rem)  # first expert of each rank (contiguous partition)
    ids = topk_ids.to(torch.int64)
    owner = torch.searchsorted(first, ids, right=True) - 1  # last rank whose first expert <= id
    valid = (ids >= 0) & (ids < num_experts)
    column = torch.where(valid, owner, torch.full_like(owner, ep_size))  # a spare column takes the skipped ids
    mask = torch.zeros(ids.shape[0], ep_size + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, column, True)
    return mask[:, :ep_size]


def _bit_weights(device: torch.device) -> torch.Tensor:
    # Made on the device: a host-to-device copy of a literal would break a CUDA-graph capture.
    return torch.ones(8, dtype=torch.uint8, device=device) << torch.arange(8, dtype=torch.uint8, device=device)


def mask_planes(mask: torch.Tensor, plane_stride: int) -> torch.Tensor:
    """``[num_tokens, ep_size] bool`` -> ``[ceil(ep_size / 8), plane_stride] uint8``: rank ``8j + b`` at bit ``b`` of
    plane ``j``, bytes from ``num_tokens`` on 0."""
    n, ep_size = mask.shape
    planes = -(-ep_size // 8)
    padded = F.pad(mask.to(torch.uint8), (0, planes * 8 - ep_size, 0, plane_stride - n))
    packed = (padded.view(plane_stride, planes, 8) * _bit_weights(mask.device)).sum(-1, dtype=torch.uint8)
    return packed.t().contiguous()


def unpack_mask(send: torch.Tensor, wire: NcclWire, num_tokens: int) -> torch.Tensor:
    """The ``[num_tokens, ep_size] bool`` mask of a send buffer's planes."""
    planes = send[: wire.mask_planes * wire.plane_stride].view(wire.mask_planes, wire.plane_stride)[:, :num_tokens]
    bits = (planes.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=send.device)) & 1
    return bits.permute(1, 0, 2).reshape(num_tokens, wire.mask_planes * 8)[:, : wire.ep_size].bool()


def row_width(t: torch.Tensor) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` of any dtype as ``[rows, row_bytes] uint8`` (a copy only if strided)."""
    if traced.tracing():
        return traced.to_bytes(t)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_width(t))


def from_bytes(rows: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """``[rows, row_bytes] uint8`` as ``[*shape] dtype``, the inverse of :func:`to_bytes`."""
    if traced.tracing():
        return traced.from_bytes(rows, dtype, shape)
    return rows.contiguous().view(dtype).reshape(shape)


def quantize(x: torch.Tensor, fmt: WireFormat, global_scale: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """Values and scales by the reference quantizers (the bits of the kernels' device code)."""
    if fmt.name != "nvfp4":
        return list(quant.quantize(x, fmt.name))
    # The checked quantize_nvfp4 reads the scale on the host.
    return list(quant.quantize_nvfp4_unchecked(x, global_scale.reshape(()).float()))


def pack(topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], wire: NcclWire, num_experts: int,
         fmt: Optional[WireFormat] = None, global_scale: Optional[torch.Tensor] = None,
         swizzled: bool = False) -> torch.Tensor:
    """A rank's ``[wire.total_bytes] uint8`` send buffer (padding and rows past ``num_tokens`` zero).

    Written into zeros by slices: inductor (torch 2.13, CPU) miscompiles ``cat`` and ``pad`` of the bytes of a
    quantizer's strided fp8 values (they come out shifted); assignment into slices of a fresh buffer compiles right.
    """
    n = topk_ids.shape[0]
    if fmt is None:
        segments = [to_bytes(p) for p in payloads]
    else:
        values, scales = (to_bytes(q) for q in quantize(payloads[0], fmt, global_scale))
        segments = [values, scales, *(to_bytes(p) for p in payloads[1:])]  # swizzled: zero columns up to 4
    send = topk_ids.new_zeros(wire.total_bytes, dtype=torch.uint8)
    planes = mask_planes(rank_mask(topk_ids, num_experts, wire.ep_size), wire.plane_stride).flatten()
    send[: planes.numel()] = planes
    for s, seg in enumerate(segments):
        wire.segment(send, s)[:n, : seg.shape[1]] = seg
    return send


def swizzle_rows(rows: torch.Tensor, runtime_max: int) -> torch.Tensor:
    """``[ep_size, runtime_max, cols]`` one-byte scales (cols a multiple of 4) -> ``[ep_size, bytes]``, each source
    block in the 128x4-tile layout (:func:`flashinfer_a2a.reference.quant.swizzle_scales_128x4`), padding zero."""
    ep_size, _, cols = rows.shape
    index = traced.swizzled_index(runtime_max, cols, rows.device)
    out = rows.new_zeros(ep_size, -(-runtime_max // 128) * 128 * cols)
    return out.index_copy(1, index, rows.reshape(ep_size, -1))


def select(gathered: torch.Tensor, wire: NcclWire, ep_rank: int, recv_like: Sequence[tuple[torch.dtype, tuple]],
           swizzled_segment: Optional[int] = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(recv, recv_counts)`` from the ``[ep_size, total_bytes]`` gathered send buffers: segment ``s`` as
    ``recv_like[s]`` (dtype, shape); ``swizzled_segment``: the scales, laid out in 128x4 tiles."""
    ep_size, runtime_max = wire.ep_size, wire.runtime_max
    byte, bit = divmod(ep_rank, 8)
    start = byte * wire.plane_stride
    mine = (gathered[:, start : start + runtime_max] >> bit) & 1
    counts = torch.sum(mine, dim=1, dtype=torch.int32)
    # A stable sort of "not mine" puts each block's rows for this rank first, in increasing token order: the
    # NVLink path's receive order. Rows past the count hold other rows of the block (unspecified by contract).
    order = torch.argsort(1 - mine, dim=1, stable=True)
    # Each source block's first row; a product, not arange's step, which may not be 0 (runtime_max 0: every rank
    # without tokens).
    order = (order + (torch.arange(ep_size, device=gathered.device) * runtime_max).unsqueeze(1)).view(-1)
    recv = []
    for s, (dtype, shape) in enumerate(recv_like):
        rows = wire.segment(gathered, s).reshape(ep_size * runtime_max, wire.row_bytes[s]).index_select(0, order)
        if s == swizzled_segment:
            rows = swizzle_rows(rows.view(ep_size, runtime_max, wire.row_bytes[s]), runtime_max)  # not -1: 0 rows
        recv.append(from_bytes(rows, dtype, shape))
    return recv, counts


def combine_wire(partials: torch.Tensor) -> torch.Tensor:
    """``[ep_size * runtime_max, fp8_wire_row_bytes(hidden)] uint8``: every partial row's FP8 values, then its fp32
    scales, then zeros (written by slices, as :func:`pack` is)."""
    flat = partials.reshape(-1, partials.shape[-1])
    rows, hidden = flat.shape
    values, scales = (to_bytes(q) for q in quant.quantize_fp8_block(flat))
    wire = flat.new_zeros(rows, fp8_wire_row_bytes(hidden), dtype=torch.uint8)
    wire[:, :hidden] = values
    wire[:, hidden : hidden + scales.shape[1]] = scales
    return wire


def ordered_sum(returned: torch.Tensor, send: torch.Tensor, wire: NcclWire, partials: torch.Tensor, ep_rank: int,
                fp8_wire: bool, num_tokens: int) -> torch.Tensor:
    """``[num_tokens, hidden]`` of the partials' dtype: token t's rows (rank d's at slot "tokens before t sent to d"
    of block d of ``returned``; FP8-wire rows dequantized, this rank's own from ``partials``) summed as
    ``((+0 + row(t, d0)) + row(t, d1)) + ...`` over d0 < d1 < ..., each step one fp32 addition, then one rounding:
    the NVLink combine's bits."""
    ep_size, runtime_max, hidden = partials.shape
    if fp8_wire:
        cols = -(-hidden // quant.FP8_BLOCK)
        values = from_bytes(returned[:, :hidden], torch.float8_e4m3fn, (ep_size * runtime_max, hidden))
        scales = from_bytes(returned[:, hidden : hidden + 4 * cols], torch.float32, (ep_size * runtime_max, cols))
        rows = quant.dequantize_fp8_block(values, scales).view(ep_size, runtime_max, hidden)
        rows[ep_rank] = partials[ep_rank].float()  # a rank's own partials cross no link: exact
    else:
        rows = from_bytes(returned, partials.dtype, (ep_size, runtime_max, hidden))
    mask = unpack_mask(send, wire, num_tokens)
    slots = (torch.cumsum(mask.to(torch.int64), dim=0) - 1).clamp_min(0)
    acc = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=partials.device)
    for d in range(ep_size):
        picked = rows[d].index_select(0, slots[:, d]).float()
        acc = torch.where(mask[:, d : d + 1], acc + picked, acc)
    return acc.to(partials.dtype)
