"""JitSpec build logic on a one-function probe module: progress lines, what rebuilds, the lock, the errors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from flashinfer_a2a._version import __version__
from flashinfer_a2a.jit import JitSpec, toolchain
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


def test_cold_build_says_when_it_starts_and_ends_and_a_cached_load_says_nothing(probe, capsys):
    spec = probe.spec()
    module = spec.load()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[0] == f"flashinfer_a2a: compiling probe for 9.0a in {spec.build_dir} (once; later runs reuse it)"
    assert re.fullmatch(r"flashinfer_a2a: built probe in \d+\.\d s", lines[1]), lines[1]
    assert module.probe_add(2, 3) == 5
    # From the cache, in this process and in a fresh one: not a word.
    assert spec.build() is False
    code = textwrap.dedent(
        f"""
        from flashinfer_a2a.jit import JitSpec, toolchain
        spec = JitSpec("probe", ({str(probe.source)!r},), extra_include_dirs=({str(probe.include_dir)!r},))
        print(spec.load().probe_add(40, 2))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("42\n", "")
    assert capsys.readouterr().err == ""
    assert ninja_log_count(spec.build_dir, spec.build_dir / "probe.o") == 1


def test_a_changed_flag_recompiles(probe):
    # The arch list is part of the cache path (test_paths); a flag is part of ninja's command line, whose hash
    # .ninja_log keeps: a different flag never reuses an object compiled without it.
    obj = probe.spec().build_dir / "probe.o"
    assert probe.spec().build() is True
    flagged = JitSpec("probe", (probe.source,), (probe.include_dir,), extra_cuda_cflags=("-DPROBE_FLAG=1",))
    assert flagged.build() is True
    assert ninja_log_count(flagged.build_dir, obj) == 2
    assert flagged.build() is False
    assert probe.spec().build() is True
    assert ninja_log_count(flagged.build_dir, obj) == 3


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
        from flashinfer_a2a.jit import JitSpec, toolchain
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


def test_missing_ninja_names_the_packages_to_install(probe, monkeypatch):
    # Simulates an install without the `jit` extra: no ninja on PATH and no ninja package.
    which = toolchain.shutil.which
    monkeypatch.setattr(toolchain.shutil, "which", lambda name: None if name == "ninja" else which(name))
    monkeypatch.setitem(sys.modules, "ninja", None)
    spec = probe.spec()
    with pytest.raises(RuntimeError, match=re.escape("pip install ninja nvidia-cutlass")) as err:
        spec.load()
    assert "ninja" in str(err.value)
    assert not spec.jit_library_path.exists()


def test_missing_cutlass_names_the_packages_to_install(probe, monkeypatch):
    # find_spec answers None for a name that sys.modules maps to None: as if nvidia-cutlass were not installed.
    monkeypatch.setitem(sys.modules, "cutlass_library", None)
    spec = probe.spec()
    with pytest.raises(RuntimeError, match=re.escape("pip install ninja nvidia-cutlass")) as err:
        spec.load()
    assert "nvidia-cutlass" in str(err.value)
    assert not list(spec.build_dir.glob("*.o")) and not spec.jit_library_path.exists(), "nothing was compiled"


REPRODUCIBLE_CU = """\
#include <tvm/ffi/function.h>

namespace {
__device__ int scale_by = 3;  // internal linkage: nvcc names it after the source's path
__global__ void Scale(int* x) { *x *= scale_by; }
}  // namespace

int64_t ProbeAdd(int64_t a, int64_t b) {
  TVM_FFI_ICHECK(a >= 0) << "a is " << a;  // __FILE__
  return a + b + (reinterpret_cast<intptr_t>(&Scale) == 0);
}

TVM_FFI_DLL_EXPORT_TYPED_FUNC(probe_add, ProbeAdd);
"""


def test_checkouts_in_different_places_build_the_same_library(tmp_path, monkeypatch):
    # What a wheel built in /home/a/flashinfer_a2a and one built in /tmp/x/y/flashinfer_a2a must share: every byte.
    # The paths reach a library through __FILE__ (-ffile-prefix-map), nvcc's temporary file names (local symbols,
    # dropped at link) and the hash of internal symbol names (-Xcudafe --orig_src_path_name).
    libraries = []
    for root in (tmp_path / "a", tmp_path / "b" / "deeper"):
        (root / "csrc").mkdir(parents=True)
        (root / "csrc" / "probe.cu").write_text(REPRODUCIBLE_CU)
        monkeypatch.setattr(toolchain, "source_root", lambda root=root: root)
        monkeypatch.setenv("FLASHINFER_A2A_CUDA_ARCH_LIST", "9.0a")
        monkeypatch.setenv("FLASHINFER_A2A_CACHE_DIR", str(root / "cache"))
        monkeypatch.setenv("FLASHINFER_A2A_AOT_DIR", str(root / "no_aot"))
        spec = JitSpec("probe", (root / "csrc" / "probe.cu",))
        assert spec.build() is True
        assert spec.load().probe_add(2, 3) == 5
        libraries.append(spec.jit_library_path.read_bytes())
        assert str(root).encode() not in libraries[-1]
    assert libraries[0] == libraries[1]
