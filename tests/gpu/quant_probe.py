"""The test-only library of tests/gpu/quant_probe.cu: the device conversions of include/flashinfer_a2a/quant.cuh."""

from __future__ import annotations

from pathlib import Path

import torch

from flashinfer_a2a.jit import JitSpec

FORMATS = {"fp8_block": 0, "mxfp8": 1, "nvfp4": 2}
BLOCKS = {"fp8_block": 128, "mxfp8": 32, "nvfp4": 16}


def probe_spec() -> JitSpec:
    return JitSpec(name="quant_probe", sources=(Path(__file__).resolve().with_suffix(".cu"),))


def quantize_rows(module, x: torch.Tensor, fmt: str, global_scale: float = 1.0):
    """The device quantizer on ``x`` ``[rows, hidden]`` fp32 (CUDA): ``(values, scales)`` like the reference's."""
    rows, hidden = x.shape
    blocks = -(-hidden // BLOCKS[fmt])
    width = (hidden + 1) // 2 if fmt == "nvfp4" else hidden
    values = torch.empty(rows, width, dtype=torch.uint8, device=x.device)
    scale_dtype = torch.float32 if fmt == "fp8_block" else torch.uint8
    scales = torch.empty(rows, blocks, dtype=scale_dtype, device=x.device)
    module.quantize_rows(x.contiguous(), FORMATS[fmt], float(global_scale), values, scales)
    return values, scales
