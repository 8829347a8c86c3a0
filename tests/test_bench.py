"""The benchmark CLI on the CPU: argument parsing, the byte counting against hand computations, the statistics,
the outputs, and the message without a GPU. (The timed runs themselves need GPUs: see docs/benchmarks.md.)"""

import json
import os
import subprocess
import sys

import pytest
import torch

from flashinfer_a2a.bench import args as bench_args
from flashinfer_a2a.bench import timing
from flashinfer_a2a.bench.impls import Variant, combine_row_bytes, dispatch_row_bytes, variants
from flashinfer_a2a.bench.main import failed_rows
from flashinfer_a2a.bench.report import add_derived, format_table, write_json, write_plot
from flashinfer_a2a.bench.timing import summarize
from flashinfer_a2a.bench.traffic import count_rows, gbps


def test_defaults_are_deepseek_v3_at_four_token_counts():
    a = bench_args.parse_args([])
    assert (a.model, a.shape) == ("deepseek-v3", bench_args.ModelShape(7168, 256, 8))
    assert a.tokens == (1, 128, 1024, 8192)
    assert (a.dtypes, a.routings, a.modes) == (("bf16",), ("uniform",), ("graph", "eager"))
    assert (a.iters, a.warmup, a.baselines, a.routing_payloads) == (1000, 20, True, True)
    assert a.pair_group == timing.GRAPH_PAIR_GROUP == 25
    assert bench_args.parse_args(["--pair-group", "1"]).pair_group == 1


@pytest.mark.parametrize("model,shape", [("qwen3", (4096, 128, 8)), ("gpt-oss", (2880, 128, 4)),
                                         ("mixtral", (4096, 8, 2))])
def test_presets(model, shape):
    a = bench_args.parse_args(["--model", model])
    assert (a.model, (a.shape.hidden, a.shape.num_experts, a.shape.top_k)) == (model, shape)


def test_lists_overrides_and_flags():
    a = bench_args.parse_args(["--tokens", "1,2", "4", "2", "--dtype", "bf16,fp32", "--routing", "skewed",
                               "uniform", "--hidden", "1000", "--top-k", "4", "--mode", "graph", "--iters", "50",
                               "--no-baselines", "--hidden-only", "--output-dir", "out", "--sim-ranks", "8"])
    assert a.tokens == (1, 2, 4)  # order kept, repeats dropped
    assert a.dtypes == ("bf16", "fp32") and a.routings == ("skewed", "uniform") and a.modes == ("graph",)
    assert (a.model, a.shape) == ("custom", bench_args.ModelShape(1000, 256, 4))
    assert (a.iters, a.baselines, a.routing_payloads, a.output_dir, a.sim_ranks) == (50, False, False, "out", 8)


@pytest.mark.parametrize("argv,message", [
    (["--tokens", "0"], "--tokens: expected a positive integer, got 0"),
    (["--tokens", "x"], "expected a positive integer, got 'x'"),
    (["--dtype", "int8"], "'int8' is not one of bf16, fp16, fp32"),
    (["--routing", "zipf"], "'zipf' is not one of uniform, skewed"),
    (["--model", "llama"], "invalid choice: 'llama'"),
    (["--top-k", "33"], "--top-k must be at most 32"),
    (["--model", "mixtral", "--top-k", "9"], "--top-k (9) must not exceed --num-experts (8)"),
    (["--sim-ranks", "73"], "--sim-ranks must be at most 72"),
    (["--skew", "-1"], "--skew must be >= 0"),
    (["--pair-group", "0"], "argument --pair-group: expected a positive integer, got 0"),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_args.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_byte_counting_by_hand():
    # 4 experts on 2 ranks: experts 0-1 on rank 0, 2-3 on rank 1.
    rank0 = torch.tensor([[0, 1], [0, 2], [3, -1]], dtype=torch.int32)  # -> {0}, {0, 1}, {1}
    rank1 = torch.tensor([[2, 3], [1, -1]], dtype=torch.int32)  # -> {1}, {0}
    traffic = count_rows([rank0, rank1], num_experts=4)
    assert traffic.remote_rows == (2, 1) and traffic.logical_rows == (4, 2)
    assert traffic.mean_bytes(10) == {"remote": 15.0, "logical": 30.0}
    assert gbps(1e9, 1e6) == 1.0 and gbps(355e3, 1.0) == 355.0


def test_dispatch_row_bytes_count_ids_and_weights():
    a = bench_args.parse_args([])
    assert dispatch_row_bytes(a, torch.bfloat16) == 7168 * 2 + 8 * (4 + 4)
    assert dispatch_row_bytes(bench_args.parse_args(["--hidden-only"]), torch.float32) == 7168 * 4


def test_quant_formats_and_their_row_bytes():
    a = bench_args.parse_args([])
    assert a.quant_formats == ("fp8_block", "mxfp8", "nvfp4")
    assert bench_args.parse_args(["--quant", "none"]).quant_formats == ()
    assert bench_args.parse_args(["--quant", "nvfp4,fp8_block"]).quant_formats == ("nvfp4", "fp8_block")
    names = [v.name for v in variants(a, torch.bfloat16)]
    assert names == ["a2a", "a2a-pull", "fp8-fused", "fp8-pre", "mxfp8-fused", "mxfp8-pre", "nvfp4-fused",
                     "nvfp4-pre"]
    assert [v.name for v in variants(a, torch.float32)] == ["a2a", "a2a-pull"]  # quantization takes bf16|fp16
    assert [v.name for v in variants(a, torch.float32, simulated=True)] == ["a2a"]  # simulated ranks always pull
    ids_weights = 8 * (4 + 4)
    # FP8: 7168 values + 56 fp32 scales; MXFP8: 7168 + 224 UE8M0; NVFP4: 3584 packed + 448 UE4M3.
    assert dispatch_row_bytes(a, torch.bfloat16, Variant("pre", "fp8_block")) == 7168 + 56 * 4 + ids_weights
    assert dispatch_row_bytes(a, torch.bfloat16, Variant("fused", "mxfp8")) == 7168 + 224 + ids_weights
    assert dispatch_row_bytes(a, torch.bfloat16, Variant("fused", "nvfp4")) == 3584 + 448 + ids_weights
    assert combine_row_bytes(a, torch.bfloat16, Variant("fused", "nvfp4")) == 7168 + 56 * 4  # the FP8 wire
    assert combine_row_bytes(a, torch.bfloat16, Variant("pre", "nvfp4")) == 7168 * 2
    assert combine_row_bytes(a, torch.bfloat16, Variant("pull")) == 7168 * 2


def test_summarize_by_hand():
    # 2 ranks x 4 iterations x (dispatch, combine)
    gpu = torch.tensor([[[1, 2], [1, 2], [1, 2], [9, 2]],
                        [[2, 1], [3, 1], [2, 1], [2, 1]]], dtype=torch.float64)
    stats = summarize(gpu)
    assert stats["dispatch"]["max_rank"] == 2.0  # slowest per iteration: 2, 3, 2, 9 -> lower median 2
    assert stats["dispatch"]["max"] == 9.0 and stats["dispatch"]["over_2x"] == 1
    assert stats["combine"]["median"] == 1.0 and stats["combine"]["max_rank"] == 2.0
    assert stats["pair"]["max_rank"] == 3.0  # pairs: rank 0 3,3,3,11; rank 1 3,4,3,3 -> slowest 3,4,3,11
    assert stats["pair"]["p99"] == pytest.approx(11 - 0.03 * 7)  # linear interpolation between 4 and 11
    pair = torch.tensor([[5.0, 5.0, 5.0, 5.0], [6.0, 6.0, 6.0, 6.0]], dtype=torch.float64)
    assert summarize(gpu, pair)["pair"]["max_rank"] == 6.0  # a separately timed pair replaces the sum


def _case():
    stats = {phase: {"median": 10.0, "max_rank": 20.0, "p99": 25.0, "max": 30.0, "over_2x": 0}
             for phase in ("dispatch", "combine", "pair")}
    nccl = {phase: dict(s, max_rank=s["max_rank"] * 3) for phase, s in stats.items()}
    case = {"tokens": 128, "dtype": "bf16", "routing": "uniform",
            "bytes": {"dispatch": {"remote": 2e6, "logical": 4e6}, "combine": {"remote": 1e6, "logical": 2e6}},
            "impls": {"a2a": {"graph": stats, "eager": dict(stats, host_us={"dispatch": 5.0, "combine": 4.0})},
                      "nccl_a2a": {"graph": nccl, "eager": {"error": "eager run failed: boom"}}}}
    add_derived(case)
    return case


def test_derived_columns():
    case = _case()
    assert case["impls"]["a2a"]["graph"]["gbps"]["dispatch"] == {"remote": 100.0, "logical": 200.0}
    assert case["summary"] == {"pair_speedup_vs_nccl_a2a_graph": 3.0, "eager_overhead_us_per_call": 0.0}


def test_default_over_pulled_combine():
    case = _case()
    pulled = {p: dict(s, max_rank=s["max_rank"] * (1.25 if p == "combine" else 1))
              for p, s in case["impls"]["a2a"]["graph"].items() if p in ("dispatch", "combine", "pair")}
    case["impls"]["a2a-pull"] = {"graph": pulled}
    add_derived(case)
    assert case["summary"]["combine_speedup_vs_pulled_graph"] == 1.25  # 25 us pulled against 20 us by default
    assert "combine_speedup_vs_pulled_eager" not in case["summary"]  # no eager a2a-pull row


def test_derived_columns_of_the_quantized_rows():
    case = _case()
    fused = {p: dict(s, max_rank=s["max_rank"] / 2) for p, s in case["impls"]["a2a"]["graph"].items()
             if p in ("dispatch", "combine", "pair")}
    pre = {p: dict(s, max_rank=s["max_rank"] / 2) for p, s in fused.items()}
    nvfp4 = {p: dict(s, max_rank=s["max_rank"] * 4) for p, s in fused.items()}  # twice the bf16 times
    case["impls"].update({"fp8-fused": {"graph": fused}, "fp8-pre": {"graph": pre}, "nvfp4-fused": {"graph": nvfp4}})
    case["impl_bytes"] = {"fp8-fused": {"dispatch": {"remote": 1e6, "logical": 2e6},
                                        "combine": {"remote": 5e5, "logical": 1e6}}}
    add_derived(case)
    assert case["impls"]["fp8-fused"]["graph"]["gbps"]["dispatch"] == {"remote": 100.0, "logical": 200.0}
    assert case["impls"]["fp8-pre"]["graph"]["gbps"]["dispatch"]["remote"] == 400.0  # the case's bytes
    assert case["summary"]["fp8-fused_dispatch_over_pre_graph"] == 2.0
    assert case["summary"]["fp8-fused_combine_speedup_graph"] == 2.0
    assert case["summary"]["nvfp4-fused_combine_speedup_graph"] == 0.5  # each fused row its own
    assert "nvfp4-fused_dispatch_over_pre_graph" not in case["summary"]  # no nvfp4-pre row


def test_table_json_and_plot(tmp_path):
    meta = {"model": "deepseek-v3", "shape": {"hidden": 7168, "num_experts": 256, "top_k": 8}, "ep_size": 2,
            "launcher": "torchrun", "gpu": "test GPU", "iters": 4, "warmup": 1}
    cases = [_case()]
    table = format_table(meta, cases)
    assert "eager run failed: boom" in table and "pair_speedup_vs_nccl_a2a_graph 3.00" in table
    assert "a graph pair sample" not in table
    grouped = format_table({**meta, "args": {"pair_group": 25}}, cases)
    assert "a graph pair sample is the mean of 25 iterations" in grouped
    assert "100.0" in table  # the dispatch GB/s
    write_json(tmp_path / "r.json", meta, cases)
    assert json.loads((tmp_path / "r.json").read_text())["cases"][0]["tokens"] == 128
    assert write_plot(str(tmp_path / "r.png"), meta, cases) is None
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eager_only_rows_write_no_plot(tmp_path):
    """With no graph-mode row (--mode eager) there is nothing to plot: a reason, not an exception."""
    meta = {"model": "deepseek-v3", "shape": {"hidden": 7168, "num_experts": 256, "top_k": 8}, "ep_size": 2,
            "gpu": "test GPU"}
    case = _case()
    for modes in case["impls"].values():
        modes.pop("graph")
    why_not = write_plot(str(tmp_path / "r.png"), meta, [case])
    assert why_not is not None and "no CUDA-graph rows" in why_not
    assert not (tmp_path / "r.png").exists()


def test_failed_rows_are_listed():
    case = _case()
    assert failed_rows([case]) == ["128 nccl_a2a eager: eager run failed: boom"]
    case["impls"]["nccl_a2a"]["eager"] = case["impls"]["a2a"]["eager"]
    assert failed_rows([case]) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_so_and_exits_nonzero(tmp_path):
    run = subprocess.run([sys.executable, "-m", "flashinfer_a2a.bench", "--output-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 1
    assert "needs an NVIDIA GPU" in run.stderr and "sees none" in run.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_launcher_detection():
    from flashinfer_a2a.bench.session import launched_world_size

    assert launched_world_size({}) == 1
    assert launched_world_size({"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}) == 4
    assert launched_world_size({"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "3"}) == 8


class _FakeEvent:
    """Stands in for a CUDA event in the graph-mode layout: its time is set as if the iterations had run."""

    def __init__(self):
        self.us = None

    def elapsed_time(self, later: "_FakeEvent") -> float:  # ms, like torch.cuda.Event
        return (later.us - self.us) / 1e3


def test_grouped_pair_samples_are_group_means():
    warmup, iters, group = timing.whole_groups(7, 5), timing.whole_groups(23, 5), 5
    assert (warmup, iters) == (10, 25)
    total = warmup + iters
    steps = torch.rand(total, dtype=torch.float64) * 10 + 1  # us per iteration
    starts = torch.cat([torch.zeros(1, dtype=torch.float64), steps.cumsum(0)])
    ranks = [timing._rank_events(total, group, 1, _FakeEvent) for _ in range(2)]
    for events in ranks:
        assert [len(e) for e in events] == [1 if i % group == 0 else 0 for i in range(total)] + [1]
        for i, iteration in enumerate(events[:total]):
            for ev in iteration:
                ev.us = float(starts[i])
        events[total][0].us = float(starts[total])
    samples = timing._elapsed(ranks, warmup // group) / group
    assert samples.shape == (2, iters // group, 1)
    expected = steps[warmup:].view(-1, group).mean(1)
    torch.testing.assert_close(samples[0, :, 0], expected)
    torch.testing.assert_close(samples[1, :, 0], expected)


def test_groups_are_for_whole_pairs_only():
    with pytest.raises(ValueError, match="group=2"):
        timing.time_loop([], 10, 0, graph=True, barrier=lambda: None, split=True, group=2)
    with pytest.raises(ValueError, match="group=0"):
        timing.time_loop([], 10, 0, graph=True, barrier=lambda: None, split=False, group=0)
