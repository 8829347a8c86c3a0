"""The README / docs index quickstart, run as written: torchrun, two processes sharing this GPU."""

import os
import subprocess
import sys

from ..examples import EXAMPLES
from ..multigpu.test_multigpu import ROOT, _env


def test_quickstart_runs_under_torchrun_on_one_gpu():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(28500 + os.getpid() % 1000), str(EXAMPLES / "quickstart.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for rank in range(2):
        assert f"rank {rank}: received [" in out and "combine ok" in out, out[-6000:]
    print("\n".join(line for line in out.splitlines() if "combine ok" in line))
