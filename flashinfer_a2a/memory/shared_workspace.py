"""Shared, growable workspaces: every :class:`flashinfer_a2a.MoeAlltoAll` of one expert-parallel group and
namespace uses one symmetric workspace, so GPU memory does not grow with the number of MoE layers.

The shared workspace is sized for the union of its users' needs (the maximum of each size of
:class:`flashinfer_a2a.functional.WorkspaceConfig`). A layer that needs more grows it: every rank builds its layers
in the same order with the same sizes, so every rank takes the same decision and the growth is collective (device
sync, barrier, reallocation or re-initialization, barrier). Growth invalidates earlier receive views and CUDA graphs
captured before it: build every layer, then capture.

A separate ``namespace`` (a draft model, graphs that may be live at the same time as others) gets a workspace of its
own. One dispatch may be pending per shared workspace: a second dispatch before its combine raises, on any layer.

A communicator may provide ``allocate_workspace(bytes_per_rank, device)`` returning an object with ``tensor``
(``[ep_size, bytes] uint8``), ``bytes_per_rank``, ``one_gpu_per_rank`` and ``destroy()``; otherwise the workspace is
:class:`flashinfer_a2a.memory.symm_mem.SymmetricWorkspace`. Simulated ranks
(:mod:`flashinfer_a2a.testing.simulated_group`) use it to hand every rank one tensor on one device. It may also
provide ``workspace_group_key``, a hashable naming its group (the FlashInfer compatibility layer builds one communicator per layer over the same group).
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from ..library import active_ranks, layout
from ..comm import Communicator
from .call_order import CallOrder, StreamOrder
from .lifecycle import barrier_within, release_workspace
from ..library.sizing import union
from .symm_mem import SymmetricWorkspace


class SharedWorkspace:
    """One workspace of one group and namespace, with the state its users share. Built by :func:`acquire`."""

    def __init__(self, key: tuple, comm: Communicator, group: Any, namespace: str, device: Optional[int],
                 timeout_s: float) -> None:
        self.key, self.comm, self.namespace, self.device_index = key, comm, namespace, device
        self.timeout_s = timeout_s  # bounds every barrier here: a dead peer is named, never waited for forever
        self._group = group  # held so that the id in the key cannot be reused by another group while we live
        self.config: Optional[layout.WorkspaceConfig] = None
        self.allocation: Any = None
        self.tensor: Optional[torch.Tensor] = None
        self.metainfo: Optional[torch.Tensor] = None
        #: (num_tokens, runtime_max, recv_counts) of the dispatch awaiting its combine, whichever layer made it.
        self.pending: Optional[tuple[int, int, torch.Tensor]] = None
        #: the calls' order (dispatch or its halves, then combine or its halves), and what a split call's receive
        #: half needs from its send.
        self.order = CallOrder()
        self.sent: Optional[tuple] = None
        #: while torch.compile traces: the buffer combine_input handed out for the pending dispatch, which the
        #: combine then takes as its partials (flashinfer_a2a.transports.nvlink)
        self.traced_input: Optional[torch.Tensor] = None
        #: each user's eager calls (flashinfer_a2a.transports.nvlink_eager, with its receive views), by the user's
        #: instance number; cleared when the workspace moves.
        self.eager_calls: dict[int, Any] = {}
        #: bitmask of the ranks outside the active set (flashinfer_a2a.library.active_ranks), also in this rank's
        #: metadata, where the kernels read it
        self.inactive = 0
        self.users = 0
        self.allocations = 0  # how many times memory was allocated (tests and logs)
        #: orders every user's steps across streams (they share the epochs and the pending dispatch)
        self.stream: Optional[StreamOrder] = None

    def reserve(self, config: layout.WorkspaceConfig) -> bool:
        """Makes the workspace fit ``config`` too; returns whether it changed. Collective when it changes (every
        rank reserves the same configs in the same order)."""
        if config.ep_size != self.comm.size:
            raise ValueError(f"config.ep_size={config.ep_size} differs from the group's size {self.comm.size}")
        want = config if self.config is None else union(self.config, config)
        if want == self.config:
            return False
        if self.pending is not None:
            raise RuntimeError("cannot grow the shared workspace while a dispatch is pending: call combine first")
        bytes_needed = want.bytes_per_rank
        if self.allocation is not None:
            self._quiesce()  # no rank may still use the old layout
            if bytes_needed > self.allocation.bytes_per_rank:
                self._free()
        if self.allocation is None:
            self.allocation = self._allocate(bytes_needed)
            self.allocations += 1
        self.tensor = self.allocation.tensor
        if self.stream is None:
            self.stream = StreamOrder(self.tensor.device)
        self.eager_calls.clear()
        try:
            self.metainfo = layout.initialize(self.tensor, self.comm.rank, want)
            if self.inactive:  # initialize cleared it with the rest of the metadata
                active_ranks.write_inactive(self.tensor, self.comm.rank, self.inactive)
            self._quiesce("initialized its workspace")  # every rank initialized before any rank dispatches
        except BaseException:
            self._free()  # a failed construction or growth keeps nothing
            self.config = None
            raise
        self.config = want
        return True

    @property
    def one_gpu_per_rank(self) -> bool:
        return bool(self.allocation.one_gpu_per_rank)

    def _allocate(self, bytes_per_rank: int) -> Any:
        allocate = getattr(self.comm, "allocate_workspace", None)
        if allocate is not None:
            return allocate(bytes_per_rank, self.device_index)
        return SymmetricWorkspace(self.comm, bytes_per_rank, self.device_index, self.timeout_s)

    def _quiesce(self, done: str = "stopped using its workspace") -> None:
        """This rank's kernels finished, then a barrier bounded by the timeout (RuntimeError naming the reason)."""
        if self.tensor is not None and self.tensor.is_cuda:
            torch.cuda.synchronize(self.tensor.device)
        passed, reason = barrier_within(self.comm, self.timeout_s)
        if not passed:
            raise RuntimeError(f"MoeAlltoAll: rank {self.comm.rank} {done}, but not every peer reached the barrier "
                               f"after it ({reason})")

    def _free(self) -> None:
        self.eager_calls.clear()
        self.tensor = None
        if self.allocation is not None:
            self.allocation.destroy()
            self.allocation = None

    def close(self) -> None:
        """Frees this rank's mappings after a device sync and a barrier bounded by the timeout; if a peer is gone,
        alone, with a warning (see :func:`flashinfer_a2a.memory.lifecycle.release_workspace`). Receive views kept past
        this keep the memory mapped until they die. Collective while the peers live."""
        if self.allocation is None:
            return
        release_workspace(self._free, self.comm, self.tensor.device, self.timeout_s)
        self.config = self.metainfo = self.pending = self.sent = self.traced_input = None
        self.order.reset()


_REGISTRY: dict[tuple, SharedWorkspace] = {}


def group_key(group: Any, comm: Communicator) -> Hashable:
    """What identifies ``comm``'s group in this process: the communicator's ``workspace_group_key`` if it has one,
    else the group object passed to :class:`flashinfer_a2a.MoeAlltoAll` (None: the default group)."""
    own = getattr(comm, "workspace_group_key", None)
    if own is not None:
        return own
    return ("default",) if group is None else ("object", id(group))


def acquire(comm: Communicator, group: Any, namespace: str, config: layout.WorkspaceConfig,
            device: Optional[int] = None, timeout_s: float = 10.0) -> SharedWorkspace:
    """The shared workspace of ``(group, namespace, device)``, made to fit ``config`` (created or grown
    collectively), with one more user. Pair with :func:`release`."""
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")
    if device is None and torch.cuda.is_available():
        device = torch.cuda.current_device()
    key = (group_key(group, comm), comm.size, comm.rank, namespace, device)
    shared = _REGISTRY.get(key)
    if shared is None:
        shared = SharedWorkspace(key, comm, group, namespace, device, timeout_s)
        shared.reserve(config)  # raises before anything is registered
        _REGISTRY[key] = shared
    else:
        shared.reserve(config)
    shared.users += 1
    return shared


def release(shared: SharedWorkspace) -> None:
    """One user fewer; the last one frees the memory (collective: every rank releases in the same order)."""
    shared.users -= 1
    if shared.users > 0:
        return
    if _REGISTRY.get(shared.key) is shared:
        del _REGISTRY[shared.key]
    shared.close()


def live_workspaces() -> list[SharedWorkspace]:
    """The shared workspaces of this process that have users (for tests and memory reports)."""
    return list(_REGISTRY.values())
