"""Where the benchmark runs: simulated ranks in one process, or one rank per process under torchrun or mpirun."""

from __future__ import annotations

import dataclasses
import pickle
import socket
from typing import Any, Optional

import torch

from ..comm import Communicator, as_communicator
from ..config import launcher_environment


def launched_world_size(env: Optional[dict[str, str]] = None) -> int:
    """Processes started together by torchrun (WORLD_SIZE) or mpirun (OMPI/PMI variables); 1 otherwise."""
    env = launcher_environment() if env is None else env
    for name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if name in env:
            return int(env[name])
    return 1


@dataclasses.dataclass
class Session:
    """This process's part of the run."""

    launcher: str  # "simulated", "torchrun" or "mpirun"
    ep_size: int
    rank: int  # this process's rank; 0 when simulated
    device: torch.device
    comm: Optional[Communicator] = None  # bootstrap of MoeAlltoAll and gathering of timings (not simulated)
    group: Any = None  # what MoeAlltoAll takes: a gloo process group or an mpi4py communicator
    nccl_group: Any = None  # for the NCCL baselines

    @property
    def simulated(self) -> bool:
        return self.comm is None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.comm is not None:
            self.comm.barrier()

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value`` (picklable), by rank."""
        if self.comm is None:
            return [value]
        return [pickle.loads(blob) for blob in self.comm.allgather(pickle.dumps(value))]

    def close(self) -> None:
        if self.nccl_group is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(sim_ranks: int) -> Session:
    """Joins the launched processes (NCCL for the baselines, gloo or MPI for the bootstrap), or sets up simulated
    ranks when this process was started alone."""
    import torch.distributed as dist

    env = launcher_environment()
    if launched_world_size(env) <= 1:
        return Session("simulated", sim_ranks, 0, torch.device("cuda", torch.cuda.current_device()))
    if "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        local = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("MPI_LOCALRANKID", "0")))
        host, port = world.bcast((socket.gethostname(), _free_port()) if world.rank == 0 else None, root=0)
        launcher, rank, size, group, init = "mpirun", world.rank, world.size, world, f"tcp://{host}:{port}"
    else:
        local, rank, size = int(env["LOCAL_RANK"]), int(env["RANK"]), int(env["WORLD_SIZE"])
        launcher, group, init = "torchrun", None, "env://"
    if local >= torch.cuda.device_count():
        raise RuntimeError(f"local rank {local} has no GPU: {torch.cuda.device_count()} visible on this host")
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size, device_id=device)
    if group is None:
        group = dist.new_group(backend="gloo")
    return Session(launcher, size, rank, device, as_communicator(group), group, dist.group.WORLD)
