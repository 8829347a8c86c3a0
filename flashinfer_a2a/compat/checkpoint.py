"""Process checkpoint and restore of a shared workspace, as FlashInfer's ``MoeAlltoAll.checkpoint_prepare`` and
``checkpoint_restore(comm_backend)`` do it: the physical memory behind the workspace is released before the process
is checkpointed (a checkpoint cannot carry memory other processes map, nor the handles imported from them) and made
anew after the restore, **at the same virtual addresses**. So every tensor viewing the workspace, the cached receive
views, torch.compile graphs and captured CUDA graphs all stay valid; their contents do not: the restored workspace is
re-initialized exactly as a freshly built one (its epochs, signals and error record cleared), and rows received
before the checkpoint are gone.

Both steps are collective over the workspace's ranks and operate on the whole shared workspace (every
``MoeAlltoAll`` of it, whichever one was called). :func:`detach` refuses, on every rank, while any rank has a
dispatch pending. :func:`attach` takes a new communicator (the one used before may not survive the restore) whose
rank and size must be the old ones; the workspace's later collectives (growth, teardown) use it.

The memory itself:

- :class:`flashinfer_a2a.memory.symm_mem.SymmetricWorkspace` (CUDA virtual memory): detach unmaps every rank's range and
  releases this rank's allocation and the peers' imported handles, keeping the reserved address range; attach
  creates a new allocation, exchanges handles as the construction does, and maps every rank's into the same range.
- Any other allocation (the simulated ranks' one tensor, which no rank owns alone): the memory stays; detach
  overwrites this rank's row with :data:`POISON_BYTE` so nothing survives the checkpoint to be read by mistake.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from ..memory import cuda_driver as drv
from .. import functional as F
from ..comm import Communicator
from ..memory.fd_exchange import allgather_fds
from ..memory.lifecycle import barrier_within, bounded
from ..memory.shared_workspace import SharedWorkspace
from ..memory.call_order import CallOrder
from ..memory.symm_mem import SymmetricWorkspace

POISON_BYTE = 0xFF  # reads as NaN in bf16/fp16/fp32: a row read after detach shows up

# Workspaces between detach and attach (held here, so a detached workspace is never collected half-way).
_DETACHED: dict[int, SharedWorkspace] = {}
# The MoeAlltoAll objects of each workspace, told the new communicator at attach.
_USERS: "weakref.WeakKeyDictionary[SharedWorkspace, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def register(shared: SharedWorkspace, user: Any) -> None:
    """Records ``user`` (an object with a ``comm`` attribute) as a user of ``shared``: :func:`attach` gives it the
    new communicator."""
    _USERS.setdefault(shared, weakref.WeakSet()).add(user)


def is_detached(shared: SharedWorkspace) -> bool:
    return id(shared) in _DETACHED


def detached_like(key: tuple) -> bool:
    """Whether a detached workspace has this group key, size, rank and namespace (``key[:4]`` of a shared
    workspace's key): a layer built on it now would have to touch memory that is not there."""
    return any(shared.key[:4] == key for shared in _DETACHED.values())


def forget(shared: SharedWorkspace) -> None:
    """Drops the record of a detached workspace that was freed (its last user destroyed it)."""
    _DETACHED.pop(id(shared), None)


def check_attached(shared: SharedWorkspace, call: str) -> None:
    """RuntimeError naming ``call`` if ``shared`` is between :func:`detach` and :func:`attach`."""
    if id(shared) in _DETACHED:
        raise RuntimeError(f"MoeAlltoAll.{call}: the workspace was released by checkpoint_prepare(); call "
                           "checkpoint_restore(comm_backend) on every rank before using it again")


def _agree(comm: Communicator, error: str, timeout_s: float, what: str) -> None:
    """Every rank's ``error`` (empty: none); RuntimeError on every rank if any rank has one or a peer is gone."""
    passed, result = bounded(lambda: comm.allgather(error.encode()), timeout_s)
    if not passed:
        raise RuntimeError(f"{what}: rank {comm.rank} could not reach every peer ({result})"
                           + (f"; this rank: {error}" if error else ""))
    failed = {r: e.decode() for r, e in enumerate(result) if e}
    if failed:
        raise RuntimeError(f"{what} failed on ranks {sorted(failed)}: {failed}")


def _synchronize(shared: SharedWorkspace) -> None:
    if shared.tensor is not None and shared.tensor.is_cuda:
        torch.cuda.synchronize(shared.tensor.device)


def detach(shared: SharedWorkspace) -> None:
    """Releases the memory behind ``shared``, keeping its addresses (see the module docstring). Collective; a no-op
    on a detached workspace. RuntimeError on every rank, before anything is released, if a rank has a dispatch (or
    a split call) pending."""
    if is_detached(shared) or shared.allocation is None:
        return
    what = "MoeAlltoAll.checkpoint_prepare"
    busy = ""
    if shared.order.state != CallOrder.IDLE:
        busy = (f"rank {shared.comm.rank} has a {shared.order.state.replace('_', ' ')} step pending on this "
                "workspace: complete it (combine) first")
    _synchronize(shared)  # this rank's kernels are done before any rank releases memory they may read
    _agree(shared.comm, busy, shared.timeout_s, what)
    try:
        _release(shared)
    finally:
        _DETACHED[id(shared)] = shared  # even half released it must not be used; attach maps it again
    passed, reason = barrier_within(shared.comm, shared.timeout_s)  # no rank returns while a peer still maps it
    if not passed:
        raise RuntimeError(f"{what}: rank {shared.comm.rank} released its memory, but not every peer reached the "
                           f"barrier after it ({reason})")


def attach(shared: SharedWorkspace, comm: Communicator) -> None:
    """Maps new memory behind ``shared`` at its old addresses and re-initializes it, over ``comm`` (a communicator
    of the same rank and size, used by the workspace from now on). Collective; a no-op unless detached."""
    if not is_detached(shared):
        return
    what = "MoeAlltoAll.checkpoint_restore"
    old = shared.comm
    if (comm.rank, comm.size) != (old.rank, old.size):
        raise RuntimeError(f"{what}: comm_backend is rank {comm.rank} of {comm.size}, but the workspace was built "
                           f"by rank {old.rank} of {old.size}: pass a communicator of the same group")
    error = ""
    try:
        _remap(shared, comm)
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        error = f"{type(exc).__name__}: {exc}"
    try:
        _agree(comm, error, shared.timeout_s, what)
    except BaseException:
        _release(shared)  # back to detached on every rank: the caller may restart, nothing half mapped is left
        raise
    metainfo = F.initialize(shared.tensor, comm.rank, shared.config)
    _synchronize(shared)
    if not torch.equal(metainfo, shared.metainfo):
        raise RuntimeError(f"{what}: the re-initialized workspace's layout {metainfo.tolist()} differs from the one "
                           f"its users were built on {shared.metainfo.tolist()}")
    # Every rank initialized before any rank's next dispatch signals into it (a late initialization would erase it).
    passed, reason = barrier_within(comm, shared.timeout_s)
    if not passed:
        raise RuntimeError(f"{what}: rank {comm.rank} initialized its workspace, but not every peer reached the "
                           f"barrier after it ({reason})")
    shared.comm = comm
    for user in list(_USERS.get(shared, ())):
        user.comm = comm
    shared.pending = shared.sent = None
    shared.order.reset()
    del _DETACHED[id(shared)]


def _release(shared: SharedWorkspace) -> None:
    allocation = shared.allocation
    if isinstance(allocation, SymmetricWorkspace):
        _unmap(allocation)
    else:
        shared.tensor[shared.comm.rank].fill_(POISON_BYTE)
        _synchronize(shared)


def _remap(shared: SharedWorkspace, comm: Communicator) -> None:
    _synchronize(shared)
    if isinstance(shared.allocation, SymmetricWorkspace):
        _map(shared.allocation, comm)


def _unmap(workspace: SymmetricWorkspace) -> None:
    """Unmaps every rank's range of ``workspace`` and releases the handles; the address range stays reserved (its
    teardown frees it as usual, mapped or not)."""
    workspace._mapping.release_memory()


def _map(workspace: SymmetricWorkspace, comm: Communicator) -> None:
    """A new allocation for this rank, the peers' handles exchanged over ``comm`` (the handle type chosen at
    construction), and every rank's mapped where it was. A rank that cannot allocate still takes part in the
    exchange, which then fails on every rank instead of waiting for it."""
    m = workspace._mapping
    size, device = workspace.bytes_per_rank, workspace.device
    fabric = workspace.handle_type == drv.HANDLE_TYPE_FABRIC
    shareable, failure = None, None
    try:
        m.own = drv.mem_create(size, device, workspace.handle_type)
        shareable = drv.export_fabric(m.own) if fabric else drv.export_fd(m.own)
    except drv.CudaDriverError as exc:
        failure = exc
    if fabric:
        blobs = comm.allgather(shareable or b"")
        if failure is not None:
            raise failure
        if not all(blobs):
            raise RuntimeError(f"ranks {[r for r, b in enumerate(blobs) if not b]} could not allocate their memory")
        m.handles = [m.own if r == comm.rank else drv.import_fabric(b) for r, b in enumerate(blobs)]
    else:
        try:
            fds = allgather_fds(comm, -1 if shareable is None else shareable, timeout_s=workspace._timeout_s)
        except (ValueError, RuntimeError):
            if failure is not None:
                raise failure from None
            raise
        finally:
            if shareable is not None:
                os.close(shareable)
        try:
            for r, peer_fd in enumerate(fds):
                m.handles.append(m.own if r == comm.rank else drv.import_fd(peer_fd))
        finally:
            for peer_fd in fds:
                os.close(peer_fd)
    for r, handle in enumerate(m.handles):
        drv.map_and_enable(m.base + r * size, size, handle, device)
        m.mapped.append(r)
