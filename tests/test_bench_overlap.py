"""The benchmark's SM-budget rows and its dual-batch overlap study on the CPU: flags, row names, the table."""

import pytest

from flashinfer_a2a.bench import args as bench_args
from flashinfer_a2a.bench.impls import Variant, variants
from flashinfer_a2a.bench.overlap import GEMM_N, LOOPS, _loops, format_overlap_table


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
    loops = _loops(calls[0], calls[1], lambda: seen.append("gemm A"), lambda: seen.append("gemm B"))
    assert tuple(loops) == LOOPS
    loops["overlap"]()
    # Each GEMM runs while the other micro-batch's transfer is in flight: between its send and its receive.
    assert seen == ["dispatch_send A", "dispatch_send B", "dispatch_recv A", "gemm A", "combine_send A",
                    "dispatch_recv B", "gemm B", "combine_send B", "combine_recv A", "combine_recv B"]
    seen.clear()
    loops["serial"]()
    assert seen == ["dispatch A", "gemm A", "combine A", "dispatch B", "gemm B", "combine B"]


def test_overlap_table():
    meta = {"model": "deepseek-v3", "shape": {"hidden": 7168, "num_experts": 256, "top_k": 8}, "ep_size": 2,
            "launcher": "simulated", "gpu": "H200"}
    times = {"a2a": 40.0, "gemm": 30.0, "serial": 75.0, "overlap": 46.0}
    times.update(overlap_over_sum=46 / 70, overlap_over_max=46 / 40)
    table = format_overlap_table(meta, [{"tokens": 128, "dtype": "bf16", "num_sms": 0, "modes": {"graph": times}},
                                        {"tokens": 128, "dtype": "bf16", "num_sms": 8, "modes": {"graph": times}}])
    lines = table.splitlines()
    assert f"[hidden, {GEMM_N}]" in lines[0]
    assert lines[-2].split() == ["128", "bf16", "all", "graph", "|", "40.0", "30.0", "75.0", "46.0", "|", "0.66",
                                 "1.15"]
    assert lines[-1].split()[2] == "8"
