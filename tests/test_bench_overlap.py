"""The benchmark's SM-budget rows and its dual-batch overlap study on the CPU: flags, row names, the loops' order,
the experts stage against a loop over its pairs, the table."""

import pytest

from flashinfer_a2a.bench import args as bench_args
from flashinfer_a2a.bench.impls import Variant, variants
import torch

from flashinfer_a2a.bench.experts import (DENSE_N, INTERMEDIATE, KEY_LIMIT, ExpertStage, ExpertWeights,
                                          grouped_mm_works, local_experts)
from flashinfer_a2a.bench.overlap import LOOPS, _loops, format_overlap_table, gemm_carveout, relate_budgets
from flashinfer_a2a.reference import rank_expert_range


def test_num_sms_and_overlap_flags():
    a = bench_args.parse_args([])
    assert (a.num_sms, a.overlap) == ((), False)
    a = bench_args.parse_args(["--num-sms", "8,16", "4", "8", "--overlap"])
    assert (a.num_sms, a.overlap) == ((8, 16, 4), True)


@pytest.mark.parametrize("value", ["0", "-2", "x"])
def test_num_sms_must_be_positive(value, capsys):
    with pytest.raises(SystemExit):
        bench_args.parse_args(["--num-sms", value])
    assert "--num-sms" in capsys.readouterr().err


def test_budget_rows_follow_the_whole_gpu_row():
    a = bench_args.parse_args(["--num-sms", "4,16", "--quant", "none"])
    names = [v.name for v in variants(a, bench_args.DTYPES["bf16"], simulated=True)]
    assert names == ["a2a", "a2a-sm4", "a2a-sm16"]
    assert Variant("fused", "fp8_block", 8).name == "fp8-fused-sm8"


def test_overlap_loops_call_in_dual_batch_order():
    seen = []
    calls = [{name: (lambda m=m, name=name: seen.append(f"{name} {'AB'[m]}"))
              for name in ("dispatch", "combine", "dispatch_send", "dispatch_recv", "combine_send", "combine_recv")}
             for m in range(2)]
    loops = _loops(calls[0], calls[1], lambda: seen.append("stage A"), lambda: seen.append("stage B"))
    assert tuple(loops) == LOOPS == ("a2a", "compute", "serial", "interleaved")
    loops["interleaved"]()
    # Each stage runs while the other micro-batch's transfer is in flight: between its send and its receive.
    assert seen == ["dispatch_send A", "dispatch_send B", "dispatch_recv A", "stage A", "combine_send A",
                    "dispatch_recv B", "stage B", "combine_send B", "combine_recv A", "combine_recv B"]
    seen.clear()
    loops["serial"]()
    assert seen == ["dispatch A", "stage A", "combine A", "dispatch B", "stage B", "combine B"]
    seen.clear()
    loops["a2a"](), loops["compute"]()
    assert seen == ["dispatch A", "combine A", "dispatch B", "combine B", "stage A", "stage B"]


@pytest.mark.parametrize("ep_size, num_experts, want", [(4, 256, 8), (2, 256, 16), (8, 256, 4), (2, 8, 4),
                                                        (64, 256, 1)])
def test_expert_groups_per_rank(ep_size, num_experts, want):
    assert local_experts(num_experts, ep_size) == want


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("num_experts", [8, 64])
def test_experts_stage_equals_a_loop_over_its_pairs(grouped, num_experts):
    """Rank 1 of 2, its routed experts each a group of its own (8 experts) or folded in pairs (64): every (valid row, slot of this rank's experts) pair through
    its group's MLP, weighted, summed into the row; rows past the counts and rows of no pair are zero."""
    if grouped and not grouped_mm_works(torch.device("cpu")):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    gen = torch.Generator().manual_seed(5)
    ep_size, runtime_max, top_k, hidden, rank = 2, 6, 3, 64, 1
    x = torch.randn(ep_size, runtime_max, hidden, generator=gen).to(torch.bfloat16)
    ids = torch.randint(-1, num_experts, (ep_size, runtime_max, top_k), generator=gen, dtype=torch.int32)
    weights = torch.rand(ep_size, runtime_max, top_k, generator=gen)
    counts = torch.tensor([6, 4], dtype=torch.int32)
    out = torch.full((ep_size, runtime_max, hidden), float("nan")).to(torch.bfloat16)
    groups = local_experts(num_experts, ep_size)
    experts = ExpertWeights.random(groups, hidden, torch.device("cpu"), 0)
    stage = ExpertStage(x, ids, weights, counts, out, rank, num_experts, experts, grouped)
    lo, hi = rank_expert_range(rank, num_experts, ep_size)
    want = torch.zeros(ep_size, runtime_max, hidden)
    pairs = 0
    for src in range(ep_size):
        for i in range(int(counts[src])):
            for k in range(top_k):
                e = int(ids[src, i, k])
                if lo <= e < hi:
                    pairs += 1
                    g = (e - lo) * groups // (hi - lo)
                    h = x[src, i].float() @ experts.gate_up[g].float().t()
                    act = torch.nn.functional.silu(h[:INTERMEDIATE]) * h[INTERMEDIATE:]
                    want[src, i] += weights[src, i, k] * (act @ experts.down[g].float().t())
    assert stage.pairs == pairs > 0
    for _ in range(2):  # a step rewrites the whole input
        stage()
        assert torch.allclose(out.float(), want, rtol=2e-2, atol=3e-2)


def test_experts_stage_refuses_more_groups_than_its_keys_hold():
    ep_size, runtime_max, top_k, hidden = 2, 4, 2, 8
    x = torch.zeros(ep_size, runtime_max, hidden, dtype=torch.bfloat16)
    ids = torch.zeros(ep_size, runtime_max, top_k, dtype=torch.int32)
    weights = torch.ones(ep_size, runtime_max, top_k)
    counts = torch.tensor([runtime_max, runtime_max], dtype=torch.int32)
    groups = KEY_LIMIT
    experts = ExpertWeights(torch.empty(groups, 2 * INTERMEDIATE, hidden, dtype=torch.bfloat16),
                            torch.empty(groups, hidden, INTERMEDIATE, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=f"{groups} expert groups.*fewer than {KEY_LIMIT}"):
        ExpertStage(x, ids, weights, counts, x.clone(), 0, 512, experts, grouped=False)


def test_gemm_carveout_is_restored():
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    with gemm_carveout(0) as carved:
        assert carved is False
    if setter is None:
        pytest.skip("this torch has no SM carve-out")
    before = torch._C._get_sm_carveout_experimental()
    with gemm_carveout(16) as carved:
        assert carved and torch._C._get_sm_carveout_experimental() == 16
    assert torch._C._get_sm_carveout_experimental() == before


def _times(a2a, compute, serial, interleaved):
    return {"a2a": a2a, "compute": compute, "serial": serial, "interleaved": interleaved,
            "interleaved_over_max": interleaved / max(a2a, compute),
            "interleaved_over_sum": interleaved / (a2a + compute)}


def test_overlap_table():
    meta = {"model": "deepseek-v3", "shape": {"hidden": 7168, "num_experts": 256, "top_k": 8}, "ep_size": 2,
            "launcher": "simulated", "gpu": "H200"}
    common = {"tokens": 128, "dtype": "bf16", "local_experts": 16, "experts_gemm": "torch._grouped_mm"}
    records = [dict(common, num_sms=0, stage="experts", modes={"graph": _times(40.0, 300.0, 340.0, 320.0)}),
               dict(common, num_sms=0, stage="dense", modes={"graph": _times(40.0, 30.0, 75.0, 46.0)}),
               dict(common, num_sms=16, stage="experts", gemm_carveout=True,
                    modes={"graph": _times(44.0, 300.0, 344.0, 310.0)})]
    relate_budgets(records)
    assert "a2a_over_whole" not in records[0]["modes"]["graph"]
    assert records[2]["modes"]["graph"]["a2a_over_whole"] == pytest.approx(1.1)
    lines = format_overlap_table(meta, records).splitlines()
    assert "16 expert groups per rank (32 over all ranks)" in lines[1] and "torch._grouped_mm" in lines[1]
    assert f"[{INTERMEDIATE}, 7168]" in lines[1] and f"[7168, {DENSE_N}]" in lines[1]
    assert "leave its multiprocessors free" in lines[2]
    assert lines[4].split() == ["tokens", "dtype", "num_sms", "stage", "mode", "|", "a2a", "compute", "serial",
                                "interlv", "|", "ilv/max", "ilv/sum", "a2a/whole"]
    assert lines[5].split() == ["128", "bf16", "all", "experts", "graph", "|", "40.0", "300.0", "340.0", "320.0",
                                "|", "1.07", "0.94", "-"]
    assert lines[6].split()[3] == "dense" and lines[6].split()[-3:] == ["1.15", "0.66", "-"]
    assert lines[7].split()[2] == "16" and lines[7].split()[-1] == "1.10"


def test_gemm_carveout_is_opt_in(capsys):
    parse_args = bench_args.parse_args
    assert not parse_args(["--overlap", "--num-sms", "16"]).gemm_carveout
    assert parse_args(["--overlap", "--num-sms", "16", "--gemm-carveout"]).gemm_carveout
    for argv in (["--overlap", "--gemm-carveout"], ["--num-sms", "16", "--gemm-carveout"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert "--gemm-carveout goes with --overlap and --num-sms" in capsys.readouterr().err
