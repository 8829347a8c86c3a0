"""The bootstrap communicator: allgather, broadcast and barrier of small byte blobs, nothing more.

Setting up symmetric memory only exchanges a few hundred bytes per rank (capabilities, handles, tokens), so the
protocol is three calls on ``bytes``. Adapters cover a ``torch.distributed`` process group (the default group or an
expert-parallel sub-group) and an mpi4py communicator; anything else can implement :class:`Communicator` directly.

Every call is collective: all ranks of the communicator make it, in the same order. A caller's bad argument is
therefore reported on every rank (after the collective) instead of raising on one rank and hanging the others.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

_BLOB_TYPES = (bytes, bytearray, memoryview)


@runtime_checkable
class Communicator(Protocol):
    """What the bootstrap needs from a group of ``size`` ranks; this process is ``rank`` (0-based, within the group).

    Attributes:
        rank (int): this process's rank within the group.
        size (int): number of ranks in the group.
    """

    rank: int
    size: int

    def allgather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``: ``list[bytes]`` of length ``size``, index = rank. Collective."""
        ...

    def broadcast(self, data: Optional[bytes], root: int = 0) -> bytes:
        """``data`` of rank ``root`` (group-local), returned on every rank; others pass ``None``. Collective."""
        ...

    def barrier(self) -> None:
        """Returns once every rank has entered. Collective."""
        ...


def _as_blob(data: Any) -> Optional[bytes]:
    """``data`` as bytes, or None if it is not a bytes-like blob (reported collectively by the caller)."""
    return bytes(data) if isinstance(data, _BLOB_TYPES) else None


def _check_gathered(blobs: list, what: str) -> list[bytes]:
    """Raises on every rank alike if any rank passed something other than bytes."""
    bad = [r for r, b in enumerate(blobs) if not isinstance(b, bytes)]
    if bad:
        raise TypeError(f"{what}: ranks {bad} passed data that is not bytes (expected bytes, bytearray or memoryview)")
    return blobs


def _check_root(root: int, size: int) -> None:
    # Every rank sees the same (root, size), so every rank raises: no collective is left half-entered.
    if not 0 <= root < size:
        raise ValueError(f"broadcast: root must be in [0, {size}), got {root}")


def _check_broadcast(blob: Optional[bytes], root: int, rank: int, data: Any) -> bytes:
    """The broadcast result, or the same error on every rank if the root had nothing valid to send."""
    if blob is None:
        if rank == root:
            raise TypeError(f"broadcast: data on the root (rank {root}) must be bytes, got {type(data).__name__}")
        raise RuntimeError(f"broadcast: the root (rank {root}) passed no bytes")
    return blob


class TorchDistributedCommunicator:
    """A :class:`Communicator` over a ``torch.distributed`` process group.

    ``rank`` and ``size`` are the group's, so an expert-parallel sub-group inside a larger world works; only members
    of the group may construct one. With the NCCL backend the object collectives stage through the current CUDA
    device, so call ``torch.cuda.set_device`` for this rank first.

    Args:
        group (torch.distributed.ProcessGroup | None): the group; None means the default (world) group.
    """

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "torch.distributed is not initialized: call torch.distributed.init_process_group(...) first, or "
                "pass an mpi4py communicator (e.g. mpi4py.MPI.COMM_WORLD) or a flashinfer_a2a.comm.Communicator"
            )
        self._dist = dist
        self.group = dist.group.WORLD if group is None else group
        self.rank: int = dist.get_rank(self.group)
        self.size: int = dist.get_world_size(self.group)
        if self.rank < 0:
            # get_rank returns -1 for a non-member; every later collective on the group would fail obscurely.
            raise ValueError(
                f"group: this process (global rank {dist.get_rank()}) is not a member of the process group"
            )

    def allgather(self, data: bytes) -> list[bytes]:
        """See :meth:`Communicator.allgather`."""
        out: list = [None] * self.size
        self._dist.all_gather_object(out, _as_blob(data), group=self.group)
        return _check_gathered(out, "allgather")

    def broadcast(self, data: Optional[bytes], root: int = 0) -> bytes:
        """See :meth:`Communicator.broadcast`; ``root`` is a rank of the group, not of the world."""
        _check_root(root, self.size)
        # broadcast_object_list takes a global rank as src on every torch version we support (group_src is newer).
        src = root if self.group is self._dist.group.WORLD else self._dist.get_global_rank(self.group, root)
        box = [_as_blob(data) if self.rank == root else None]
        self._dist.broadcast_object_list(box, src=src, group=self.group)
        return _check_broadcast(box[0], root, self.rank, data)

    def barrier(self) -> None:
        """See :meth:`Communicator.barrier`."""
        bound = getattr(self.group, "bound_device_id", None)
        if "nccl" in str(self._dist.get_backend(self.group)) and bound is None:
            import torch

            # Name the device: otherwise NCCL's barrier falls back to a guess (older torch: global rank mod device
            # count) and warns, and a wrong guess creates a second NCCL context on another rank's GPU.
            self._dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
        else:
            self._dist.barrier(group=self.group)


class MpiCommunicator:
    """A :class:`Communicator` over an mpi4py communicator (mpi4py is imported only when one is built).

    Args:
        comm (mpi4py.MPI.Comm | None): the communicator; None means ``MPI.COMM_WORLD``.
    """

    def __init__(self, comm: Any = None) -> None:
        if comm is None:
            from mpi4py import MPI  # imported here: importing mpi4py.MPI initializes MPI

            comm = MPI.COMM_WORLD
        self.comm = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()

    def allgather(self, data: bytes) -> list[bytes]:
        """See :meth:`Communicator.allgather`."""
        return _check_gathered(self.comm.allgather(_as_blob(data)), "allgather")

    def broadcast(self, data: Optional[bytes], root: int = 0) -> bytes:
        """See :meth:`Communicator.broadcast`."""
        _check_root(root, self.size)
        blob = self.comm.bcast(_as_blob(data) if self.rank == root else None, root=root)
        return _check_broadcast(blob, root, self.rank, data)

    def barrier(self) -> None:
        """See :meth:`Communicator.barrier`."""
        self.comm.Barrier()


def _is_process_group(obj: Any) -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and isinstance(obj, dist.ProcessGroup)


def as_communicator(obj: Any = None) -> Communicator:
    """The :class:`Communicator` for ``obj``.

    Args:
        obj: None (the default ``torch.distributed`` group, which must be initialized), a
            ``torch.distributed.ProcessGroup``, an mpi4py communicator, or an object implementing
            :class:`Communicator` (returned as is).

    Returns:
        Communicator: an adapter over ``obj``, or ``obj`` itself.

    Raises:
        RuntimeError: ``obj`` is None and ``torch.distributed`` is not initialized.
        TypeError: ``obj`` is none of the above.
    """
    if obj is None:
        return TorchDistributedCommunicator(None)
    # ProcessGroup and mpi4py's Comm are tested before the protocol: a ProcessGroup has rank/size/allgather/
    # broadcast/barrier methods of its own, so the structural check alone would accept it and then misuse it.
    if _is_process_group(obj):
        return TorchDistributedCommunicator(obj)
    if callable(getattr(obj, "Get_rank", None)) and callable(getattr(obj, "allgather", None)):
        return MpiCommunicator(obj)
    if isinstance(obj, Communicator) and isinstance(obj.rank, int) and isinstance(obj.size, int):
        return obj
    raise TypeError(
        f"group: expected None, a torch.distributed.ProcessGroup, an mpi4py communicator or a "
        f"flashinfer_a2a.comm.Communicator, got {type(obj).__name__}"
    )
