"""Fixtures shared by the CPU tests: one JIT build of the real module per session."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from flashinfer_a2a.jit import JitSpec, gen_a2a_module

from .jit.jit_testing import set_jit_env


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


