"""Real ranks on several GPUs, under torchrun and under mpirun. Skipped without 2 GPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ..test_comm import require_mpirun

ROOT = Path(__file__).resolve().parents[2]
NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 or more GPUs")

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _env(extra=None):
    env = dict(os.environ, **SAFE_ENV, **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _launch(launcher: str, nproc: int, checks: list[str], timeout: int = 600, extra_env=None) -> str:
    return _launch_module("tests.multigpu.worker", nproc, checks, timeout, extra_env, launcher)


def _launch_module(module: str, nproc: int, args: list[str], timeout: int = 600, extra_env=None,
                   launcher: str = "torchrun") -> str:
    """Runs ``python -m module *args`` as ``nproc`` ranks under ``launcher``; returns their output (asserting every
    rank exited 0)."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
               str(29500 + os.getpid() % 1000), "-m", module, *args]
    else:
        cmd = [require_mpirun(), "--allow-run-as-root", "--oversubscribe", "-n", str(nproc)]
        for name in (*SAFE_ENV, *(extra_env or {}), "PYTHONPATH"):
            cmd += ["-x", name]  # Open MPI forwards only the variables named
        cmd += [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(extra_env), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


CHECKS = ["correctness", "quantized", "push", "pull_without_room", "default_push", "push_missing_rank", "graph",
          "back_to_back", "compile", "interleaved", "comm_stream", "lifecycle", "misuse", "missing_rank"]


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
@pytest.mark.parametrize("nproc", sorted({2, NUM_GPUS} - {0, 1}))
def test_all_checks(launcher, nproc):
    out = _launch(launcher, nproc, CHECKS)
    for check in CHECKS:
        for rank in range(nproc):
            assert f"CHECK {check} rank {rank} ok" in out, out[-6000:]


def test_killed_rank_torchrun():
    out = _launch("torchrun", 2, ["killed_rank"])
    assert "CHECK killed_rank rank 0 ok" in out, out[-6000:]
