"""The nccl transport's dispatch wire: the layout of one rank's send buffer, which the all-gather hands every rank.

``include/flashinfer_a2a/nccl_wire.cuh`` owns it (the kernels lay it out and read it). This mirror serves the CPU
path, which runs without the built library, and the buffers' sizes; tests/test_nccl_kernels.py pins it to the
library's ``get_nccl_wire_layout``::

    [ mask planes | segment 0 | segment 1 | ... ]      each part starting on a 16-byte boundary

- mask planes: ``[ceil(ep_size / 8), plane_stride]`` uint8, ``plane_stride`` = ``runtime_max`` rounded up to 16: bit
  ``b`` of byte ``t`` of plane ``j`` is set when local token ``t`` goes to rank ``8j + b``; bytes from
  ``num_tokens`` on are 0.
- segment ``s``: ``[runtime_max, row_bytes[s]]``, rows from ``num_tokens`` on unspecified: a quantizing dispatch's
  values, then its scales (row-major; swizzled ones padded with zero columns to a multiple of 4), then the payloads'
  rows as they are.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from .wire_formats import WireFormat

#: Alignment of every part of the wire (kNcclWireAlign): one 16-byte vector.
WIRE_ALIGN = 16


def _align(x: int, a: int = WIRE_ALIGN) -> int:
    return -(-x // a) * a


class NcclWire(NamedTuple):
    """One rank's send buffer (module docstring): sizes in bytes, offsets from its start."""

    ep_size: int
    runtime_max: int
    row_bytes: tuple[int, ...]  # per segment
    plane_stride: int
    offsets: tuple[int, ...]  # per segment (the mask planes are at 0)
    total_bytes: int

    @property
    def mask_planes(self) -> int:
        return -(-self.ep_size // 8)

    def segment(self, send, s: int):
        """Segment ``s`` of a ``[..., total_bytes]`` uint8 buffer as ``[..., runtime_max, row_bytes[s]]``."""
        begin = self.offsets[s]
        return send[..., begin : begin + self.runtime_max * self.row_bytes[s]].unflatten(-1, (self.runtime_max,
                                                                                                self.row_bytes[s]))


def make_wire(ep_size: int, runtime_max: int, row_bytes: Sequence[int]) -> NcclWire:
    """The layout of segments of ``row_bytes`` (MakeNcclWireLayout)."""
    plane_stride = _align(runtime_max)
    end = -(-ep_size // 8) * plane_stride
    offsets = []
    for row in row_bytes:
        offsets.append(_align(end))
        end = offsets[-1] + runtime_max * row
    return NcclWire(ep_size, runtime_max, tuple(row_bytes), plane_stride, tuple(offsets), _align(end))


def quant_row_bytes(fmt: WireFormat, hidden: int, swizzled: bool) -> tuple[int, int]:
    """Row bytes of the two segments a quantized payload of ``hidden`` elements crosses as: values, then scales
    (swizzled ones as whole tiles of 4 one-byte columns; NcclQuantRowBytes)."""
    cols = fmt.scale_cols(hidden)
    return fmt.value_bytes(hidden), _align(cols, 4) if swizzled else cols * fmt.scale_bytes


def dispatch_wire(ep_size: int, runtime_max: int, payload_row_bytes: Sequence[int], fmt: Optional[WireFormat],
                  hidden: int = 0, swizzled: bool = False) -> NcclWire:
    """The wire of one dispatch: ``payloads[0]`` as values and scales when ``fmt`` quantizes it (``hidden``
    elements), every other payload as its rows."""
    rows = list(payload_row_bytes)
    if fmt is not None:
        rows[:1] = quant_row_bytes(fmt, hidden, swizzled)
    return make_wire(ep_size, runtime_max, rows)
