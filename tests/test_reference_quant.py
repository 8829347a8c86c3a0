"""The reference quantizers against hand-computed cases: saturation, zeros, subnormals, scale rounding, packing,
odd hidden sizes and the 128x4 scale layout."""

import math

import pytest
import torch

from flashinfer_a2a.reference import quant as q


def f32(values):
    return torch.tensor(values, dtype=torch.float32)


def e4m3_values(t):
    return t.float().tolist()


def test_fp8_block_scale_is_amax_over_448():
    x = torch.zeros(1, 130)
    x[0, :4] = f32([448.0, -448.0, 1.0, 0.0])
    x[0, 128:] = f32([3.0, -1.5])  # the short last block of an odd-sized row
    values, scales = q.quantize_fp8_block(x)
    assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.tolist() == [[1.0, f32(3.0).div(448.0).item()]]
    assert e4m3_values(values[0, :4]) == [448.0, -448.0, 1.0, 0.0]
    assert e4m3_values(values[0, 128:]) == [448.0, -224.0]


def test_fp8_block_element_at_amax_is_448():
    # amax / (amax / 448) is 448.00003 in fp32 for this amax: it still lands on 448.
    amax = 9.908287048339844
    values, scales = q.quantize_fp8_block(f32([[amax, -amax, amax / 2]]))
    assert f32(amax) / scales[0, 0] > 448.0
    assert e4m3_values(values[0]) == [448.0, -448.0, 224.0]


def test_fp8_block_zeros_and_subnormals():
    values, scales = q.quantize_fp8_block(torch.zeros(2, 128))
    assert torch.all(values.float() == 0) and torch.all(scales == f32(1e-10) / 448.0)
    # Scale 1: the E4M3 subnormal step is 2**-9; ties round to even.
    x = f32([[448.0, 2.0**-10, 3 * 2.0**-10, 2.0**-9, 5 * 2.0**-11]])
    values, _ = q.quantize_fp8_block(x)
    assert e4m3_values(values[0]) == [448.0, 0.0, 2.0**-8, 2.0**-9, 2.0**-9]


def test_fp8_block_rounds_to_nearest_even():
    # Scale 1; between 256 and 288 the E4M3 step is 32: 272 is a tie (-> 256, even), 273 rounds up.
    values, _ = q.quantize_fp8_block(f32([[448.0, 272.0, 273.0, 304.0]]))
    assert e4m3_values(values[0]) == [448.0, 256.0, 288.0, 320.0]


@pytest.mark.parametrize("amax,exponent", [(448.0, 0), (449.0, 1), (1.0, -8), (896.0, 1), (897.0, 2),
                                           (0.0, -127), (2.0**-140, -127), (3.0e38, 120)])
def test_mxfp8_scale_is_the_smallest_power_of_two_that_fits(amax, exponent):
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    values, scales = q.quantize_mxfp8(x)
    assert scales.dtype == torch.uint8 and scales.tolist() == [[exponent + 127]]
    if amax > 0 and exponent > -127:
        assert values[0, 0].float().item() <= 448.0
        assert amax <= 448.0 * 2.0**exponent and amax > 448.0 * 2.0 ** (exponent - 1)


def test_mxfp8_elements_scale_exactly_then_round():
    x = torch.zeros(1, 33)
    x[0, :3] = f32([449.0, 1.0, -0.25])  # e = 1: elements halved exactly, then E4M3 rounding
    x[0, 32] = 1.0  # its own block: e = -8, element 256
    values, scales = q.quantize_mxfp8(x)
    assert scales.tolist() == [[128, 119]]
    assert e4m3_values(values[0, :3]) == [224.0, 0.5, -0.125]  # 224.5 -> 224 (step 16 there)
    assert values[0, 32].float().item() == 256.0


def test_e2m1_codes_round_half_to_even_and_saturate():
    values = f32([0.0, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 100.0, -0.75, -0.1, -0.0])
    assert q._e2m1_codes(values).tolist() == [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 7, 10, 8, 8]


def test_nvfp4_packing_and_scales():
    x = torch.zeros(1, 16)
    x[0, :7] = f32([6.0, 3.0, 1.5, -0.75, 0.25, 5.0, 0.5])
    packed, scales = q.quantize_nvfp4(x, 1.0)
    assert scales.dtype == torch.float8_e4m3fn and scales.float().tolist() == [[1.0]]  # 1 * (6 / 6)
    codes = [7, 5, 3, 10, 0, 6, 1, 0]  # element pairs (low nibble first)
    assert packed.tolist()[0][:4] == [codes[0] | codes[1] << 4, codes[2] | codes[3] << 4, codes[4] | codes[5] << 4,
                                      codes[6] | codes[7] << 4]
    assert packed.tolist()[0][4:] == [0, 0, 0, 0]
    packed2, scales2 = q.quantize_nvfp4(x, 2.0)  # the global scale lands in the block scale, not in the codes
    assert torch.equal(packed2, packed) and scales2.float().tolist() == [[2.0]]


def test_nvfp4_scale_rounding_saturation_and_zero_blocks():
    x = torch.zeros(3, 16)
    x[0, 0] = 0.6  # sf = e4m3(0.1) = 0.1015625; 0.6 / 0.1015625 = 5.9 -> 6
    x[1, 0] = 6.0 * 1000  # sf saturates at 448 (an unclamped cast would be NaN); 6000 / 448 = 13.4 -> 6
    packed, scales = q.quantize_nvfp4(x, 1.0)
    assert scales.float().flatten().tolist() == [0.1015625, 448.0, 0.0]
    assert packed[:, 0].tolist() == [7, 7, 0]
    assert torch.all(packed[2] == 0)  # an all-zero block: scale 0, codes 0 (no 0 * inf)


def test_nvfp4_odd_hidden_pads_the_last_nibble():
    x = torch.full((2, 17), 1.0)
    packed, scales = q.quantize_nvfp4(x, 6.0)  # sf = e4m3(6 * 1/6) = 1, inv = 6: every element codes 6 -> 7
    assert packed.shape == (2, 9) and scales.shape == (2, 2)
    assert packed[0, :8].tolist() == [0x77] * 8 and packed[0, 8].item() == 0x07


@pytest.mark.parametrize("global_scale", [0.0, -1.0, math.inf])
def test_nvfp4_rejects_a_bad_global_scale(global_scale):
    with pytest.raises(ValueError, match="global_scale"):
        q.quantize_nvfp4(torch.ones(1, 16), global_scale)


def test_quantizers_reject_non_float_input():
    with pytest.raises(TypeError, match="floating-point"):
        q.quantize_fp8_block(torch.ones(1, 16, dtype=torch.int32))


@pytest.mark.parametrize("hidden", [7168, 7169, 2880])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trips_stay_within_each_formats_step(hidden, dtype):
    x = (torch.randn(4, hidden) * 3).to(dtype)
    ref = x.float()
    values, scales = q.quantize_fp8_block(x)
    assert values.shape == x.shape
    block_amax = torch.nn.functional.pad(ref.abs(), (0, -hidden % 128)).view(4, -1, 128).amax(-1)
    err = (q.dequantize_fp8_block(values, scales) - ref).abs()
    # E4M3 keeps 3 mantissa bits: relative error <= 2**-4 of the value, plus subnormal steps of the block's scale.
    bound = ref.abs() * 2.0**-4 + (block_amax / 448 * 2.0**-9).repeat_interleave(128, -1)[:, :hidden]
    assert torch.all(err <= bound)
    values, scales = q.quantize_mxfp8(x)
    # The same for MXFP8, with the subnormal step in units of the block's power-of-two scale.
    exponent = (scales.to(torch.int32) - 127 - 9).float()
    subnormal = torch.ldexp(torch.ones_like(exponent), exponent).repeat_interleave(32, -1)[:, :hidden]
    assert torch.all((q.dequantize_mxfp8(values, scales) - ref).abs() <= ref.abs() * 2.0**-4 + subnormal)
    gs = 448 * 6 / ref.abs().max().item()
    packed, scales = q.quantize_nvfp4(x, gs)
    assert packed.shape == (4, (hidden + 1) // 2)
    back = q.dequantize_nvfp4(packed, scales, gs, hidden)
    block_max = torch.nn.functional.pad(ref.abs(), (0, -hidden % 16)).view(4, -1, 16).amax(-1)
    # E2M1 steps are at most 2 (between 4 and 6) in units of the block scale ~ amax / 6, itself within 2**-4.
    step = (block_max / 6 * (1 + 2.0**-3)).repeat_interleave(16, -1)[:, :hidden]
    assert torch.all((back - ref).abs() <= step + 1e-6)


def test_swizzle_positions_by_hand():
    rows, cols = 130, 5
    scales = torch.arange(rows * cols, dtype=torch.int64).remainder(251).add(1).to(torch.uint8).view(rows, cols)
    out = q.swizzle_scales_128x4(scales)
    assert out.shape == (256 * 8,)  # rows -> 256, cols -> 8: 2 x 2 tiles of 512 bytes
    def at(r, c):
        return int(out[q._swizzled_index(rows, cols)[r, c]])
    assert q._swizzled_index(rows, cols)[0, 0] == 0 and q._swizzled_index(rows, cols)[1, 0] == 16
    assert q._swizzled_index(rows, cols)[0, 1] == 1 and q._swizzled_index(rows, cols)[40, 3] == 8 * 16 + 4 + 3
    assert q._swizzled_index(rows, cols)[2, 4] == 512 + 2 * 16
    assert q._swizzled_index(rows, cols)[129, 4] == 3 * 512 + 16
    assert at(129, 4) == int(scales[129, 4])
    assert int((out != 0).sum()) == rows * cols  # the padding is zero
    assert torch.equal(q.unswizzle_scales_128x4(out, rows, cols), scales)


def test_swizzle_keeps_leading_dims_and_dtype():
    scales = torch.rand(3, 2, 40, 7).to(torch.float8_e4m3fn)  # [ep, ..., rows, cols]
    out = q.swizzle_scales_128x4(scales)
    assert out.shape == (3, 2, 128 * 8) and out.dtype == torch.float8_e4m3fn
    back = q.unswizzle_scales_128x4(out, 40, 7)
    assert torch.equal(back.view(torch.uint8), scales.view(torch.uint8))


def _routing(ep_size, tokens, gen):
    from flashinfer_a2a import reference as routing_ref

    ids = [routing_ref.random_topk_ids(tokens, 8, 64, generator=gen) for _ in range(ep_size)]
    return routing_ref.reference_dispatch(ids, [[torch.zeros(tokens, 1)] for _ in range(ep_size)], 64, tokens)


def test_fp8_wire_combine_is_the_combine_of_the_dequantized_partials():
    from flashinfer_a2a.reference import reference_combine

    gen = torch.Generator().manual_seed(1)
    result = _routing(2, 16, gen)
    partials = [torch.randn(2, 16, 256, generator=gen).to(torch.bfloat16) for _ in range(2)]
    got = q.reference_combine_fp8(partials, result)
    wired = [q.dequantize_fp8_block(*q.quantize_fp8_block(p)) for p in partials]
    for rank, w in enumerate(wired):  # a rank's partials of its own tokens cross no link: exact
        w[rank] = partials[rank][rank].float()
    want = reference_combine(wired, result, out_dtype=torch.bfloat16)
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and got[0].dtype == torch.bfloat16
    changed = reference_combine([q.dequantize_fp8_block(*q.quantize_fp8_block(p)) for p in partials], result,
                                out_dtype=torch.bfloat16)
    assert not all(torch.equal(g, c) for g, c in zip(got, changed))
    # Partials on the FP8 grid of a power-of-two block scale (every block's maximum 448 * 2**-3) travel exactly:
    # the same result as the bf16 combine.
    exact = []
    for p in partials:
        grid = (p.float() * 100).clamp(-448, 448).to(torch.float8_e4m3fn).float()
        grid[..., ::128] = 448.0
        exact.append((grid * 2.0**-3).to(torch.bfloat16))
    assert all(torch.equal(g, w) for g, w in zip(q.reference_combine_fp8(exact, result),
                                                  reference_combine(exact, result)))


def test_fp8_wire_combine_error_on_gaussian_partials():
    from flashinfer_a2a.reference import reference_combine

    gen = torch.Generator().manual_seed(2)
    result = _routing(4, 64, gen)
    partials = [torch.randn(4, 64, 1024, generator=gen).to(torch.bfloat16) for _ in range(4)]
    fp8 = torch.cat(q.reference_combine_fp8(partials, result)).float()
    bf16 = torch.cat(reference_combine(partials, result)).float()
    rel = float((fp8 - bf16).norm() / bf16.norm())
    assert 0.012 < rel < 0.03  # docs/quantized_formats.md: 2.2% at ep 4, hidden 7168


def test_quantize_picks_the_format_and_checks_the_global_scale():
    x = torch.randn(3, 300, generator=torch.Generator().manual_seed(4))
    for fmt, direct in (("fp8_block", q.quantize_fp8_block(x)), ("mxfp8", q.quantize_mxfp8(x)),
                        ("nvfp4", q.quantize_nvfp4(x, 2.0))):
        got = q.quantize(x, fmt, 2.0 if fmt == "nvfp4" else None)
        assert all(torch.equal(g.view(torch.uint8), d.view(torch.uint8)) for g, d in zip(got, direct))
    with pytest.raises(ValueError, match="global_scale is required by nvfp4"):
        q.quantize(x, "nvfp4")
    with pytest.raises(ValueError, match="global_scale is only used by nvfp4"):
        q.quantize(x, "mxfp8", 1.0)
    with pytest.raises(ValueError, match="fmt must be fp8_block, mxfp8 or nvfp4, got 'fp4'"):
        q.quantize(x, "fp4")
