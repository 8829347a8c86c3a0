"""The steps of the ``nccl`` transport's padded mode that differ while ``torch.compile`` traces it.

Eager calls move data with the in-place ``torch.distributed`` collectives into buffers the transport keeps per call
shape (a replayed CUDA graph reuses their memory). Dynamo cannot trace those collectives, and a compiled graph must
not write into tensors it keeps on a Python object between calls. So while tracing, :class:`NcclTransport` takes
these functional forms instead: the collectives of ``torch.distributed._functional_collectives`` (traced as
``_c10d_functional`` ops with an explicit wait, which dynamo, AOTAutograd and inductor support), and fresh tensors
for every result. The bytes they move and the rows they keep are the eager path's, so the results are bitwise equal.

Rows of several dtypes cross as one ``uint8`` row. Eagerly a dtype view reinterprets them; traced, a view between
dtypes of different sizes is not safe: inductor (torch 2.13, CPU) miscompiles a ``float32 -> uint8`` view of a
computed tensor copied into a wider row, and ``.contiguous()`` of a strided fp8 slice before a view. So traced rows are split into bytes and joined again with shifts through
the integer type of the element's size (a same-size view, a plain bitcast), little-endian as the eager view.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed import _functional_collectives as funcol

# torch 2.13 renames all_gather_tensor (deprecated there); older torch only has the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def tracing() -> bool:
    """True while dynamo traces the caller (torch.compile)."""
    return torch.compiler.is_compiling()


def all_gather(send: torch.Tensor, group: Any) -> torch.Tensor:
    """``[ep_size * rows, ...]``: every rank's ``send``, rank major (``all_gather_into_tensor``)."""
    return funcol.wait_tensor(_all_gather(send, 0, group))


def all_to_all(rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Block ``[d]`` of the result is block ``[this rank]`` of rank d's ``rows`` (equal blocks, as
    ``all_to_all_single`` without splits)."""
    return funcol.wait_tensor(funcol.all_to_all_single(rows, None, None, group))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def to_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` of any dtype as ``[rows, row_bytes] uint8``, the bytes of an eager ``view(torch.uint8)``."""
    size, rows = t.element_size(), t.shape[0]
    # The same-size view first, on the tensor as strided: inductor miscompiles .contiguous() of a strided fp8
    # slice followed by a dtype view (the bytes come out shifted).
    ints = t.view(_INT_OF_SIZE[size])
    if size == 1:
        return ints.reshape(rows, _width(t))
    shifts = torch.arange(0, 8 * size, 8, dtype=ints.dtype, device=t.device)
    return ((ints.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8).reshape(rows, _width(t))


def from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """``[rows, row_bytes] uint8`` as ``[*shape] dtype``, the inverse of :func:`to_bytes`."""
    size = dtype.itemsize
    if size == 1:
        return b.view(dtype).reshape(shape)
    kind = _INT_OF_SIZE[size]
    shifts = torch.arange(0, 8 * size, 8, dtype=kind, device=b.device)
    # The shifted bytes share no bit, so their sum (wrapping in the integer type) is their bitwise or.
    ints = (b.reshape(b.shape[0], -1, size).to(kind) << shifts).sum(-1, dtype=kind)
    return ints.view(dtype).reshape(shape)


def select_rows(gathered: torch.Tensor, order: torch.Tensor, wire: Sequence[torch.Tensor], offsets: Sequence[int],
                ep_size: int, runtime_max: int) -> list[torch.Tensor]:
    """The receive payloads ``[ep_size, runtime_max, ...]``: payload ``i``'s bytes (columns from ``offsets[i]``) of
    the gathered rows in ``order``, viewed back as the payload's dtype and row shape."""
    recv = []
    for p, off in zip(wire, offsets):
        width = _width(p)
        rows = gathered[:, off : off + width].index_select(0, order)
        recv.append(from_bytes(rows, p.dtype, (ep_size, runtime_max, *p.shape[1:])))
    return recv


def _width(p: torch.Tensor) -> int:
    width = p.element_size()
    for s in p.shape[1:]:
        width *= s
    return width


def swizzled_index(runtime_max: int, cols: int, device: torch.device) -> torch.Tensor:
    """``[runtime_max * cols]`` int64: where scale ``(r, c)`` goes in the 128x4-tile layout (the layout of
    :func:`flashinfer_a2a.reference.quant.swizzle_scales_128x4`), made on ``device`` so no host copy enters the
    graph."""
    r = torch.arange(runtime_max, device=device).view(-1, 1)
    c = torch.arange(cols, device=device).view(1, -1)
    tile = (r // 128) * (-(-cols // 4)) + c // 4
    return (tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4).flatten()
