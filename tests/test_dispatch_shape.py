"""The plain dispatch's launch (DispatchLaunchShapeFor and PlanDispatchCopies in include/flashinfer_a2a/dispatch.cuh),
checked on the host over 200 thousand shapes by tests/dispatch_shape_check.cu: the narrower launch (pieces of 2
vectors, blocks of 2 tokens from 64 tokens on) only where tokens fan out wide on the whole GPU, never more blocks than
the SM budget, and rows cut into pieces that cover them exactly for either piece size. The device code of the header
is compiled to PTX only; the multi-GPU tests run the kernels with both launches."""

from __future__ import annotations

from pathlib import Path

from .host_checks import run_host_check

SOURCE = Path(__file__).with_name("dispatch_shape_check.cu")


def test_dispatch_launch_narrows_only_for_wide_fan_out_and_pieces_cover_rows(tmp_path):
    cases, violations, result = run_host_check(SOURCE, tmp_path)
    assert cases > 200_000
    assert (violations, result.returncode) == (0, 0), result.stdout
