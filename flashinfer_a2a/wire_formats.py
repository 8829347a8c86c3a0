"""Bytes per token of the quantized wire formats, to size a workspace whose dispatch carries pre-quantized hidden
states (values and scales as two payloads). The formats are defined in :mod:`flashinfer_a2a.reference.quant` and
``docs/quantized_formats.md``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """Values of ``1 / elements_per_byte`` bytes each and one scale of ``scale_bytes`` per ``block`` elements."""

    name: str
    elements_per_byte: int
    block: int
    scale_bytes: int

    def value_bytes(self, hidden: int) -> int:
        return -(-hidden // self.elements_per_byte)

    def scale_bytes_per_token(self, hidden: int) -> int:
        return -(-hidden // self.block) * self.scale_bytes

    def row_bytes(self, hidden: int) -> int:
        """Values and scales of one token."""
        return self.value_bytes(hidden) + self.scale_bytes_per_token(hidden)


WIRE_FORMATS = {
    "fp8_block": WireFormat("fp8_block", elements_per_byte=1, block=128, scale_bytes=4),  # E4M3, fp32 per 128
    "mxfp8": WireFormat("mxfp8", elements_per_byte=1, block=32, scale_bytes=1),  # E4M3, UE8M0 per 32
    "nvfp4": WireFormat("nvfp4", elements_per_byte=2, block=16, scale_bytes=1),  # packed E2M1, UE4M3 per 16
}


def wire_format(name: str) -> WireFormat:
    """The format called ``name``; ValueError naming the choices otherwise."""
    if name not in WIRE_FORMATS:
        raise ValueError(f"dispatch_format must be one of {', '.join(WIRE_FORMATS)}, got {name!r}")
    return WIRE_FORMATS[name]
