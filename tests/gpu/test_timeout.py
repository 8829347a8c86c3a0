"""A rank that never dispatches: the others return within the timeout, the error names it, re-init recovers."""

import time

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref

from flashinfer_a2a.library.errors import metadata_offsets

from .cases import Case, run_case


def test_missing_rank_times_out_and_recovers():
    case = Case(4, 4, 1024, 16, [64, 64, 64, 64], 64)
    sim = run_case(case)  # a healthy round first
    gen = torch.Generator().manual_seed(torch.seed())
    ids = [ref.random_topk_ids(64, 4, 16, generator=gen).cuda() for _ in range(4)]
    hidden = [torch.randn(64, 1024, generator=gen).to(torch.bfloat16).cuda() for _ in range(4)]
    start = time.monotonic()
    results = sim.run(lambda r: fa.dispatch(sim.workspace, r, sim.config, ids[r], [hidden[r]], 64, 16,
                                            timeout_s=0.5), ranks=[0, 1, 2])
    torch.cuda.synchronize()
    elapsed = time.monotonic() - start
    assert elapsed < 5.0
    for r, (_, counts) in zip((0, 1, 2), results):
        with pytest.raises(fa.A2AError, match="timed out waiting for rank 3") as info:
            fa.check_error(sim.workspace, r)
        assert info.value.peer == 3 and info.value.phase == "dispatch"
        assert int(counts.cpu()[3]) == 0
    # The next call on a failed workspace does nothing and returns at once instead of waiting again.
    start = time.monotonic()
    sim.run(lambda r: fa.dispatch(sim.workspace, r, sim.config, ids[r], [hidden[r]], 64, 16, timeout_s=0.5),
            ranks=[0])
    torch.cuda.synchronize()
    assert time.monotonic() - start < 0.4
    sim.initialize()
    torch.cuda.synchronize()
    run_case(case, sim=sim)


def test_runtime_max_mismatch_is_reported():
    sim = run_case(Case(2, 2, 256, 4, [8, 8], 16))
    ids = [ref.random_topk_ids(8, 2, 4).cuda() for _ in range(2)]
    hidden = [torch.randn(8, 256).to(torch.bfloat16).cuda() for _ in range(2)]
    sim.run(lambda r: fa.dispatch(sim.workspace, r, sim.config, ids[r], [hidden[r]], 16 if r == 0 else 12, 4,
                                  timeout_s=2.0))
    torch.cuda.synchronize()
    with pytest.raises(fa.A2AError, match="runtime_max_tokens_per_rank=12"):
        fa.check_error(sim.workspace, 0)


def test_invalid_expert_id_is_reported_not_routed():
    sim = run_case(Case(2, 2, 256, 4, [8, 8], 16))
    ids = [torch.zeros(8, 2, dtype=torch.int32, device="cuda") for _ in range(2)]
    ids[1][3, 1] = 4  # num_experts is 4
    hidden = [torch.randn(8, 256).to(torch.bfloat16).cuda() for _ in range(2)]
    results = sim.run(lambda r: fa.dispatch(sim.workspace, r, sim.config, ids[r], [hidden[r]], 16, 4))
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="flat index 7"):
        fa.check_error(sim.workspace, 1)
    fa.check_error(sim.workspace, 0)
    assert results[0][1].cpu().tolist() == [8, 8]  # expert 0 is on rank 0; the bad id went nowhere


def test_combine_without_dispatch_reads_nothing_outside_the_workspace():
    from .cases import scramble_

    sim = run_case(Case(2, 2, 256, 4, [8, 8], 16))
    sim.initialize()
    scramble_(sim.workspace[:, metadata_offsets()["metadata_bytes"] :])  # as a fresh allocation might hold
    counts = [torch.full((2,), 8, dtype=torch.int32, device="cuda") for _ in range(2)]
    outs = sim.run(lambda r: fa.combine(sim.workspace, r, sim.config, counts[r], 8, 16, hidden=256,
                                        dtype=torch.bfloat16, timeout_s=2.0))
    torch.cuda.synchronize()
    assert all(o.shape == (8, 256) for o in outs)


def test_debug_mode_with_simulated_ranks(monkeypatch):
    monkeypatch.setenv("FLASHINFER_A2A_DEBUG", "1")
    sim = run_case(Case(4, 4, 512, 16, [32, 0, 32, 7], 32))  # checks every rank once all are launched
    ids = [ref.random_topk_ids(8, 4, 16).cuda() for _ in range(4)]
    ids[2][0, 0] = 16
    hidden = [torch.randn(8, 512).to(torch.bfloat16).cuda() for _ in range(4)]
    with pytest.raises(ValueError, match="expert id 16"):  # the host check, before any launch
        sim.run(lambda r: fa.dispatch(sim.workspace, r, sim.config, ids[r], [hidden[r]], 32, 16), ranks=[2])
