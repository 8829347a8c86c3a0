"""Two ranks in two processes on one GPU, taking the one-GPU-per-rank paths (the pushed combines): the
contexts time-slice, so neither rank's spinning kernel starves the other. Runs where the multi-GPU suite cannot;
skipped without a GPU."""

import pytest
import torch

from .test_multigpu import _launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("launcher, nproc", [("torchrun", 2), ("mpirun", 2), ("torchrun", 3)])
def test_push_on_one_gpu(launcher, nproc):
    """Two ranks under both launchers; three under torchrun (each pushes to two owners, their rows interleaved, and
    waits on rows from two peers)."""
    checks = ["push", "pull_without_room", "default_push", "push_missing_rank"]
    out = _launch(launcher, nproc, checks, extra_env={"FLASHINFER_A2A_TEST_SHARED_GPU": "1"})
    for check in checks:
        for rank in range(nproc):
            assert f"CHECK {check} rank {rank} ok" in out, out[-6000:]


def test_overlap_on_communication_streams_on_one_gpu():
    """The overlapped step with its halves on communication streams, two processes on one GPU: bitwise the serial
    step, eager, in a CUDA graph and compiled."""
    out = _launch("torchrun", 2, ["comm_stream"], extra_env={"FLASHINFER_A2A_TEST_SHARED_GPU": "1"})
    for rank in range(2):
        assert f"CHECK comm_stream rank {rank} ok" in out, out[-6000:]
