"""An engine written for FlashInfer 0.7.4's moe_ep, over flashinfer_a2a.compat.moe_ep (tests/multigpu/moe_ep_engine.py):
layers sharing a workspace through create_communication, eager warm-up, a CUDA graph per batch size replayed out of
order, EPLB statistics at every step, a rank masked out and taken back mid-run; and the 0.7.2 surface's statistics
and masks. Two processes on one GPU, and one process per GPU where there are two or more; skipped without a GPU."""

import pytest
import torch

from .test_multigpu import NUM_GPUS, _launch_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
CHECKS = ["engine", "flashinfer_072"]


def _check(out: str, nproc: int) -> None:
    for check in CHECKS:
        for rank in range(nproc):
            assert f"CHECK moe_ep {check} rank {rank} ok" in out, out[-6000:]


def test_moe_ep_engine_two_processes_on_one_gpu():
    out = _launch_module("tests.multigpu.moe_ep_engine", 2, CHECKS, extra_env={"FLASHINFER_A2A_TEST_SHARED_GPU": "1"})
    _check(out, 2)


@pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 or more GPUs")
@pytest.mark.parametrize("nproc", sorted({2, NUM_GPUS} - {0, 1}))
def test_moe_ep_engine_one_process_per_gpu(nproc):
    _check(_launch_module("tests.multigpu.moe_ep_engine", nproc, CHECKS), nproc)
