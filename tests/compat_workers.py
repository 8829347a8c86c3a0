"""Rank bodies for tests/test_compat_flashinfer.py: FlashInfer-style communicators over gloo ranks (spawned)."""

from __future__ import annotations

from pathlib import Path

from .comm_workers import spawn_checks


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
    spawn_checks(__name__, check, world_size, tmp_path, timeout_s=timeout_s)
