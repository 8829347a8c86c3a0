"""The nccl transport on 2 and 4 GPUs (one NCCL rank each): its kernels bitwise against the reference (fixed and
randomized cases, eager and replayed from CUDA graphs, traced by torch.compile) and against the nvlink transport
(eagerly and graph-captured). Skipped without the GPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

CHECKS = ["padded", "exact", "errors", "nvlink_equal", "graph_equal", "peer_exchange", "compiled", "randomized"]


@pytest.mark.parametrize("nproc", [2, 4])
def test_ranks_over_nccl(nproc):
    if NUM_GPUS < nproc:
        pytest.skip(f"needs {nproc} GPUs, found {NUM_GPUS}")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(29600 + os.getpid() % 1000), "-m", "tests.multigpu.nccl_worker"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for check in CHECKS:
        for rank in range(nproc):
            assert f"CHECK {check} rank {rank} ok" in out, out[-6000:]
