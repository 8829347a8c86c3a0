"""Helpers shared by the JIT tests (importable from test files, unlike conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE_CU = """\
#include <tvm/ffi/function.h>

#include "probe.h"

int64_t ProbeAdd(int64_t a, int64_t b) { return a + b + kProbeOffset; }

TVM_FFI_DLL_EXPORT_TYPED_FUNC(probe_add, ProbeAdd);
"""


def set_jit_env(mp: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    """Clear every FLASHINFER_A2A_* variable of the developer's shell, then set ``env``."""
    for name in list(os.environ):
        if name.startswith("FLASHINFER_A2A_"):
            mp.delenv(name)
    for name, value in env.items():
        mp.setenv(name, value)


def ninja_log_count(build_dir: Path, output: Path) -> int:
    """How many times ninja ran the command producing ``output`` (one .ninja_log line each)."""
    log = build_dir / ".ninja_log"
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if line.split("\t")[-2:-1] == [str(output)])
