"""The randomized suite (tests/multigpu/randomized.py) on real ranks: one process per GPU on 2 and on 4 GPUs, and 2
processes sharing one GPU; skipped without the GPUs. On CPU its harness runs over the nccl transport on 2 gloo
ranks (no CUDA graphs, split calls or pushed combines there).

    pytest -q tests/multigpu/test_randomized.py
    FLASHINFER_A2A_TEST_RANDOM_CASES=500 FLASHINFER_A2A_TEST_RANDOM_SECONDS=1800 \
        pytest -q tests/multigpu/test_randomized.py  # longer
    FLASHINFER_A2A_TEST_SEED=<printed seed> pytest -q tests/multigpu/test_randomized.py  # replays a run
"""

import os

import pytest
import torch

from ..nccl_workers import spawn_gloo
from .randomized import SECONDS
from .test_multigpu import NUM_GPUS, _launch

# Cases stop starting after FLASHINFER_A2A_TEST_RANDOM_SECONDS; the rest is start-up (the JIT build included).
TIMEOUT_S = int(float(os.environ.get("FLASHINFER_A2A_TEST_RANDOM_SECONDS", SECONDS))) + 480


def _run(nproc: int, extra_env=None) -> None:
    out = _launch("torchrun", nproc, ["randomized"], timeout=TIMEOUT_S, extra_env=extra_env)
    for rank in range(nproc):
        assert f"CHECK randomized rank {rank} ok" in out, out[-6000:]
    print("\n".join(line for line in out.splitlines() if line.startswith("randomized:")))


@pytest.mark.parametrize("nproc", [2, 4])
def test_one_process_per_gpu(nproc):
    if NUM_GPUS < nproc:
        pytest.skip(f"needs {nproc} GPUs, found {NUM_GPUS}")
    _run(nproc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_two_processes_on_one_gpu():
    _run(2, {"FLASHINFER_A2A_TEST_SHARED_GPU": "1"})


def test_the_harness_over_the_nccl_transport_on_cpu(tmp_path):
    spawn_gloo(["gloo"], 2, tmp_path, module="tests.multigpu.randomized")
