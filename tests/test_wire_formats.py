"""Workspace sizing of pre-quantized dispatch and of the pushed combine: the bytes per token of each wire
format match what the reference quantizers produce (MoeAlltoAll's check of the format name is in
tests/test_moe_alltoall.py)."""

import pytest
import torch

from flashinfer_a2a.reference import quant
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS, push_combine_bytes_per_token, wire_format

@pytest.mark.parametrize("name", sorted(WIRE_FORMATS))
@pytest.mark.parametrize("hidden", [1, 16, 17, 2880, 7168, 7169])
def test_row_bytes_are_what_the_quantizer_produces(name, hidden):
    values, scales = quant.quantize(torch.randn(3, hidden), name, 1.0 if name == "nvfp4" else None)
    fmt = wire_format(name)
    assert fmt.value_bytes(hidden) == values[0].nbytes
    assert fmt.scale_bytes_per_token(hidden) == scales[0].nbytes
    assert fmt.row_bytes(hidden) == values[0].nbytes + scales[0].nbytes


def test_deepseek_v3_rows():
    assert [wire_format(n).row_bytes(7168) for n in ("fp8_block", "mxfp8", "nvfp4")] == [7392, 7392, 4032]


def test_push_combine_bytes_per_token():
    """The partial plus its landing row (the partial again, or FP8 values and fp32 scales per 128 padded to 16
    bytes), by hand."""
    fp8 = dict(combine_format="fp8_block")
    assert push_combine_bytes_per_token(7168, torch.bfloat16, **fp8) == 7168 * 2 + 7168 + 56 * 4
    assert push_combine_bytes_per_token(2880, torch.float16, **fp8) == 2880 * 2 + 2976  # 2880 + 23 * 4 -> 2976
    assert push_combine_bytes_per_token(16, torch.bfloat16, **fp8) == 32 + 32  # 16 + 4 -> 32
    assert push_combine_bytes_per_token(7168, torch.bfloat16) == 2 * 7168 * 2
    assert push_combine_bytes_per_token(2881, torch.float32) == 2 * 2881 * 4
    with pytest.raises(ValueError, match="combine_format must be None or 'fp8_block', got 'mxfp8'"):
        push_combine_bytes_per_token(7168, torch.bfloat16, "mxfp8")
