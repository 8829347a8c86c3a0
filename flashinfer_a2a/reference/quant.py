"""Pure-torch reference quantizers of the quantized wire formats: the bit-exact definition a fused quantizing
dispatch must reproduce.

Inputs are ``[..., hidden]`` floating-point tensors (bf16, fp16 or fp32), finite; every computation is in fp32 with
one IEEE-rounded operation per step, in the order written here, so a CUDA kernel can follow it operation for
operation (``__fdiv_rn`` / ``__fmul_rn``, no fused multiply-add). Blocks run along the last dimension; a last block
shorter than the block size (odd hidden sizes) is quantized on its own elements.

- :func:`quantize_fp8_block`: FP8 E4M3 with one fp32 scale per 128 elements (DeepSeek-style);
- :func:`quantize_mxfp8`: FP8 E4M3 with one UE8M0 (power-of-two) scale per 32 elements (OCP MX);
- :func:`quantize_nvfp4`: E2M1 pairs packed in bytes with one UE4M3 scale per 16 elements and a per-tensor fp32
  global scale;
- :func:`swizzle_scales_128x4`: the 128x4-tile scale layout Blackwell block-scaled GEMMs read.

Each quantizer has a dequantizer, for error measurements and round-trip tests.
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_BLOCK",
    "MXFP8_BLOCK",
    "NVFP4_BLOCK",
    "dequantize_fp8_block",
    "dequantize_mxfp8",
    "dequantize_nvfp4",
    "fp8_wire",
    "quantize",
    "quantize_fp8_block",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_nvfp4_unchecked",
    "reference_combine_fp8",
    "swizzle_scales_128x4",
    "unswizzle_scales_128x4",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_BLOCK = 128
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
#: Smallest block maximum an FP8 block scale is computed from: an all-zero block gets a tiny, finite scale.
FP8_AMAX_FLOOR = 1e-10
#: E2M1 magnitudes by code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``x`` as fp32 ``[..., num_blocks, block]``, the last block zero-padded; and the original hidden size."""
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must be [..., hidden] with hidden >= 1, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    num_blocks = -(-hidden // block)
    padded = torch.nn.functional.pad(x.float(), (0, num_blocks * block - hidden))
    return padded.view(*x.shape[:-1], num_blocks, block), hidden


def _div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """``x / divisor``, one IEEE-rounded division on every device. Not ``x / divisor`` itself: on a CUDA tensor torch
    computes ``x * (1 / divisor)`` for a host scalar divisor, which differs in the last bit for about half the
    inputs when the divisor is 448 or 6 (the kernels, and this module on the CPU, divide)."""
    return x / torch.full_like(x, divisor)


def _unblock(blocks: torch.Tensor, hidden: int) -> torch.Tensor:
    return blocks.flatten(-2)[..., :hidden]


def _to_e4m3(values: torch.Tensor) -> torch.Tensor:
    """Round to nearest even, saturating at +-448 (torch turns out-of-range values into NaN, so clamp first)."""
    return values.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_fp8_block(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one fp32 scale per 128 elements.

    Per block: ``scale = max(amax, 1e-10) / 448``; ``q = e4m3(clamp(x / scale, -448, 448))``, round to nearest even.

    Returns:
        ``(q [..., hidden] float8_e4m3fn, scales [..., ceil(hidden / 128)] float32)``.
    """
    blocks, hidden = _blocks(x, FP8_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = _div(amax.clamp_min(FP8_AMAX_FLOOR), E4M3_MAX)
    q = _to_e4m3(blocks / scale)
    return _unblock(q, hidden), scale.squeeze(-1)


def dequantize_fp8_block(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` of :func:`quantize_fp8_block`'s output."""
    blocks, hidden = _blocks(q.float(), FP8_BLOCK)
    return _unblock(blocks * scales.unsqueeze(-1), hidden)


def _mx_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The smallest ``e`` with ``amax <= 448 * 2**e``, clamped to [-127, 127] (int32); -127 for a zero block.

    Exact, from the binary exponent: ``amax = m * 2**k`` with ``m`` in [0.5, 1) and ``448 = 0.875 * 2**9``, so
    ``e = k - 9`` when ``m <= 0.875``, else ``k - 8``. Rounding the scale up never saturates an element.
    """
    mantissa, exponent = torch.frexp(amax)
    e = torch.where(mantissa <= 0.875, exponent - 9, exponent - 8)
    e = torch.where(amax == 0, torch.full_like(e, -127), e)
    return e.clamp(-127, 127)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8: FP8 E4M3 with one UE8M0 scale ``2**e`` per 32 elements.

    Per block: ``e`` is the smallest exponent with ``amax <= 448 * 2**e`` (clamped to [-127, 127]; -127 for an
    all-zero block); the stored scale byte is ``e + 127``; ``q = e4m3(x * 2**-e)`` (an exact scaling unless the
    product is an fp32 subnormal), round to nearest even.

    Returns:
        ``(q [..., hidden] float8_e4m3fn, scales [..., ceil(hidden / 32)] uint8)``.
    """
    blocks, hidden = _blocks(x, MXFP8_BLOCK)
    e = _mx_exponent(blocks.abs().amax(-1, keepdim=True))
    q = _to_e4m3(torch.ldexp(blocks, (-e).float()))
    return _unblock(q, hidden), (e + 127).squeeze(-1).to(torch.uint8)


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * 2**(scale - 127)`` of :func:`quantize_mxfp8`'s output."""
    blocks, hidden = _blocks(q.float(), MXFP8_BLOCK)
    return _unblock(torch.ldexp(blocks, (scales.to(torch.int32) - 127).unsqueeze(-1).float()), hidden)


def _e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8) of fp32 values: round to nearest even, saturating at +-6; the sign bit kept for
    values that round to zero."""
    a = values.abs()
    # Each threshold is a midpoint between neighbours; at a tie the even code wins (">" rounds it down, ">=" up).
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
            + (a >= 3.5).int() + (a > 5.0).int())
    return (code + 8 * torch.signbit(values).int()).to(torch.uint8)


def quantize_nvfp4(x: torch.Tensor, global_scale: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4: E2M1 values packed two per byte, one UE4M3 scale per 16 elements, and a per-tensor fp32 global scale
    (typically ``448 * 6 / amax`` of the tensor, chosen by the caller).

    Per block: ``sf = e4m3(clamp(global_scale * (amax / 6), 0, 448))``, round to nearest even; ``inv = global_scale
    / float(sf)`` (0 when ``sf`` is 0); each element's code is E2M1 of ``x * inv`` (round to nearest even, saturating
    at 6). Byte ``i`` of a row holds element ``2i`` in its low nibble and ``2i + 1`` in its high nibble (an odd hidden
    size leaves the last high nibble 0). Dequantized, an element is ``value * float(sf) / global_scale``.

    Returns:
        ``(packed [..., ceil(hidden / 2)] uint8, scales [..., ceil(hidden / 16)] float8_e4m3fn)``.
    """
    gs = torch.as_tensor(global_scale, dtype=torch.float32)
    if gs.numel() != 1 or not bool(gs > 0) or not bool(torch.isfinite(gs)):
        raise ValueError(f"global_scale must be one positive finite number, got {global_scale}")
    return quantize_nvfp4_unchecked(x, gs)


def quantize_nvfp4_unchecked(x: torch.Tensor, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_nvfp4` with ``gs`` (a 0-d fp32 tensor, on x's device or the CPU) not checked: checking reads
    it on the host, which a CUDA-graph capture cannot do."""
    blocks, hidden = _blocks(x, NVFP4_BLOCK)
    amax = blocks.abs().amax(-1, keepdim=True)
    sf = _to_e4m3((gs * _div(amax, E2M1_MAX)).clamp_min(0.0))
    sf32 = sf.float()
    inv = torch.where(sf32 == 0, torch.zeros_like(sf32), gs / sf32)
    codes = _e2m1_codes(_unblock(blocks * inv, hidden))
    if hidden % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, sf.squeeze(-1)


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, global_scale: float | torch.Tensor,
                     hidden: int) -> torch.Tensor:
    """fp32 values of :func:`quantize_nvfp4`'s output (``hidden`` elements per row)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)[..., :hidden]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[(codes & 7).long()] * torch.where(codes >= 8, -1.0, 1.0)
    blocks, _ = _blocks(values, NVFP4_BLOCK)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)  # a divisor on the device: see _div
    return _unblock(blocks * (scales.float().unsqueeze(-1) / gs), hidden)


def quantize(x: torch.Tensor, fmt: str, global_scale: float | torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, scales)`` of ``x`` in the wire format called ``fmt`` (``"fp8_block"``, ``"mxfp8"`` or
    ``"nvfp4"``); ``global_scale`` is NVFP4's per-tensor scale, required there and refused elsewhere (as the
    quantizing dispatch does)."""
    if (global_scale is not None) != (fmt == "nvfp4"):
        raise ValueError(f"global_scale is {'required' if fmt == 'nvfp4' else 'only used'} by nvfp4 (fmt={fmt!r})")
    if fmt == "fp8_block":
        return quantize_fp8_block(x)
    if fmt == "mxfp8":
        return quantize_mxfp8(x)
    if fmt == "nvfp4":
        return quantize_nvfp4(x, global_scale)
    raise ValueError(f"fmt must be fp8_block, mxfp8 or nvfp4, got {fmt!r}")


def _swizzled_index(rows: int, cols: int) -> torch.Tensor:
    """``[rows, cols]`` int64: where scale ``(r, c)`` goes in the 128x4-tile layout of ``[rows, cols]``."""
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    tiles_per_row = -(-cols // 4)
    tile = (r // 128) * tiles_per_row + c // 4
    return tile * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + c % 4


def swizzle_scales_128x4(scales: torch.Tensor) -> torch.Tensor:
    """The 128x4-tile layout of ``[..., rows, cols]`` block scales (one byte each): rows padded to a multiple of 128
    and columns to a multiple of 4 with zeros; tile ``(i, j)`` (rows ``128i..``, columns ``4j..``) is 512 contiguous
    bytes at tile index ``i * ceil(cols / 4) + j``, holding scale ``(r, c)`` at ``(r % 32) * 16 + (r % 128 // 32) * 4
    + c % 4``.

    Returns:
        ``[..., ceil(rows / 128) * 128 * ceil(cols / 4) * 4]`` of ``scales``' dtype.
    """
    if scales.element_size() != 1 or scales.dim() < 2:
        raise ValueError(f"scales must be [..., rows, cols] of a one-byte dtype, got {tuple(scales.shape)} "
                         f"{scales.dtype}")
    *lead, rows, cols = scales.shape
    size = -(-rows // 128) * 128 * (-(-cols // 4) * 4)
    raw = scales.view(torch.uint8).reshape(-1, rows * cols)
    out = torch.zeros(raw.shape[0], size, dtype=torch.uint8)
    out[:, _swizzled_index(rows, cols).flatten()] = raw
    return out.view(scales.dtype).reshape(*lead, size)


def unswizzle_scales_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``[..., rows, cols]`` from :func:`swizzle_scales_128x4`'s layout."""
    raw = swizzled.view(torch.uint8).reshape(-1, swizzled.shape[-1])
    out = raw[:, _swizzled_index(rows, cols).flatten()]
    return out.view(swizzled.dtype).reshape(*swizzled.shape[:-1], rows, cols)


def fp8_wire(partials: torch.Tensor) -> torch.Tensor:
    """What a scaled FP8 combine delivers of ``partials`` ``[..., hidden]``: every row quantized by
    :func:`quantize_fp8_block` on the rank that computed it and dequantized (fp32 ``q * scale``) on the rank that
    sums it. fp32, same shape."""
    return dequantize_fp8_block(*quantize_fp8_block(partials))


def reference_combine_fp8(partials, routing, num_experts: int | None = None, *,
                          out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """:func:`flashinfer_a2a.reference.reference_combine` over an FP8 wire: each partial a rank computed for another
    rank passes through :func:`fp8_wire` (a rank's partials for its own tokens, ``partials[d][d]``, cross no link
    and stay exact), then the same fp32 sum in increasing rank order, cast once to ``out_dtype`` (default: the
    partials' dtype)."""
    from . import reference_combine

    out_dtype = partials[0].dtype if out_dtype is None else out_dtype
    wired = []
    for rank, p in enumerate(partials):
        w = fp8_wire(p)
        w[rank] = p[rank].float()
        wired.append(w)
    return reference_combine(wired, routing, num_experts, out_dtype=out_dtype)
