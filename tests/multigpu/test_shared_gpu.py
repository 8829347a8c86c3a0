"""Two ranks in two processes on one GPU, taking the one-GPU-per-rank paths (the pushed combines): the
contexts time-slice, so neither rank's spinning kernel starves the other. Runs where the multi-GPU suite cannot;
skipped without a GPU."""

import pytest
import torch

from .test_multigpu import _launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_push_on_one_gpu(launcher):
    checks = ["push", "push_missing_rank"]
    out = _launch(launcher, 2, checks, extra_env={"FLASHINFER_A2A_TEST_SHARED_GPU": "1"})
    for check in checks:
        for rank in range(2):
            assert f"CHECK {check} rank {rank} ok" in out, out[-6000:]
