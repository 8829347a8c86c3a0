"""Simulated ranks (one GPU) run a small zero-copy combine as one kernel, and a larger one, whose waiting blocks on
every rank would leave no multiprocessor free, as the publish + pull pair; both sum bitwise like the reference. Each
rank's dispatch takes an equal share of the multiprocessors by default."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import flashinfer_a2a as fa
import flashinfer_a2a.functional as F
from flashinfer_a2a.reference import bitwise_equal, reference_combine
from flashinfer_a2a.simulate import SimulatedRanks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

EP, EXPERTS, TOP_K, HIDDEN, MAX_TOKENS = 2, 8, 2, 1024, 512
DTYPE = torch.bfloat16


def _combine_kernels(tokens: int, gen: torch.Generator) -> set[str]:
    config = fa.WorkspaceConfig(ep_size=EP, max_num_tokens=MAX_TOKENS, dispatch_bytes_per_token=HIDDEN * 2 + TOP_K * 4,
                                combine_bytes_per_token=HIDDEN * 2, top_k=TOP_K)
    sim = SimulatedRanks(config)
    ids = [torch.randint(0, EXPERTS, (tokens, TOP_K), generator=gen, dtype=torch.int32).cuda() for _ in range(EP)]
    xs = [torch.randn(tokens, HIDDEN, generator=gen).to(DTYPE).cuda() for _ in range(EP)]
    received = sim.dispatch(ids, [[x, i] for x, i in zip(xs, ids)], tokens, EXPERTS)
    for r in range(EP):  # fresh partials in every row, zero copy
        sim.combine_input(r, tokens, HIDDEN, DTYPE).copy_(torch.randn(EP, tokens, HIDDEN, generator=gen).to(DTYPE))
    outs = [torch.full((tokens, HIDDEN), float("nan"), dtype=DTYPE, device="cuda") for _ in range(EP)]
    counts = [c for _, c in received]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = sim.run(lambda r: F.combine(sim.workspace, r, config, counts[r], tokens, tokens, out=outs[r]))
        torch.cuda.synchronize()
    partials = [sim.combine_input(r, tokens, HIDDEN, DTYPE) for r in range(EP)]
    expected = reference_combine([p.cpu() for p in partials], [i.cpu() for i in ids], EXPERTS)
    for r in range(EP):
        assert got[r].data_ptr() == outs[r].data_ptr()
        assert bitwise_equal(outs[r].cpu(), expected[r]), f"rank {r}"
        fa.check_error(sim.workspace, r)
    return {e.name for e in prof.events() if "Combine" in e.name}


def test_small_pull_runs_as_one_kernel_and_a_large_one_as_two():
    gen = torch.Generator().manual_seed(torch.seed())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    small = _combine_kernels(4, gen)  # 4 tokens x 4 pieces: 2 blocks a rank
    assert any("CombineFusedKernel" in k for k in small), small
    assert not any("CombinePullKernel" in k or "CombinePublishKernel" in k for k in small), small
    # 4 pieces a token, 8 warps a block: tokens / 2 blocks a rank; EP ranks of them must fill every multiprocessor
    large_tokens = min(MAX_TOKENS, sms // EP * 2 + 2)
    large = _combine_kernels(large_tokens, gen)
    assert any("CombinePublishKernel" in k for k in large) and any("CombinePullKernel" in k for k in large), large
    assert not any("CombineFusedKernel" in k for k in large), large


def test_simulated_dispatch_takes_a_share_of_the_multiprocessors():
    config = fa.WorkspaceConfig(ep_size=4, max_num_tokens=8, dispatch_bytes_per_token=64, combine_bytes_per_token=64,
                                top_k=1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert SimulatedRanks(config).dispatch_sms == sms // 4
