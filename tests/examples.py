"""Imports the example programs under docs/examples (not a package) for the tests that keep them working."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples"


def example(name: str):
    """The module ``docs/examples/<name>.py``, imported once."""
    key = f"_flashinfer_a2a_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # before exec: dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return sys.modules[key]


def run_on_cpu_under_torchrun(name: str, nproc: int, port_base: int) -> str:
    """Runs ``docs/examples/<name>.py`` as ``nproc`` gloo ranks without a GPU, through tests/example_main.py (which
    skips interpreter finalization, see there); returns the output, asserting every rank exited 0."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(port_base + os.getpid() % 1000), str(REPO / "tests" / "example_main.py"), str(EXAMPLES / f"{name}.py")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out
