"""Symmetric memory: one workspace per rank, every rank's mapped into every rank's address space.

Each rank allocates its workspace with CUDA virtual memory management (``cuMemCreate``), exports a shareable handle,
and maps every rank's allocation into one reserved virtual range, rank r at ``r * bytes_per_rank``. The result is the
``[ep_size, bytes_per_rank] uint8`` tensor the kernels expect: row r addresses rank r's workspace.

Within one host the handles are POSIX file descriptors passed over a Unix socket with ``SCM_RIGHTS`` (no ptrace
privileges needed); across the hosts of one NVLink domain (GB200 NVL72) they are FABRIC handles. The type is chosen
collectively from every rank's capabilities, so no rank fails alone.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import torch

from . import cuda_driver as drv
from .. import config as _config
from ..comm import Communicator
from .fd_exchange import allgather_fds, host_id
from .lifecycle import bounded

NCCL_HINT = (
    "The nvlink transport needs every rank's GPU to load and store to every other's memory (NVLink or PCIe peer "
    "access). Where GPUs cannot, build MoeAlltoAll with transport='nccl': the same calls and results over the "
    "process group's NCCL collectives (transport='auto' picks it by itself when the ranks cannot share memory "
    "handles; docs/multi_node.md)."
)


def _capabilities(device: int) -> dict:
    return {
        "host": host_id(),
        "gpu": str(torch.cuda.get_device_properties(device).uuid),
        "vmm": bool(drv.device_attribute(device, drv.ATTR_VMM_SUPPORTED)),
        "fd": bool(drv.device_attribute(device, drv.ATTR_POSIX_FD_SUPPORTED)),
        "fabric": bool(drv.device_attribute(device, drv.ATTR_FABRIC_SUPPORTED)),
    }


def choose_handle_type(capabilities: list[dict]) -> int:
    """The handle type every rank can use: POSIX fds on one host, FABRIC across hosts. Raises RuntimeError with
    the reason otherwise. A pure function of the allgathered capabilities, so every rank decides alike."""
    if not all(c["vmm"] for c in capabilities):
        bad = [r for r, c in enumerate(capabilities) if not c["vmm"]]
        raise RuntimeError(f"ranks {bad} have no CUDA virtual memory management support. {NCCL_HINT}")
    one_host = len({c["host"] for c in capabilities}) == 1
    if one_host and all(c["fd"] for c in capabilities):
        return drv.HANDLE_TYPE_POSIX_FD
    if all(c["fabric"] for c in capabilities):
        return drv.HANDLE_TYPE_FABRIC
    where = "on one host without POSIX file-descriptor handles" if one_host else "on several hosts"
    raise RuntimeError(f"the ranks are {where} and not all support FABRIC handles (multi-node NVLink needs IMEX). "
                       f"{NCCL_HINT}")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

# The DLPack structs of every live workspace tensor, by address, with the mapping behind the tensor. torch calls the
# deleter when the tensor's storage dies (the last view of it included), which may be after destroy(): views kept
# by the caller or by compiled graphs keep the memory mapped until then, so using them never faults.
_LIVE_DLPACK: dict[int, object] = {}


@_DELETER
def _forget_dlpack(managed) -> None:
    entry = _LIVE_DLPACK.pop(ctypes.addressof(managed.contents), None)
    if entry is not None and entry[2] is not None:
        try:
            entry[2].release()
        except Exception as exc:  # noqa: BLE001 - a deleter cannot raise; say what was not freed
            print(f"flashinfer_a2a: releasing a symmetric workspace failed: {exc}", file=sys.stderr)


def _uint8_tensor(ptr: int, rows: int, cols: int, device: int, owner: object = None) -> torch.Tensor:
    """A CUDA uint8 tensor [rows, cols] over memory this module owns; ``owner.release()`` runs when the tensor's
    storage dies (its last view included)."""
    shape = (ctypes.c_int64 * 2)(rows, cols)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(ptr, _DLDevice(2, device), 2, _DLDataType(1, 8, 1), shape, None, 0)  # CUDA uint8
    managed.deleter = _forget_dlpack
    _LIVE_DLPACK[ctypes.addressof(managed)] = (shape, managed, owner)
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype, new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return torch.utils.dlpack.from_dlpack(new_capsule(ctypes.addressof(managed), b"dltensor", None))


class _Mapping:
    """What this process holds of a symmetric workspace: its own allocation, the peers' imported handles, the
    reserved range and the mappings in it. :meth:`release` undoes them all (idempotent)."""

    def __init__(self, device: int, bytes_per_rank: int, ep_size: int) -> None:
        self.device, self.bytes_per_rank, self.ep_size = device, bytes_per_rank, ep_size
        self.own = 0
        self.handles: list[int] = []
        self.mapped: list[int] = []
        self.base = 0

    def release(self) -> None:
        if self.mapped and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self.device)  # no kernel may still be using the range
        self.release_memory()
        if self.base:
            drv.address_free(self.base, self.bytes_per_rank * self.ep_size)
            self.base = 0

    def release_memory(self) -> None:
        """Unmaps every rank's range and releases the handles, this rank's allocation included; the reserved range
        stays (a checkpoint maps new memory there, flashinfer_a2a.compat.checkpoint)."""
        size = self.bytes_per_rank
        for r in self.mapped:
            drv.unmap(self.base + r * size, size)
        self.mapped = []
        for handle in self.handles:
            if handle != self.own:
                drv.release(handle)
        self.handles = []
        if self.own:
            drv.release(self.own)
            self.own = 0


class SymmetricWorkspace:
    """``[ep_size, bytes_per_rank]`` uint8 workspace, row r mapped to rank r's memory. Collective: every rank of
    ``comm`` constructs it together. :meth:`destroy` drops this object's reference to the mapping; the mapping goes
    (unmapped, handles released) when the last tensor viewing it dies, so a view kept past destroy() reads stale
    but mapped memory instead of faulting. A failed construction frees everything it allocated and names the ranks
    that failed.

    Args:
        comm: the ranks (see :mod:`flashinfer_a2a.comm`).
        bytes_per_rank: at least this many bytes per rank (rounded up to the allocation granularity).
        device: this rank's CUDA device (default: the current one).
        timeout_s: bound on the handle exchange with the peers (default ``FLASHINFER_A2A_TIMEOUT_S``).
    """

    def __init__(self, comm: Communicator, bytes_per_rank: int, device: int | None = None,
                 timeout_s: float | None = None) -> None:
        self.comm = comm
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.tensor: torch.Tensor | None = None
        self._timeout_s = _config.timeout_s() if timeout_s is None else timeout_s
        torch.cuda.init()
        with torch.cuda.device(self.device):
            torch.empty(1, device="cuda")  # the primary context the driver calls run in
        caps = [json.loads(b) for b in comm.allgather(json.dumps(_capabilities(self.device)).encode())]
        #: No two ranks share a GPU (GPU UUIDs are unique across hosts): what a one-kernel combine needs.
        self.one_gpu_per_rank = len({c["gpu"] for c in caps}) == len(caps)
        self.handle_type = choose_handle_type(caps)
        self._granularity = drv.granularity(self.device, self.handle_type)
        self.bytes_per_rank = -(-bytes_per_rank // self._granularity) * self._granularity
        self._mapping: _Mapping | None = _Mapping(self.device, self.bytes_per_rank, comm.size)
        try:
            self._mapping.own = drv.mem_create(self.bytes_per_rank, self.device, self.handle_type)
            self._exchange()
            error = self._map()
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            error = f"{type(exc).__name__}: {exc}"
        # Bounded: after a peer died in the exchange (which names it) this collective would otherwise wait for the
        # process group's own timeout, holding this rank's allocation all along.
        passed, result = bounded(lambda: comm.allgather(error.encode() if error else b""), self._timeout_s)
        if not passed:
            self.destroy()
            raise RuntimeError(f"symmetric memory setup failed on rank {comm.rank}: "
                               f"{error or 'this rank succeeded'}; the ranks could not compare results "
                               f"({result}). This rank's allocation was freed.")
        errors = [e.decode() for e in result]
        failed = {r: e for r, e in enumerate(errors) if e}
        if failed:
            self.destroy()
            hint = f" {NCCL_HINT}" if any("cannot map" in e for e in failed.values()) else ""
            raise RuntimeError(f"symmetric memory setup failed on ranks {sorted(failed)}: {failed}.{hint}")
        self.tensor = _uint8_tensor(self._mapping.base, comm.size, self.bytes_per_rank, self.device, self._mapping)

    def _exchange(self) -> None:
        m = self._mapping
        if self.handle_type == drv.HANDLE_TYPE_FABRIC:
            blobs = self.comm.allgather(drv.export_fabric(m.own))
            for r, b in enumerate(blobs):
                m.handles.append(m.own if r == self.comm.rank else drv.import_fabric(b))
            return
        fd = drv.export_fd(m.own)
        try:
            fds = allgather_fds(self.comm, fd, timeout_s=self._timeout_s)
        finally:
            os.close(fd)
        try:
            for r, peer_fd in enumerate(fds):
                m.handles.append(m.own if r == self.comm.rank else drv.import_fd(peer_fd))
        finally:
            for peer_fd in fds:
                os.close(peer_fd)

    def _map(self) -> str:
        m = self._mapping
        size = self.bytes_per_rank
        m.base = drv.address_reserve(size * self.comm.size, self._granularity)
        for r, handle in enumerate(m.handles):
            try:
                drv.map_and_enable(m.base + r * size, size, handle, self.device)
            except drv.CudaDriverError as exc:
                return f"cannot map rank {r}'s workspace on cuda:{self.device} ({exc})"
            m.mapped.append(r)
        return ""

    def destroy(self) -> None:
        """Drops this object's hold on the mapping: it is unmapped and released now, or, while a tensor viewing
        it is alive, when the last one dies. Idempotent; local (no collective)."""
        mapping, self._mapping = self._mapping, None
        if self.tensor is not None:
            self.tensor = None  # the deleter releases the mapping once no view is left
        elif mapping is not None:
            mapping.release()
