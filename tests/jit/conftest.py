"""Fixtures for the JIT tests: one shared build of the real module, and a small probe module for the build logic.

nvcc is slow on a 2-core machine (the real module takes about a minute for two archs), so the real module is built
once per session in a private cache, and the tests of rebuild, locking and logging use a one-function probe built
for one arch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashinfer_a2a.jit import JitSpec, gen_a2a_module
from .jit_testing import PROBE_CU, set_jit_env


@dataclass
class SharedBuild:
    spec: JitSpec
    env: dict[str, str]
    library: Path
    build_dir: Path
    seconds: float


@pytest.fixture(scope="session")
def a2a_build(tmp_path_factory) -> SharedBuild:
    """The real flashinfer_a2a_ops, JIT-built for sm_90a and sm_100a in a cache private to this session."""
    root = tmp_path_factory.mktemp("a2a_jit")
    env = {
        "FLASHINFER_A2A_CUDA_ARCH_LIST": "9.0a 10.0a",
        "FLASHINFER_A2A_CACHE_DIR": str(root / "cache"),
        # Empty on purpose: a library left in the package's _aot/ by `python aot.py` must not stand in for JIT.
        "FLASHINFER_A2A_AOT_DIR": str(root / "no_aot"),
    }
    with pytest.MonkeyPatch.context() as mp:
        set_jit_env(mp, env)
        spec = gen_a2a_module()
        start = time.monotonic()
        assert spec.build()
        seconds = time.monotonic() - start
        return SharedBuild(spec, env, spec.jit_library_path, spec.build_dir, seconds)


@pytest.fixture
def a2a_env(monkeypatch, a2a_build) -> SharedBuild:
    """The environment of the shared build, set for one test."""
    set_jit_env(monkeypatch, a2a_build.env)
    return a2a_build


@dataclass
class Probe:
    source: Path
    header: Path
    include_dir: Path

    def spec(self) -> JitSpec:
        return JitSpec("probe", (self.source,), extra_include_dirs=(self.include_dir,))


@pytest.fixture
def probe(tmp_path, monkeypatch) -> Probe:
    """A one-function module built for sm_90a only, in a fresh cache whose path has a space (ninja escapes it)."""
    src_dir, include_dir = tmp_path / "src", tmp_path / "include"
    src_dir.mkdir()
    include_dir.mkdir()
    (src_dir / "probe.cu").write_text(PROBE_CU)
    (include_dir / "probe.h").write_text("#pragma once\n#include <cstdint>\nconstexpr int64_t kProbeOffset = 0;\n")
    set_jit_env(
        monkeypatch,
        {
            "FLASHINFER_A2A_CUDA_ARCH_LIST": "9.0a",
            "FLASHINFER_A2A_CACHE_DIR": str(tmp_path / "probe cache"),
            "FLASHINFER_A2A_AOT_DIR": str(tmp_path / "no_aot"),
        },
    )
    return Probe(src_dir / "probe.cu", include_dir / "probe.h", include_dir)
