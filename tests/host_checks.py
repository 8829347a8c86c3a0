"""Host-only C++ checks of the headers' launch rules (tests/*_check.cu): each is compiled with nvcc (device code to
PTX only), run, and prints ``<cases> cases, <violations> violations`` with the first few violations."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from flashinfer_a2a.jit import toolchain


def run_host_check(source: Path, tmp_path: Path) -> tuple[int, int, subprocess.CompletedProcess]:
    """Builds and runs ``source``: ``(cases, violations, the finished process)``; skips without nvcc or CUTLASS."""
    try:
        nvcc, cutlass = toolchain.nvcc(), toolchain.cutlass_include_dir()
    except RuntimeError as err:
        pytest.skip(str(err))
    binary = tmp_path / source.stem
    subprocess.run([str(nvcc), "-std=c++17", "-O2", "--expt-relaxed-constexpr",
                    "-gencode=arch=compute_90a,code=compute_90a", f"-I{toolchain.include_dir()}", f"-I{cutlass}",
                    "-o", str(binary), str(source)], check=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    match = re.search(r"^(\d+) cases, (\d+) violations$", result.stdout, re.MULTILINE)
    assert match, result.stdout + result.stderr
    return int(match[1]), int(match[2]), result
