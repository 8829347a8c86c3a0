"""Fused quantizing dispatch and the FP8-wire combine on simulated ranks, bit for bit against the reference."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.library.errors import metadata_offsets
from flashinfer_a2a.reference import quant as q
from flashinfer_a2a.testing.simulate import SimulatedRanks
from flashinfer_a2a.library.wire_formats import wire_format

from .cases import scramble_


@dataclasses.dataclass
class Shape:
    ep_size: int
    hidden: int
    tokens: tuple[int, ...]
    runtime_max: int
    dtype: torch.dtype = torch.bfloat16
    misaligned: bool = False  # hidden states 2 bytes off a 16-byte boundary: element-wise loads


SHAPES = {
    "ep2-7168": Shape(2, 7168, (150, 97), 150),
    "ep3-odd-fp16": Shape(3, 7169, (5, 0, 33), 40, torch.float16),
    "ep4-2880": Shape(4, 2880, (1, 64, 0, 17), 64),
    "ep2-tiny": Shape(2, 16, (3, 200), 200),
    "ep2-misaligned": Shape(2, 1040, (31, 9), 31, misaligned=True),
    "ep2-many": Shape(2, 256, (1400, 900), 1400),  # several tokens per block: ids and weights copied in groups
}
FORMATS = [("fp8_block", False), ("mxfp8", False), ("mxfp8", True), ("nvfp4", False), ("nvfp4", True)]


def hidden_states(n: int, shape: Shape, gen: torch.Generator, device) -> torch.Tensor:
    """Rows of very different magnitudes, a row of zeros of both signs (the codes keep the sign), tiny
    (subnormal-scale) rows: every scale path."""
    x = torch.randn(n, shape.hidden, generator=gen) * torch.pow(10.0, torch.empty(n, 1).uniform_(-3, 3, generator=gen))
    if n > 2:
        x[1] = torch.where(torch.arange(shape.hidden) % 3 == 1, -0.0, 0.0)
        x[2] *= 1e-6
    x = x.to(shape.dtype)
    if not shape.misaligned:
        return x.to(device)
    flat = torch.empty(n * shape.hidden + 1, dtype=shape.dtype, device=device)
    out = flat[1:].view(n, shape.hidden)
    out.copy_(x)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("fmt,swizzled", FORMATS)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_quantizing_dispatch_matches_reference(fmt, swizzled, shape_name):
    shape = SHAPES[shape_name]
    wire = wire_format(fmt)
    gen = torch.Generator().manual_seed(torch.seed())
    num_experts, top_k = 8 * shape.ep_size, 4
    ids = [ref.random_topk_ids(n, top_k, num_experts, generator=gen, minus_one_frac=0.1) for n in shape.tokens]
    xs = [hidden_states(n, shape, gen, "cuda") for n in shape.tokens]
    global_scale = 448.0 * 6.0 / max(float(x.abs().max()) if x.numel() else 0.0 for x in xs)
    row = wire.dispatch_bytes_per_token(shape.hidden, shape.runtime_max, swizzled) + top_k * 4
    config = fa.WorkspaceConfig(ep_size=shape.ep_size, max_num_tokens=shape.runtime_max, dispatch_bytes_per_token=row,
                                combine_bytes_per_token=shape.hidden * 2, top_k=top_k)
    sim = SimulatedRanks(config, "cuda")
    scramble_(sim.workspace[:, metadata_offsets()["metadata_bytes"]:])
    gs = torch.tensor([global_scale], dtype=torch.float32, device="cuda") if fmt == "nvfp4" else None
    results = sim.dispatch([i.cuda() for i in ids], [[x, i.cuda()] for x, i in zip(xs, ids)], shape.runtime_max,
                           num_experts, quant_format=fmt, global_scale=gs, swizzled_scales=swizzled)
    torch.cuda.synchronize()

    expected = ref.reference_dispatch(ids, [[x.cpu(), i] for x, i in zip(xs, ids)], num_experts, shape.runtime_max)
    cols = wire.scale_cols(shape.hidden)
    for d, ((values, scales, recv_ids), counts) in enumerate(results):
        assert torch.equal(counts.cpu(), expected.recv_counts[d])
        assert values.dtype == wire.value_dtype and scales.dtype == wire.scale_dtype
        for src in range(shape.ep_size):
            n = int(expected.recv_counts[d][src])
            want_ids = expected.recv_payloads[d][1][src, :n]
            assert torch.equal(recv_ids[src, :n].cpu(), want_ids), f"ids {src}->{d}"
            want_values, want_scales = q.quantize(expected.recv_payloads[d][0][src, :n], fmt,
                                                  global_scale if fmt == "nvfp4" else None)
            assert same_bits(values[src, :n].cpu(), want_values), f"values {src}->{d}"
            if not swizzled:
                assert same_bits(scales[src, :n].cpu(), want_scales), f"scales {src}->{d}"
                continue
            padded_rows, padded_cols = -(-shape.runtime_max // 128) * 128, -(-cols // 4) * 4
            grid = q.unswizzle_scales_128x4(scales[src].cpu(), padded_rows, padded_cols)
            assert same_bits(grid[:n, :cols], want_scales), f"swizzled scales {src}->{d}"
            assert torch.all(grid[:n, cols:].view(torch.uint8) == 0), f"scale padding {src}->{d}"
    for r in range(shape.ep_size):
        fa.check_error(sim.workspace, r)


def test_quantizing_dispatch_errors_name_the_argument():
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=4096,
                                combine_bytes_per_token=512, top_k=4)
    sim = SimulatedRanks(config, "cuda")
    ids = torch.zeros(4, 4, dtype=torch.int32, device="cuda")
    x = torch.zeros(4, 256, dtype=torch.bfloat16, device="cuda")
    gs = torch.ones(1, device="cuda")
    call = lambda payloads, **kw: fa.dispatch(sim.workspace, 0, config, ids, payloads, 16, 8, **kw)  # noqa: E731
    with pytest.raises(TypeError, match=r"payloads\[0\] \(the hidden states to quantize\) must be"):
        call([x.float()], quant_format="fp8_block")
    with pytest.raises(ValueError, match="quant_format nvfp4 needs global_scale"):
        call([x], quant_format="nvfp4")
    with pytest.raises(ValueError, match="global_scale is only used by quant_format nvfp4"):
        call([x], quant_format="mxfp8", global_scale=gs)
    with pytest.raises(ValueError, match="swizzled_scales needs one-byte scales"):
        call([x], quant_format="fp8_block", swizzled_scales=True)
    with pytest.raises(ValueError, match="swizzled scales pad each source block to 128 rows"):
        call([torch.zeros(4, 3900, dtype=torch.bfloat16, device="cuda")], quant_format="mxfp8", swizzled_scales=True)
    with pytest.raises(ValueError, match="global_scale must be a float32 tensor of one element"):
        call([x], quant_format="nvfp4", global_scale=torch.ones(2, device="cuda"))
    torch.cuda.synchronize()
    assert int(sim.workspace[0, :8].view(torch.int32)[0]) == 0  # nothing ran: the dispatch epoch is still 0


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("ep_size,hidden,dtype", [(2, 7168, torch.bfloat16), (4, 2880, torch.float16),
                                                  (3, 136, torch.bfloat16)])
def test_fp8_wire_combine_matches_reference(ep_size, hidden, dtype, zero_copy):
    gen = torch.Generator().manual_seed(torch.seed())
    num_experts, top_k, runtime_max = 8 * ep_size, 6, 64
    tokens = [int(n) for n in torch.randint(0, runtime_max + 1, (ep_size,), generator=gen)]
    tokens[0] = runtime_max
    ids = [ref.random_topk_ids(n, top_k, num_experts, generator=gen) for n in tokens]
    config = fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=runtime_max, dispatch_bytes_per_token=top_k * 4,
                                combine_bytes_per_token=hidden * 2, top_k=top_k)
    sim = SimulatedRanks(config, "cuda")
    scramble_(sim.workspace[:, metadata_offsets()["metadata_bytes"]:])
    results = sim.dispatch([i.cuda() for i in ids], [[i.cuda()] for i in ids], runtime_max, num_experts)
    expected = ref.reference_dispatch(ids, [[i] for i in ids], num_experts, runtime_max)
    partials = []
    for d in range(ep_size):
        part = (torch.randn(ep_size, runtime_max, hidden, generator=gen) * 3).to(dtype)
        part[~ref.valid_row_mask(expected.recv_counts[d], runtime_max)] = float("nan")  # never read
        partials.append(part)
    want = q.reference_combine_fp8(partials, expected)
    if zero_copy:
        for d in range(ep_size):
            sim.combine_input(d, runtime_max, hidden, dtype).copy_(partials[d])
        inputs = None
    else:
        inputs = [p.cuda() for p in partials]
    got = sim.combine([c for _, c in results], tokens, runtime_max, inputs, hidden=hidden, dtype=dtype,
                      quant_format="fp8_block")
    torch.cuda.synchronize()
    bf16 = ref.reference_combine(partials, expected)
    for r in range(ep_size):
        assert same_bits(got[r].cpu(), want[r]), f"combine on rank {r}"
        if tokens[r]:
            err = float((got[r].cpu().float() - bf16[r].float()).norm() / bf16[r].float().norm())
            assert err < 0.03, f"rank {r}: relative L2 error {err:.4f} against the exact combine"
    for r in range(ep_size):
        fa.check_error(sim.workspace, r)
