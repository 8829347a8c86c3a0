"""Fixtures for the JIT tests: one shared build of the real module, and a small probe module for the build logic.

nvcc is slow on a 2-core machine (the real module takes about a minute for two archs), so the real module is built
once per session in a private cache (``a2a_build`` in tests/conftest.py), and the tests of rebuild, locking and
logging use a one-function probe built for one arch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from flashinfer_a2a.jit import JitSpec
from .jit_testing import PROBE_CU, set_jit_env


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
