"""The device conversions of the quantized wire formats (include/flashinfer_a2a/quant.cuh, through CUTLASS's numeric
types) against the reference quantizers, bit for bit: Gaussian and heavy-tailed rows, zero rows, tiny values, rows
with ties, odd hidden sizes."""

import pytest
import torch

from flashinfer_a2a.reference import quant as ref

from .quant_probe import probe_spec, quantize_rows


@pytest.fixture(scope="module")
def probe():
    return probe_spec().load()


def _rows(hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16-representable fp32 rows: Gaussian, heavy-tailed (Student t, 2 degrees of freedom), zeros, tiny values
    (E4M3/E2M1 subnormal territory after scaling), huge values (an NVFP4 scale that saturates, or overflows to
    infinity under a large global scale), and exact ties of the E2M1 and E4M3 grids."""
    gauss = torch.randn(8, hidden, generator=gen) * 3
    heavy = torch.distributions.StudentT(2.0).sample((8, hidden)) * 0.5
    zeros = torch.tensor([[0.0], [-0.0]]).expand(2, hidden)  # the codes of -0 keep its sign
    tiny = torch.randn(2, hidden, generator=gen) * 1e-30
    huge = torch.randn(2, hidden, generator=gen) * 1e37
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -0.1, 272.0 / 448 * 6, 1.0])
    tie_rows = ties.repeat(2, -(-hidden // len(ties)))[:, :hidden]
    return torch.cat([gauss, heavy, zeros, tiny, huge, tie_rows]).to(torch.bfloat16).float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().contiguous().view(torch.uint8)


@pytest.mark.parametrize("hidden", [1, 16, 17, 2880, 7168, 7169])
def test_fp8_block_and_mxfp8_match_the_reference(probe, hidden):
    x = _rows(hidden, torch.Generator().manual_seed(torch.seed()))
    for fmt, quantize in (("fp8_block", ref.quantize_fp8_block), ("mxfp8", ref.quantize_mxfp8)):
        values, scales = quantize_rows(probe, x.cuda(), fmt)
        want_values, want_scales = quantize(x)
        assert torch.equal(values.cpu(), _bits(want_values)), fmt
        assert torch.equal(_bits(scales), _bits(want_scales)), fmt


@pytest.mark.parametrize("hidden", [1, 16, 17, 2880, 7168, 7169])
@pytest.mark.parametrize("global_scale", [1.0, 448 * 6 / 37.5, 3.0e4])
def test_nvfp4_matches_the_reference(probe, hidden, global_scale):
    x = _rows(hidden, torch.Generator().manual_seed(torch.seed()))
    packed, scales = quantize_rows(probe, x.cuda(), "nvfp4", global_scale)
    want_packed, want_scales = ref.quantize_nvfp4(x, global_scale)
    assert torch.equal(packed.cpu(), want_packed)
    assert torch.equal(_bits(scales), _bits(want_scales))
