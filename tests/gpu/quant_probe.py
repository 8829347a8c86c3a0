"""The test-only library of tests/gpu/quant_probe.cu: the device conversions of include/flashinfer_a2a/quant.cuh."""

from __future__ import annotations

from pathlib import Path

import torch

from flashinfer_a2a.jit import JitSpec
from flashinfer_a2a.library.wire_formats import wire_format

FORMATS = {"fp8_block": 0, "mxfp8": 1, "nvfp4": 2}  # the Format enum of quant_probe.cu


def probe_spec() -> JitSpec:
    return JitSpec(name="quant_probe", sources=(Path(__file__).resolve().with_suffix(".cu"),))


def quantize_rows(module, x: torch.Tensor, fmt: str, global_scale: float = 1.0):
    """The device quantizer on ``x`` ``[rows, hidden]`` fp32 (CUDA): ``(values, scales)`` like the reference's."""
    rows, hidden = x.shape
    wire = wire_format(fmt)
    values = torch.empty(rows, wire.value_bytes(hidden), dtype=torch.uint8, device=x.device)
    scale_dtype = torch.float32 if wire.scale_bytes == 4 else torch.uint8
    scales = torch.empty(rows, -(-hidden // wire.block), dtype=scale_dtype, device=x.device)
    module.quantize_rows(x.contiguous(), FORMATS[fmt], float(global_scale), values, scales)
    return values, scales
