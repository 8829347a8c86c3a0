"""Simulated ranks that build :class:`flashinfer_a2a.MoeAlltoAll` objects as real ranks do: one thread per rank for
the collective construction, one workspace tensor on one device for all of them.

:class:`flashinfer_a2a.testing.simulate.SimulatedRanks` drives the functional API; this drives the object API (and the
FlashInfer compatibility layer on top of it) unchanged: each rank's communicator implements the bootstrap protocol
between threads and hands every rank the same ``[ep_size, bytes_per_rank]`` tensor instead of symmetric memory
(see :mod:`flashinfer_a2a.memory.shared_workspace`). After construction one thread may drive every rank's object,
each on its own stream, as :meth:`SimulatedRanks.run` does: the kernels meet only through the workspace.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, TypeVar

import torch

from .. import functional as F

T = TypeVar("T")


class _Allocation:
    """One rank's handle on the shared simulated workspace (the interface ``allocate_workspace`` returns)."""

    one_gpu_per_rank = False  # every rank on one device: no push, and a one-kernel combine only while it fits

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: Optional[torch.Tensor] = tensor
        self.bytes_per_rank = tensor.shape[1]

    def destroy(self) -> None:
        self.tensor = None


class SimulatedGroup:
    """``ep_size`` simulated ranks on ``device`` (a GPU, or ``"cpu"`` for host-side tests of construction).

    Attributes:
        allocations: workspace tensors allocated so far, over all namespaces.
    """

    def __init__(self, ep_size: int, device: torch.device | str | int = "cuda", timeout_s: float = 120.0) -> None:
        if ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {ep_size}")
        self.size = ep_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._barrier = threading.Barrier(ep_size, timeout=timeout_s)
        self._slots: list[Any] = [None] * ep_size
        self._live: dict[int, torch.Tensor] = {}
        self.allocations = 0

    def communicator(self, rank: int) -> "SimulatedCommunicator":
        return SimulatedCommunicator(self, rank)

    def live_bytes(self) -> int:
        """Bytes of the workspace tensors still held by some rank."""
        return sum(t.numel() for t in self._live.values())

    def run(self, fn: Callable[[int, "SimulatedCommunicator"], T]) -> list[T]:
        """Calls ``fn(rank, communicator)`` in one thread per rank and returns the results by rank; an exception in
        any rank is raised here (after the others were released from their barriers)."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                results[rank] = fn(rank, self.communicator(rank))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"simulated-rank-{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self._barrier.reset()
            first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
            raise first
        return results

    def _exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out

    def _allocate(self, rank: int, bytes_per_rank: int) -> _Allocation:
        tensor = None
        if rank == 0:
            tensor = F.empty_workspace(self.size, bytes_per_rank, self.device)
            self._live[id(tensor)] = tensor
            self.allocations += 1
        tensor = self._exchange(rank, tensor)[0]
        group = self

        class _Owned(_Allocation):
            def destroy(self) -> None:
                if rank == 0 and self.tensor is not None:
                    group._live.pop(id(self.tensor), None)
                super().destroy()

        return _Owned(tensor)


class SimulatedCommunicator:
    """Rank ``rank`` of a :class:`SimulatedGroup`: the bootstrap protocol between threads."""

    def __init__(self, group: SimulatedGroup, rank: int) -> None:
        self.group, self.rank, self.size = group, rank, group.size
        self.workspace_group_key = ("simulated", id(group))

    def allgather(self, data: bytes) -> list[bytes]:
        return self.group._exchange(self.rank, bytes(data))

    def broadcast(self, data: Optional[bytes], root: int = 0) -> bytes:
        return self.group._exchange(self.rank, data)[root]

    def barrier(self) -> None:
        self.group._barrier.wait()

    def allocate_workspace(self, bytes_per_rank: int, device: Optional[int] = None) -> _Allocation:
        return self.group._allocate(self.rank, bytes_per_rank)

    def comm_backend(self) -> "SimulatedCommBackend":
        """This rank as a FlashInfer ``CommBackend`` (for :mod:`flashinfer_a2a.compat.flashinfer`)."""
        return SimulatedCommBackend(self)


class SimulatedCommBackend:
    """FlashInfer's ``CommBackend`` shape over a :class:`SimulatedCommunicator` (``Get_rank``, ``Get_size``,
    ``allgather``, ``Split``; no ``bcast`` or ``barrier``, like some engines' backends), with the simulated
    allocation, so the compatibility layer runs on simulated ranks unchanged. A separate class: an object with
    ``Get_rank`` is taken for an mpi4py communicator by :func:`flashinfer_a2a.comm.as_communicator`."""

    def __init__(self, comm: SimulatedCommunicator) -> None:
        self.comm = comm
        self.workspace_group_key = comm.workspace_group_key
        self.allocate_workspace = comm.allocate_workspace

    def Get_rank(self) -> int:
        return self.comm.rank

    def Get_size(self) -> int:
        return self.comm.size

    def allgather(self, data: bytes) -> list[bytes]:
        return self.comm.allgather(data)

    def Split(self, color: int, key: int) -> "SimulatedCommBackend":
        return self
