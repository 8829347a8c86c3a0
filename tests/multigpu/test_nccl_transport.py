"""The nccl transport on 2 GPUs (one NCCL rank each): bitwise against the reference and against the nvlink
transport. Skipped without 2 GPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 or more GPUs")

CHECKS = ["padded", "exact", "errors", "nvlink_equal"]


def test_two_ranks_over_nccl():
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(29600 + os.getpid() % 1000), "-m", "tests.multigpu.nccl_worker"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for check in CHECKS:
        for rank in range(2):
            assert f"CHECK {check} rank {rank} ok" in out, out[-6000:]
