"""Rank bodies for tests/test_compat_flashinfer.py: FlashInfer-style communicators over gloo ranks (spawned)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import time

from .comm_workers import COLLECTIVE_TIMEOUT


class VllmLikeBackend:
    """Shaped as vLLM's CommBackend over a CPU group in the versions whose bcast and barrier raise."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self.dist, self.group = dist, group

    def Get_rank(self):
        return self.dist.get_rank(self.group)

    def Get_size(self):
        return self.dist.get_world_size(self.group)

    def allgather(self, data):
        out = [None] * self.Get_size()
        self.dist.all_gather_object(out, data, group=self.group)
        return out

    def bcast(self, data, root):
        raise NotImplementedError("bcast")

    def barrier(self):
        raise NotImplementedError("barrier")

    def Split(self, color, key):
        return self


class NoBarrierBackend(VllmLikeBackend):
    """Shaped as the versions that have neither bcast nor barrier."""

    bcast = None
    barrier = None


def check_adapter(rank: int, world_size: int, tmp: Path) -> None:
    from flashinfer_a2a.compat.comm_backend import CommBackendCommunicator

    for backend in (VllmLikeBackend(), NoBarrierBackend()):
        comm = CommBackendCommunicator(backend)
        assert (comm.rank, comm.size) == (rank, world_size)
        assert comm.allgather(b"x%d" % rank * (rank + 1)) == [b"x%d" % r * (r + 1) for r in range(world_size)]
        root = world_size - 1
        assert comm.broadcast(b"from-root" if rank == root else None, root=root) == b"from-root"
        # barrier: no rank leaves before every rank has entered (each leaves a file before entering)
        mark = tmp / f"{type(backend).__name__}-{rank}"
        mark.write_text("in")
        comm.barrier()
        assert all((tmp / f"{type(backend).__name__}-{r}").exists() for r in range(world_size))
        comm.barrier()  # nobody deletes while a peer still looks
        mark.unlink()


def check_split(rank: int, world_size: int, tmp: Path) -> None:
    from flashinfer_a2a.compat.comm_backend import CommBackendCommunicator, TorchDistBackend

    sub = TorchDistBackend().Split(rank % 2, rank)
    members = [r for r in range(world_size) if r % 2 == rank % 2]
    assert sub.Get_size() == len(members) and sub.Get_rank() == members.index(rank)
    assert list(sub.allgather(rank)) == members
    assert sub.bcast(rank * 10 if sub.Get_rank() == 1 else None, 1) == members[1] * 10
    sub.barrier()
    comm = CommBackendCommunicator(sub)
    assert comm.allgather(b"%d" % rank) == [b"%d" % r for r in members]


CHECKS = {"adapter": check_adapter, "split": check_split}


def spawn(check: str, world_size: int, tmp_path: Path, timeout_s: float = 120.0) -> None:
    """Runs ``CHECKS[check](rank, world_size, tmp_path)`` on ``world_size`` gloo ranks; re-raises a rank's error."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_entry, args=(world_size, str(tmp_path), check), nprocs=world_size, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() >= deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            raise TimeoutError(f"{check} on {world_size} ranks did not finish in {timeout_s} s")


def _entry(rank: int, world_size: int, tmp: str, check: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp}/filestore", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)
    CHECKS[check](rank, world_size, Path(tmp))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/comm_workers.py: skips a torch 2.13 CPU finalization abort after the check passed
