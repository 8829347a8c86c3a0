"""The standalone CUDA programs behind figures in the docs (docs/measurements/*.cu) still compile for sm_90a and
sm_100a, so that the commands the docs give reproduce them."""

import pathlib
import shutil
import subprocess

import pytest

PROBES = sorted((pathlib.Path(__file__).resolve().parents[1] / "docs" / "measurements").glob("*.cu"))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("probe", PROBES, ids=[p.stem for p in PROBES])
def test_measurement_probe_compiles(probe, tmp_path):
    binary = tmp_path / probe.stem
    cmd = ["nvcc", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
           "-gencode=arch=compute_100a,code=sm_100a", "-o", str(binary), str(probe)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert binary.stat().st_size > 0
