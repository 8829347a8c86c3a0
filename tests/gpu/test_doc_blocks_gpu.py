"""The docs' GPU-only code, run as written: semantics.md's SimulatedRanks block in this process, and the programs
under docs/examples that the pages include, under torchrun (or mpirun) with their processes sharing this GPU."""

import os
import re
import subprocess
import sys

import pytest

from ..examples import EXAMPLES
from ..multigpu.test_multigpu import ROOT, _env
from ..test_comm import require_mpirun
from ..test_doc_blocks import REPO, python_blocks


def _run(cmd: list[str], nproc: int, done: str) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # Each rank's line is searched for, not taken line by line: the processes share one pipe, and one's line may
    # land between another's text and its newline ("... bitwise okrank 0: ...").
    for rank in range(nproc):
        assert re.search(rf"rank {rank}\b[^\n]*?{re.escape(done)}", out), out[-6000:]
    print("\n".join(line for line in out.splitlines() if done in line))


def _torchrun(example: str, nproc: int, done: str) -> None:
    port = str(27500 + (os.getpid() + hash(example)) % 1000)
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", port,
          str(EXAMPLES / example)], nproc, done)


def test_semantics_block_runs():
    (block,) = python_blocks(REPO / "docs" / "semantics.md")
    namespace = {"__name__": "__doc_block__"}
    exec(compile(block, "docs/semantics.md", "exec"), namespace)  # ends in its own bitwise assert
    assert [tuple(o.shape) for o in namespace["out"]] == [(n, namespace["hidden"]) for n in namespace["num_tokens"]]


@pytest.mark.parametrize(("example", "nproc", "done"), [
    ("torchrun_example.py", 2, "step 2:"),
    ("ep_subgroups.py", 4, "sub-group ok"),
    ("quantized.py", 2, "bitwise ok"),
    ("overlap.py", 2, "bitwise ok"),
    ("cuda_graphs.py", 2, "graphs equal the eager steps"),
])
def test_example_runs_under_torchrun_on_one_gpu(example, nproc, done):
    _torchrun(example, nproc, done)


def test_mpirun_example_runs_on_one_gpu():
    mpirun = require_mpirun()
    env = _env()
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2"]
    for name in ("PYTHONPATH", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                 "FLASHINFER_A2A_CACHE_DIR"):
        if name in env:
            cmd += ["-x", name]
    _run([*cmd, sys.executable, str(EXAMPLES / "mpirun_example.py")], 2, "step 2:")
