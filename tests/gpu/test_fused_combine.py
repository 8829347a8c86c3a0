"""Simulated ranks (one GPU) run a zero-copy combine as one kernel while its grid, capped so that the waiting blocks
of every rank leave a multiprocessor free (and by the SM budget), can pull every item with at most 4 items a warp;
a larger one runs as the publish + pull pair. Both sum bitwise like the reference. The same over the FP8 wire, with
blocks of 8 to 16 warps and an item a warp. Each rank's dispatch takes an equal share of the multiprocessors by
default."""

from __future__ import annotations

import re

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import flashinfer_a2a as fa
import flashinfer_a2a.functional as F
from flashinfer_a2a.reference import bitwise_equal, reference_combine
from flashinfer_a2a.reference.quant import reference_combine_fp8
from flashinfer_a2a.testing.simulate import SimulatedRanks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

EP, EXPERTS, TOP_K, HIDDEN, MAX_TOKENS = 2, 8, 2, 1024, 512
DTYPE = torch.bfloat16


def _combine_kernels(tokens: int, gen: torch.Generator, num_sms: int = 0, hidden: int = HIDDEN,
                     dtype: torch.dtype = DTYPE, quant_format=None) -> set[str]:
    row = hidden * dtype.itemsize
    config = fa.WorkspaceConfig(ep_size=EP, max_num_tokens=MAX_TOKENS, dispatch_bytes_per_token=row + TOP_K * 4,
                                combine_bytes_per_token=row, top_k=TOP_K)
    sim = SimulatedRanks(config)
    ids = [torch.randint(0, EXPERTS, (tokens, TOP_K), generator=gen, dtype=torch.int32).cuda() for _ in range(EP)]
    xs = [torch.randn(tokens, hidden, generator=gen).to(dtype).cuda() for _ in range(EP)]
    received = sim.dispatch(ids, [[x, i] for x, i in zip(xs, ids)], tokens, EXPERTS)
    partials = [torch.randn(EP, tokens, hidden, generator=gen).to(dtype) for _ in range(EP)]
    for r in range(EP):  # fresh partials in every row, zero copy (quantized in place over the FP8 wire)
        sim.combine_input(r, tokens, hidden, dtype).copy_(partials[r])
    outs = [torch.full((tokens, hidden), float("nan"), dtype=dtype, device="cuda") for _ in range(EP)]
    counts = [c for _, c in received]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = sim.run(lambda r: F.combine(sim.workspace, r, config, counts[r], tokens, tokens, out=outs[r],
                                          num_sms=num_sms, quant_format=quant_format))
        torch.cuda.synchronize()
    partials = [p.cpu() for p in partials]
    reference = reference_combine_fp8 if quant_format else reference_combine
    expected = reference(partials, [i.cpu() for i in ids], EXPERTS)
    for r in range(EP):
        assert got[r].data_ptr() == outs[r].data_ptr()
        assert bitwise_equal(outs[r].cpu(), expected[r]), f"rank {r}"
        fa.check_error(sim.workspace, r)
    return {e.name for e in prof.events() if "Combine" in e.name}


# A token is 4 pulled items (1024 bf16 = 4 x 512 bytes). With a budget of N multiprocessors a rank's one-kernel
# combine has at most N blocks of 32 warps, each warp pulling up to 4 items: N * 32 tokens fit.
@pytest.mark.parametrize("tokens, num_sms, fused", [
    (4, 0, True),     # 2 blocks of 8 warps, an item each
    (200, 0, True),   # 800 items: the cap (every rank's blocks leave a multiprocessor free) is not reached
    (64, 2, True),    # 2 blocks of 32 warps, 4 items a warp
    (40, 3, True),    # 3 blocks of 32 warps, 1 or 2 items a warp
    (65, 2, False),   # 260 items > 2 x 32 x 4
    (300, 9, False),  # 1200 items > 9 x 32 x 4
])
def test_combine_runs_as_one_kernel_while_its_grid_fits(tokens, num_sms, fused):
    gen = torch.Generator().manual_seed(torch.seed())
    kernels = _combine_kernels(tokens, gen, num_sms)
    one = any("CombineFusedKernel" in k for k in kernels)
    two = any("CombinePublishKernel" in k for k in kernels) and any("CombinePullKernel" in k for k in kernels)
    assert (one, two) == (fused, not fused), kernels


def test_simulated_dispatch_takes_a_share_of_the_multiprocessors():
    config = fa.WorkspaceConfig(ep_size=4, max_num_tokens=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64,
                                top_k=1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert SimulatedRanks(config).dispatch_sms == sms // 4


# Rows of 2.5 KiB: a token is 5 items of 512 bytes, or 3 of 1 KiB whose last one ends half way. Wide (1 KiB) items
# are pulled where 512-byte ones would give some warp a second item in turn, in one kernel or in two.
@pytest.mark.parametrize("dtype, hidden", [(torch.bfloat16, 1280), (torch.float16, 1280), (torch.float32, 640)])
@pytest.mark.parametrize("tokens, num_sms, kernel, vectors", [
    (4, 0, "CombineFusedKernel", 1),    # 20 items, 3 blocks of 8 warps: one each
    (40, 2, "CombineFusedKernel", 2),   # 200 items, 2 blocks of 32 warps: 120 wide items instead
    (300, 2, "CombinePullKernel", 2),   # 1500 items > 2 x 32 x 4: two kernels, 16 blocks of 8 warps, wide
])
def test_pull_items_widen_only_where_warps_would_loop(dtype, hidden, tokens, num_sms, kernel, vectors):
    gen = torch.Generator().manual_seed(torch.seed())
    kernels = _combine_kernels(tokens, gen, num_sms, hidden, dtype)
    pulls = [re.search(rf"{kernel}<(.*)>", k) for k in kernels if kernel in k]
    # the last template argument: vectors a lane per item
    assert pulls and all(m and re.findall(r"\d+", m[1])[-1] == str(vectors) for m in pulls), kernels


# Over the FP8 wire a token is 2 pulled items (1024 elements = 2 x 512). One kernel (quantize, publish, pull) while
# blocks of at most 16 warps, at most one per multiprocessor of the cap (the budget, or the ranks' share of all but
# one), give every item a warp of its own; else the publish (which quantizes) + pull pair.
@pytest.mark.parametrize("tokens, num_sms, fused", [
    (1, 0, True),     # 2 items: one block
    (300, 0, True),   # 600 items: 60 blocks of 10 warps (the cap: 65 of an H100's 132), an item a warp
    (16, 2, True),    # 32 items: 2 blocks of 16 warps, an item a warp
    (17, 2, False),   # 34 items > 2 x 16
])
def test_fp8_wire_combine_runs_as_one_kernel_while_its_grid_fits(tokens, num_sms, fused):
    gen = torch.Generator().manual_seed(torch.seed())
    kernels = _combine_kernels(tokens, gen, num_sms, quant_format="fp8_block")
    one = any("CombineFusedFp8Kernel" in k for k in kernels)
    two = any("CombinePublishKernel" in k for k in kernels) and any("CombinePullFp8Kernel" in k for k in kernels)
    assert (one, two) == (fused, not fused), kernels
