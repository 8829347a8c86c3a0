"""The real flashinfer_a2a_ops module: JIT-built for sm_90a and sm_100a with no GPU, loaded through tvm-ffi."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import tvm_ffi
import tvm_ffi.libinfo

from flashinfer_a2a import config
from flashinfer_a2a.jit import A2A_SOURCES, all_specs, gen_a2a_module, get_a2a_module
from .jit_testing import REPO


def cuobjdump() -> str:
    """cuobjdump on PATH, in the toolkit, or from the nvidia-cuda-cuobjdump wheel (nvidia/<cuXX>/bin)."""
    candidates = [shutil.which("cuobjdump"), str(config.cuda_home() / "bin" / "cuobjdump")]
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        candidates += sorted(str(p) for p in Path(root).glob("*/bin/cuobjdump"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise AssertionError("no cuobjdump: pip install nvidia-cuda-cuobjdump (the test extra has it)")


def test_spec_lists_the_sources_from_the_checkout():
    spec = gen_a2a_module()
    assert spec.name == "flashinfer_a2a_ops"
    assert spec.sources == tuple(REPO / "csrc" / s for s in A2A_SOURCES)
    assert all(s.is_file() for s in spec.sources)
    assert [s.name for s in all_specs()] == ["flashinfer_a2a_ops"]


def test_builds_and_loads_without_a_gpu(a2a_env):
    module = a2a_env.spec.load()
    # DeepSeek-V3 sizes: 8 ranks, 256 tokens per rank, top-8, bf16 hidden of 7168.
    size = module.get_workspace_size(8, 256, 8, 7168 * 2, 7168 * 2)
    assert size > 8 * 256 * 7168 * 2 * 2
    assert module.get_workspace_size(8, 512, 8, 7168 * 2, 7168 * 2) > size


def test_library_carries_sm90a_and_sm100a_code(a2a_env):
    listing = subprocess.run(
        [cuobjdump(), "--list-elf", str(a2a_env.library)], capture_output=True, text=True, check=True
    ).stdout
    assert "sm_90a" in listing
    assert "sm_100a" in listing


def test_second_build_of_an_unchanged_tree_compiles_nothing(a2a_env):
    # What a second `pytest -q tests` does: a fresh process, same cache, same sources, flags and archs.
    build_dir = a2a_env.build_dir
    build_ninja = build_dir / "build.ninja"
    written = build_ninja.stat().st_mtime_ns
    log = (build_dir / ".ninja_log").read_text()
    library = a2a_env.library.stat().st_mtime_ns
    code = "from flashinfer_a2a.jit import gen_a2a_module; print(gen_a2a_module().build())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (proc.stdout, proc.stderr) == ("False\n", ""), "no build, and no progress line"
    assert (build_dir / ".ninja_log").read_text() == log, "ninja ran no command"
    assert build_ninja.stat().st_mtime_ns == written, "build.ninja is rewritten only when its content changes"
    assert a2a_env.library.stat().st_mtime_ns == library


def test_library_needs_only_system_libraries_and_has_no_run_path(a2a_env):
    dynamic = subprocess.run(["readelf", "-d", str(a2a_env.library)], capture_output=True, text=True, check=True)
    assert "RPATH" not in dynamic.stdout and "RUNPATH" not in dynamic.stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.*)\]", dynamic.stdout))
    # Within the manylinux policy: what auditwheel accepts without an --exclude.
    assert needed <= {"libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "libm.so.6", "ld-linux-x86-64.so.2"}, needed


def test_every_undefined_symbol_is_tvm_ffi_or_a_system_library(a2a_env):
    # The link no longer names libtvm_ffi.so, so the linker cannot report a source missing from the spec: this does.
    # A system library's symbol carries its version (memcpy@GLIBC_2.14); tvm-ffi's are unversioned.
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(a2a_env.library)], capture_output=True,
                               text=True, check=True).stdout.split("\n")
    unversioned = {line.split()[-1] for line in undefined if line.strip() and "@" not in line
                   and line.split()[0] == "U"}
    exported = subprocess.run(["nm", "-D", "--defined-only", tvm_ffi.libinfo.find_libtvm_ffi()],
                              capture_output=True, text=True, check=True).stdout
    provided = {line.split()[-1] for line in exported.splitlines() if line.strip()}
    assert unversioned, "the library calls tvm-ffi"
    assert unversioned <= provided, f"not defined by libtvm_ffi.so: {sorted(unversioned - provided)}"


def test_library_holds_no_path_of_the_build_machine(a2a_env):
    # __FILE__ in our checks and tvm-ffi's headers, mapped by -ffile-prefix-map to csrc/... and tvm_ffi/include/...
    data = a2a_env.library.read_bytes()
    for tree in (REPO, Path(tvm_ffi.__file__).parent.parent, config.cuda_home()):
        assert str(tree).encode() not in data, f"{a2a_env.library} contains {tree}"
    assert b"csrc/combine.cu" in data
    assert b"tmpxft_" not in data, "no nvcc temporary file name (they hold its process id)"


def test_get_a2a_module_loads_once(a2a_env):
    get_a2a_module.cache_clear()
    try:
        module = get_a2a_module()
        assert get_a2a_module() is module
        assert module.get_workspace_size(1, 16, 2, 256, 256) > 0
    finally:
        # Later tests must not inherit a module loaded from this session's private cache.
        get_a2a_module.cache_clear()


def test_import_compiles_nothing(tmp_path):
    env = {
        **os.environ,
        "FLASHINFER_A2A_CUDA_ARCH_LIST": "9.0a",
        "FLASHINFER_A2A_CACHE_DIR": str(tmp_path / "cache"),
        "CUDA_HOME": str(tmp_path / "no_cuda"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run([sys.executable, "-c", "import flashinfer_a2a, flashinfer_a2a.jit"], env=env, check=True)
    assert not (tmp_path / "cache").exists()
