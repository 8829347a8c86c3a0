"""MoeAlltoAll(transport="nccl") under torch.compile(fullgraph=True) on 2 spawned gloo ranks (CPU): the padded
mode's dispatch / combine_input / combine traced through the functional collectives, bitwise equal to the eager
call and to flashinfer_a2a.reference; exact mode refuses to be traced."""

import pytest

from .nccl_compile_workers import spawn_gloo


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_steps_on_gloo(tmp_path, backend):
    spawn_gloo([backend] + (["exact"] if backend == "aot_eager" else []), 2, tmp_path)
