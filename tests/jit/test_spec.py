"""JitSpec build logic on a one-function probe module: logging, header dependencies, the lock, the errors."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

from flashinfer_a2a._version import __version__
from flashinfer_a2a.jit import JitSpec
from .jit_testing import REPO, ninja_log_count


def test_spec_validates_name_and_sources(tmp_path):
    with pytest.raises(ValueError, match="name"):
        JitSpec("not a name", (tmp_path / "a.cu",))
    with pytest.raises(ValueError, match="absolute"):
        JitSpec("probe", ("a.cu",))


def test_paths(probe, tmp_path):
    spec = probe.spec()
    assert spec.build_dir == tmp_path / "probe cache" / __version__ / "9.0a" / "probe"
    assert spec.jit_library_path == spec.build_dir / "probe.so"
    assert spec.aot_library_path == tmp_path / "no_aot" / "probe" / "probe.so"


def test_build_ninja_is_written_only_when_it_changes(probe):
    assert probe.spec().write_ninja() is True
    assert probe.spec().write_ninja() is False
    flagged = JitSpec("probe", (probe.source,), (probe.include_dir,), extra_cuda_cflags=("-DPROBE_FLAG=1",))
    assert flagged.write_ninja() is True
    assert "-DPROBE_FLAG=1" in (flagged.build_dir / "build.ninja").read_text()


def test_cold_build_logs_one_line_and_loads(probe, caplog):
    spec = probe.spec()
    with caplog.at_level(logging.INFO, logger="flashinfer_a2a"):
        module = spec.load()
        assert spec.build() is False
    records = [r.getMessage() for r in caplog.records if r.name == "flashinfer_a2a"]
    assert len(records) == 1, records
    assert re.fullmatch(r"built probe in \d+\.\d s", records[0])
    assert module.probe_add(2, 3) == 5


def test_editing_a_header_rebuilds(probe, monkeypatch, capsys):
    spec = probe.spec()
    obj = spec.build_dir / "probe.o"
    assert spec.build() is True
    assert ninja_log_count(spec.build_dir, obj) == 1
    # Only the header changes: the depfile nvcc wrote is what makes ninja recompile probe.cu.
    probe.header.write_text(probe.header.read_text().replace("kProbeOffset = 0", "kProbeOffset = 100"))
    monkeypatch.setenv("FLASHINFER_A2A_JIT_VERBOSE", "1")
    capsys.readouterr()
    assert spec.build() is True
    assert ninja_log_count(spec.build_dir, obj) == 2
    shown = capsys.readouterr().err
    assert "--generate-dependencies-with-compile" in shown, "verbose shows the full nvcc command line"
    assert str(probe.source) in shown
    monkeypatch.delenv("FLASHINFER_A2A_JIT_VERBOSE")
    assert spec.build() is False


def test_concurrent_builds_compile_once_and_both_load(probe):
    code = textwrap.dedent(
        f"""
        from flashinfer_a2a.jit import JitSpec
        spec = JitSpec("probe", ({str(probe.source)!r},), extra_include_dirs=({str(probe.include_dir)!r},))
        print(spec.load().probe_add(40, 2))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        assert out.strip() == "42"
    spec = probe.spec()
    assert ninja_log_count(spec.build_dir, spec.build_dir / "probe.o") == 1
    assert ninja_log_count(spec.build_dir, spec.jit_library_path) == 1


def test_missing_nvcc_names_cuda_home(probe, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no_cuda"))
    with pytest.raises(RuntimeError, match="CUDA_HOME") as err:
        probe.spec().load()
    assert str(tmp_path / "no_cuda" / "bin" / "nvcc") in str(err.value)


def test_disable_jit_without_aot_library_is_a_clear_error(probe, monkeypatch):
    monkeypatch.setenv("FLASHINFER_A2A_DISABLE_JIT", "1")
    spec = probe.spec()
    with pytest.raises(RuntimeError, match="FLASHINFER_A2A_DISABLE_JIT") as err:
        spec.load()
    assert str(spec.aot_library_path) in str(err.value)
    assert "aot.py" in str(err.value)
    assert not spec.build_dir.exists(), "nothing was compiled"
