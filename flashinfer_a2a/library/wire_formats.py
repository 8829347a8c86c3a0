"""Bytes per token of the quantized wire formats, to size a workspace whose dispatch carries pre-quantized hidden
states (values and scales as two payloads), and of a pushed combine's rows. The formats are defined in
:mod:`flashinfer_a2a.reference.quant` and ``docs/quantized_formats.md``."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class WireFormat:
    """Values of ``1 / elements_per_byte`` bytes each and one scale of ``scale_bytes`` per ``block`` elements.

    ``code`` is the format's number in the ops' ``quant_format`` argument; ``value_dtype`` / ``scale_dtype`` are the
    dtypes of the received values and scales (NVFP4 values: two E2M1 codes per uint8, low nibble first).
    """

    name: str
    code: int
    elements_per_byte: int
    block: int
    scale_bytes: int
    value_dtype: torch.dtype
    scale_dtype: torch.dtype

    def value_bytes(self, hidden: int) -> int:
        return -(-hidden // self.elements_per_byte)

    def scale_cols(self, hidden: int) -> int:
        return -(-hidden // self.block)

    def scale_bytes_per_token(self, hidden: int) -> int:
        return self.scale_cols(hidden) * self.scale_bytes

    def row_bytes(self, hidden: int) -> int:
        """Values and scales of one token."""
        return self.value_bytes(hidden) + self.scale_bytes_per_token(hidden)

    def swizzled_scale_bytes(self, rows: int, hidden: int) -> int:
        """Bytes of one source block of scales in the 128x4-tile layout: rows padded to 128, columns to 4."""
        return -(-rows // 128) * 128 * (-(-self.scale_cols(hidden) // 4) * 4)

    def dispatch_bytes_per_token(self, hidden: int, max_num_tokens: int, swizzled_scales: bool = False) -> int:
        """Workspace bytes per token for values and scales: :meth:`row_bytes`, plus, with swizzled scales, the
        padding of a source block of ``max_num_tokens`` rows spread over its tokens."""
        if not swizzled_scales:
            return self.row_bytes(hidden)
        return self.value_bytes(hidden) + -(-self.swizzled_scale_bytes(max_num_tokens, hidden) // max_num_tokens)


def check_combine_format(value: Optional[str], argument: str = "combine_format") -> None:
    """ValueError naming ``argument`` unless ``value`` is a wire combine has: None (the partials' own dtype) or
    ``"fp8_block"``."""
    if value not in (None, "fp8_block"):
        raise ValueError(f"{argument} must be None or 'fp8_block', got {value!r}")


def push_combine_bytes_per_token(hidden: int, dtype: torch.dtype, combine_format: Optional[str] = None) -> int:
    """Combine bytes per token of a workspace whose combine is pushed (every rank on a GPU of its own): the
    ``hidden x dtype`` partial, plus the landing row where the token's owner receives it — the partial again, or
    (``combine_format="fp8_block"``) its FP8 values and fp32 scales per 128, padded to 16 bytes. A combine with
    ``combine_mode="push"`` on a workspace with less room is refused (ValueError); room alone never makes a combine
    push. Room for the plain landing row also fits the FP8 one."""
    check_combine_format(combine_format)
    if combine_format is None:
        return 2 * hidden * dtype.itemsize
    return hidden * dtype.itemsize + fp8_wire_row_bytes(hidden)


def fp8_wire_row_bytes(hidden: int) -> int:
    """Bytes of one partial row over combine's FP8 wire: ``hidden`` E4M3 values, then an fp32 scale per 128, padded
    to 16 (Fp8WireRowBytes)."""
    return -(-WIRE_FORMATS["fp8_block"].row_bytes(hidden) // 16) * 16


WIRE_FORMATS = {
    # E4M3 values, one fp32 scale per 128 (DeepSeek style)
    "fp8_block": WireFormat("fp8_block", 1, 1, 128, 4, torch.float8_e4m3fn, torch.float32),
    # E4M3 values, one UE8M0 byte per 32 (OCP MX): scale 2 ** (byte - 127)
    "mxfp8": WireFormat("mxfp8", 2, 1, 32, 1, torch.float8_e4m3fn, torch.uint8),
    # packed E2M1 values, one UE4M3 scale per 16, under a per-tensor fp32 global scale
    "nvfp4": WireFormat("nvfp4", 3, 2, 16, 1, torch.uint8, torch.float8_e4m3fn),
}


def wire_format(name: str, argument: str = "dispatch_format") -> WireFormat:
    """The format called ``name``; ValueError naming ``argument`` and the choices otherwise."""
    if name not in WIRE_FORMATS:
        raise ValueError(f"{argument} must be one of {', '.join(WIRE_FORMATS)}, got {name!r}")
    return WIRE_FORMATS[name]
