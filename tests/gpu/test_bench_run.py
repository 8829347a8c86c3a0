"""``python -m flashinfer_a2a.bench`` end to end on one GPU (simulated ranks, the README's main job there): every row
of ours sets up and runs in both modes, over every wire format, and the exit status says so."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

OURS = ("a2a", "fp8-fused", "fp8-pre", "nvfp4-fused", "nvfp4-pre")


def _bench(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "flashinfer_a2a.bench", "--sim-ranks", "2", "--tokens", "1", "16",
                          "--iters", "4", "--warmup", "2", "--quiet", "--output-dir", str(out), *args],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else {}
    return run, results


def test_simulated_ranks_time_every_row(tmp_path):
    run, results = _bench(tmp_path, "--quant", "fp8_block", "nvfp4")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [case["tokens"] for case in results["cases"]] == [1, 16]
    for case in results["cases"]:
        for impl in OURS:
            for mode in ("graph", "eager"):
                stats = case["impls"][impl][mode]
                assert "error" not in stats, (case["tokens"], impl, mode, stats)
                assert 0 < stats["pair"]["median"] <= stats["pair"]["max"], (case["tokens"], impl, mode)
    assert (tmp_path / "out" / "results.png").exists() or "no plot: matplotlib" in run.stdout


def test_eager_only_run_succeeds_without_a_plot(tmp_path):
    run, results = _bench(tmp_path, "--mode", "eager", "--quant", "none")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert all("error" not in case["impls"]["a2a"]["eager"] for case in results["cases"])
    assert not (tmp_path / "out" / "results.png").exists()
