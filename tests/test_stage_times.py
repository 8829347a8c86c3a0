"""docs/measurements/stage_times.py on CPU: its stamps still find their places in the kernels (they would otherwise
refuse to run on the GPU), the stamped sources compile for sm_90a, and the stamped copy is what its run builds and
loads, whatever prebuilt library the environment names."""

import importlib.util
import pathlib
import shutil
import subprocess

import pytest

from flashinfer_a2a.jit import toolchain

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "docs" / "measurements" / "stage_times.py"


@pytest.fixture(scope="module")
def stage_times():
    spec = importlib.util.spec_from_file_location("stage_times_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stamps_find_their_places_and_prebuilt_libraries_stay_behind(stage_times, tmp_path, monkeypatch):
    source = tmp_path / "source"
    for part in ("flashinfer_a2a", "include", "csrc"):
        shutil.copytree(ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__", "_aot"))
    (source / "flashinfer_a2a" / "_aot" / "flashinfer_a2a_ops").mkdir(parents=True)
    (source / "flashinfer_a2a" / "_aot" / "flashinfer_a2a_ops" / "flashinfer_a2a_ops.so").write_bytes(b"prebuilt")
    monkeypatch.setattr(stage_times, "ROOT", source)
    copy = tmp_path / "copy"
    stage_times.stamped_copy(copy)
    assert not (copy / "flashinfer_a2a" / "_aot").exists()
    headers = copy / "include" / "flashinfer_a2a"
    for name in {edit[0] for edit in stage_times.EDITS + stage_times.REPLACE}:
        assert (headers / name).read_text() != (ROOT / "include" / "flashinfer_a2a" / name).read_text(), name
    assert "STAMP(0);" in (headers / "dispatch.cuh").read_text()
    assert "STAMP(16);" in (headers / "combine.cuh").read_text()


def test_the_stamped_copy_is_built_even_where_a_prebuilt_library_is_named(stage_times, tmp_path, capsys):
    environ = {"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere", "FLASHINFER_A2A_AOT_DIR": "/prebuilt",
               "FLASHINFER_A2A_DISABLE_JIT": "1", "FLASHINFER_A2A_CUDA_ARCH_LIST": "9.0a"}
    env = stage_times.copy_env(tmp_path, environ)
    assert "FLASHINFER_A2A_AOT_DIR" not in env and "FLASHINFER_A2A_DISABLE_JIT" not in env
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path) and env["PYTHONPATH"].endswith("/elsewhere")
    assert env["FLASHINFER_A2A_CACHE_DIR"] == str(tmp_path / "cache")
    assert env["FLASHINFER_A2A_CUDA_ARCH_LIST"] == "9.0a" and env["PATH"] == "/usr/bin"
    assert environ["FLASHINFER_A2A_AOT_DIR"] == "/prebuilt"  # the caller's mapping is left as it was
    err = capsys.readouterr().err
    assert "FLASHINFER_A2A_AOT_DIR ignored" in err and "FLASHINFER_A2A_DISABLE_JIT ignored" in err


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("unit", ["dispatch.cu", "combine.cu"])
def test_the_stamped_kernels_compile(stage_times, tmp_path, unit):
    copy = tmp_path / "copy"
    stage_times.stamped_copy(copy)
    # The library's own flags, the copy's headers and sources ahead of the package's.
    flags = toolchain.cuda_cflags(["9.0a"], [copy / "include", copy / "csrc"], [])
    cmd = ["nvcc", *flags, "-c", str(copy / "csrc" / unit), "-o", str(tmp_path / "unit.o")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
