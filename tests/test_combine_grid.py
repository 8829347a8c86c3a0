"""The one-kernel combine's grid rule (FusedCombineFor in include/flashinfer_a2a/combine.cuh), checked on the host
over 4 million shapes by tests/combine_grid_check.cu: where ranks share a GPU, every rank's waiting blocks leave a
multiprocessor free; no more blocks than the SM budget; blocks of 8 to 32 warps (with a GPU per rank and the whole
GPU, 8, or 4 where tokens fan out wide), none without work; a warp pulls at most 4 items in turn where ranks share a
GPU, 1 with a GPU per rank under an SM budget, 512 on the whole GPU; and the combine is split in two kernels only
where no such grid exists. The same for the one-kernel combine over the FP8 wire (FusedFp8CombineFor): blocks of 8
to 16 warps, an item a warp. The device code of the header is compiled to PTX only (about 20 s);
tests/gpu/test_fused_combine.py runs the kernels."""

from __future__ import annotations

from pathlib import Path

from .host_checks import run_host_check

SOURCE = Path(__file__).with_name("combine_grid_check.cu")


def test_fused_combine_grid_is_safe_and_declines_only_when_it_must(tmp_path):
    cases, violations, result = run_host_check(SOURCE, tmp_path)
    assert cases > 4_000_000
    assert (violations, result.returncode) == (0, 0), result.stdout
