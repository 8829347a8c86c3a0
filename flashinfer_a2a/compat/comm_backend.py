"""FlashInfer's parallel layout and communicator shapes: ``Mapping``, ``MnnvlConfig``, the ``CommBackend`` protocol,
and the adapter that runs our bootstrap over any ``CommBackend`` with ``Get_rank``, ``Get_size`` and ``allgather``
alone (engines' backends raise ``NotImplementedError`` from ``bcast`` and ``barrier``, or lack them)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol, runtime_checkable


@runtime_checkable
class CommBackend(Protocol):
    """What FlashInfer asks of a communicator. flashinfer_a2a calls ``Get_rank``, ``Get_size``, ``allgather`` and
    ``Split`` only; ``bcast`` and ``barrier`` may be missing or raise ``NotImplementedError``."""

    def Get_rank(self) -> int: ...

    def Get_size(self) -> int: ...

    def allgather(self, data: Any) -> Any: ...

    def Split(self, color: int, key: int) -> "CommBackend": ...


@dataclasses.dataclass
class MnnvlConfig:
    """FlashInfer's memory configuration. Only ``comm_backend`` is used; the allocation granularity and fabric page
    size come from the driver here (the workspace is mapped with the granularity CUDA reports)."""

    comm_backend: Optional[Any] = None
    allocation_granularity: int = 0
    fabric_page_size: int = 1 << 29


class Mapping:
    """The parallel layout FlashInfer's ``MoeAlltoAll`` reads: ``moe_ep_rank`` and ``moe_ep_size``, and the ranks
    that pick the communicator's sub-group (``pp_rank * cp_size + cp_rank`` as color, ``tp_rank`` as key).

    Same constructor as FlashInfer's (``world_size, rank, gpus_per_node`` positionally, the rest by keyword), same
    derived sizes: unset MoE sizes default to pure tensor parallelism, and ``tp_size * pp_size * cp_size`` must
    equal ``world_size``, ``moe_tp_size * moe_ep_size * moe_cluster_size`` must equal ``tp_size``.
    """

    def __init__(self, world_size: int = 1, rank: int = 0, gpus_per_node: int = 8, *, cp_size: int = 1,
                 cp_config: Optional[dict] = None, tp_size: int = 1, pp_size: int = 1, moe_cluster_size: int = -1,
                 moe_tp_size: int = -1, moe_ep_size: int = -1, attn_tp_size: int = -1, attn_cp_size: int = -1,
                 auto_parallel: bool = False, enable_attention_dp: bool = False) -> None:
        moe_cluster_size = 1 if moe_cluster_size == -1 else moe_cluster_size
        if moe_tp_size == -1 and moe_ep_size == -1:
            moe_tp_size, moe_ep_size = tp_size // moe_cluster_size, 1
        elif moe_tp_size == -1:
            moe_tp_size = tp_size // (moe_ep_size * moe_cluster_size)
        elif moe_ep_size == -1:
            moe_ep_size = tp_size // (moe_tp_size * moe_cluster_size)
        if attn_tp_size == -1 and attn_cp_size == -1:
            attn_tp_size, attn_cp_size = tp_size * cp_size, 1
        elif attn_tp_size == -1:
            attn_tp_size = cp_size * tp_size // attn_cp_size
        elif attn_cp_size == -1:
            attn_cp_size = cp_size * tp_size // attn_tp_size
        if not auto_parallel and tp_size * pp_size * cp_size != world_size:
            raise ValueError(f"Mapping: world_size={world_size} must equal tp_size * pp_size * cp_size = "
                             f"{tp_size} * {pp_size} * {cp_size}")
        if moe_tp_size * moe_ep_size * moe_cluster_size != tp_size:
            raise ValueError(f"Mapping: tp_size={tp_size} must equal moe_tp_size * moe_ep_size * moe_cluster_size = "
                             f"{moe_tp_size} * {moe_ep_size} * {moe_cluster_size}")
        if not isinstance(rank, int) or not (enable_attention_dp or 0 <= rank < max(world_size, 1)):
            raise ValueError(f"Mapping: rank must be an int in [0, {world_size}), got {rank!r}")
        self.world_size, self.rank, self.gpus_per_node = world_size, rank, gpus_per_node
        self.tp_size, self.pp_size, self.cp_size = tp_size, pp_size, cp_size
        self.cp_config = {} if cp_config is None else cp_config
        self.moe_tp_size, self.moe_ep_size, self.moe_cluster_size = moe_tp_size, moe_ep_size, moe_cluster_size
        self.attn_tp_size, self.attn_cp_size = attn_tp_size, attn_cp_size
        self.auto_parallel, self.enable_attention_dp = auto_parallel, enable_attention_dp

    @property
    def tp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank // (self.tp_size * self.cp_size)

    @property
    def cp_rank(self) -> int:
        return 0 if self.auto_parallel else self.rank % (self.tp_size * self.cp_size) // self.tp_size

    @property
    def moe_ep_rank(self) -> int:
        return self.tp_rank % self.moe_ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank // (self.moe_ep_size * self.moe_cluster_size)

    @property
    def local_rank(self) -> int:
        return self.rank % self.gpus_per_node

    def __repr__(self) -> str:
        return (f"Mapping(world_size={self.world_size}, rank={self.rank}, tp_size={self.tp_size}, "
                f"pp_size={self.pp_size}, cp_size={self.cp_size}, moe_ep_size={self.moe_ep_size}, "
                f"moe_tp_size={self.moe_tp_size})")


class CommBackendCommunicator:
    """Our bootstrap protocol (:class:`flashinfer_a2a.comm.Communicator`) over a FlashInfer ``CommBackend``, built
    on ``allgather`` alone: ``broadcast`` is an allgather that keeps the root's blob, ``barrier`` an allgather of
    nothing (no rank returns before every rank has contributed)."""

    def __init__(self, backend: Any) -> None:
        for method in ("Get_rank", "Get_size", "allgather"):
            if not callable(getattr(backend, method, None)):
                raise TypeError(f"comm_backend: {type(backend).__name__} has no {method}(); a FlashInfer CommBackend "
                                "needs Get_rank, Get_size and allgather")
        self.backend = backend
        self.rank: int = int(backend.Get_rank())
        self.size: int = int(backend.Get_size())
        # One workspace per (group size, rank, namespace) in the process, as FlashInfer caches its workspaces: the
        # engines build a fresh backend object per layer over the same group.
        self.workspace_group_key = getattr(backend, "workspace_group_key", ("flashinfer-compat",))
        # A backend may allocate the workspace itself, as a communicator may (flashinfer_a2a.memory.shared_workspace):
        # simulated ranks do.
        if callable(getattr(backend, "allocate_workspace", None)):
            self.allocate_workspace = backend.allocate_workspace

    def allgather(self, data: bytes) -> list[bytes]:
        blobs = list(self.backend.allgather(bytes(data)))
        if len(blobs) != self.size:
            raise RuntimeError(f"comm_backend.allgather returned {len(blobs)} items for a group of {self.size}")
        return [bytes(b) for b in blobs]

    def broadcast(self, data: Optional[bytes], root: int = 0) -> bytes:
        if not 0 <= root < self.size:
            raise ValueError(f"broadcast: root must be in [0, {self.size}), got {root}")
        return self.allgather(bytes(data) if self.rank == root and data is not None else b"")[root]

    def barrier(self) -> None:
        self.allgather(b"")


class TorchDistBackend:
    """A ``CommBackend`` over a ``torch.distributed`` process group (default: the world), for callers that have
    none. ``Split`` creates every sub-group on every rank (``new_group`` must be called collectively); ranks within a
    sub-group are ordered by their global rank, as ``torch.distributed.new_group`` orders them, not by ``key``."""

    def __init__(self, group: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("TorchDistBackend: call torch.distributed.init_process_group first")
        self._dist, self.group = dist, group

    def Get_rank(self) -> int:
        return self._dist.get_rank(self.group)

    def Get_size(self) -> int:
        return self._dist.get_world_size(self.group)

    def allgather(self, data: Any) -> list:
        out: list = [None] * self.Get_size()
        self._dist.all_gather_object(out, data, group=self.group)
        return out

    def bcast(self, data: Any, root: int) -> Any:
        return self.allgather(data if self.Get_rank() == root else None)[root]

    def barrier(self) -> None:
        self.allgather(None)

    def Split(self, color: int, key: int) -> "TorchDistBackend":
        world_rank = self._dist.get_rank()
        seen = self.allgather((int(color), int(key), world_rank))
        mine = None
        for c in sorted({c for c, _, _ in seen}):
            members = sorted(r for cc, _, r in seen if cc == c)
            group = self._dist.new_group(members)  # every rank creates every group, in the same order
            if c == color:
                mine = group
        return TorchDistBackend(mine)
