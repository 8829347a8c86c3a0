"""The hierarchical transport on GPUs: 4 ranks as 2 nodes of 2, bitwise against the reference and the flat nvlink
transport, eager and captured in CUDA graphs (tests/multigpu/hierarchical_worker.py). One rank per GPU needs 4 GPUs;
two ranks per GPU (each node on one GPU, the NCCL peer groups across the two) needs 2. Skipped without them."""

import pytest

from .test_multigpu import NUM_GPUS, _launch_module

CHECKS = ("reference", "flat_equal", "graph")


@pytest.mark.parametrize("ranks_per_gpu", [1, 2])
def test_two_nodes_of_two(ranks_per_gpu):
    if NUM_GPUS * ranks_per_gpu < 4:
        pytest.skip(f"needs {4 // ranks_per_gpu} GPUs for {ranks_per_gpu} rank(s) per GPU, found {NUM_GPUS}")
    out = _launch_module("tests.multigpu.hierarchical_worker", 4, [], timeout=900,
                         extra_env={"FLASHINFER_A2A_TEST_RANKS_PER_GPU": str(ranks_per_gpu)})
    for check in CHECKS:
        for rank in range(4):
            assert f"CHECK {check} rank {rank} ok" in out, out[-6000:]
