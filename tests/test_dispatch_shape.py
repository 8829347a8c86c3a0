"""The plain dispatch's launch (DispatchLaunchShapeFor and PlanDispatchCopies in include/flashinfer_a2a/dispatch.cuh),
checked on the host over 200 thousand shapes by tests/dispatch_shape_check.cu: the narrower launch (pieces of 2
vectors, blocks of 2 tokens from 64 tokens on) only where tokens fan out wide on the whole GPU, never more blocks than
the SM budget, and rows cut into pieces that cover them exactly for either piece size. The device code of the header
is compiled to PTX only; the multi-GPU tests run the kernels with both launches."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from flashinfer_a2a.jit import toolchain

SOURCE = Path(__file__).with_name("dispatch_shape_check.cu")


def test_dispatch_launch_narrows_only_for_wide_fan_out_and_pieces_cover_rows(tmp_path):
    try:
        nvcc, cutlass = toolchain.nvcc(), toolchain.cutlass_include_dir()
    except RuntimeError as err:
        pytest.skip(str(err))
    binary = tmp_path / "dispatch_shape_check"
    subprocess.run([str(nvcc), "-std=c++17", "-O2", "--expt-relaxed-constexpr",
                    "-gencode=arch=compute_90a,code=compute_90a", f"-I{toolchain.include_dir()}", f"-I{cutlass}",
                    "-o", str(binary), str(SOURCE)], check=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    match = re.search(r"^(\d+) cases, (\d+) violations$", result.stdout, re.MULTILINE)
    assert match, result.stdout + result.stderr
    assert int(match[1]) > 200_000
    assert (int(match[2]), result.returncode) == (0, 0), result.stdout
