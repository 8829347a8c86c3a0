"""Two ranks in two processes on one GPU, taking the one-GPU-per-rank paths (the pushed FP8-wire combine): the
contexts time-slice, so neither rank's spinning kernel starves the other. Runs where the multi-GPU suite cannot;
skipped without a GPU."""

import pytest
import torch

from .test_multigpu import _launch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_fp8_push_on_one_gpu(launcher):
    out = _launch(launcher, 2, ["fp8_push"], extra_env={"FLASHINFER_A2A_TEST_SHARED_GPU": "1"})
    for rank in range(2):
        assert f"CHECK fp8_push rank {rank} ok" in out, out[-6000:]
