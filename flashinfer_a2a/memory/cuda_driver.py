"""The few CUDA driver calls symmetric memory needs (virtual memory management), through ctypes.

ctypes instead of a compiled binding: these calls run once per workspace, and libcuda.so.1 is present wherever a
GPU is, so nothing extra is installed or built for them.
"""

from __future__ import annotations

import ctypes
import functools

# Values from cuda.h (CUDA 12/13).
HANDLE_TYPE_POSIX_FD = 0x1
HANDLE_TYPE_FABRIC = 0x8
ATTR_VMM_SUPPORTED = 102
ATTR_POSIX_FD_SUPPORTED = 103
ATTR_FABRIC_SUPPORTED = 128
_ALLOCATION_TYPE_PINNED = 0x1
_LOCATION_TYPE_DEVICE = 0x1
_ACCESS_READWRITE = 0x3
_GRANULARITY_RECOMMENDED = 0x1
FABRIC_HANDLE_BYTES = 64


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; ``code`` is the CUresult."""

    def __init__(self, call: str, code: int, message: str) -> None:
        super().__init__(f"{call} failed: CUresult {code} ({message})")
        self.call, self.code = call, code


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    _check(lib, "cuInit", lib.cuInit(0))
    return lib


def _check(lib: ctypes.CDLL, call: str, result: int) -> None:
    if result != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(text))
        raise CudaDriverError(call, result, (text.value or b"unknown").decode())


def _call(name: str, *args) -> None:
    lib = _lib()
    _check(lib, name, getattr(lib, name)(*args))


def device_attribute(device: int, attribute: int) -> int:
    value = ctypes.c_int()
    _call("cuDeviceGetAttribute", ctypes.byref(value), attribute, device)
    return value.value


def _prop(device: int, handle_type: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = handle_type
    prop.location = _Location(_LOCATION_TYPE_DEVICE, device)
    return prop


def granularity(device: int, handle_type: int) -> int:
    value = ctypes.c_size_t()
    prop = _prop(device, handle_type)
    _call("cuMemGetAllocationGranularity", ctypes.byref(value), ctypes.byref(prop), _GRANULARITY_RECOMMENDED)
    return value.value


def mem_create(size: int, device: int, handle_type: int) -> int:
    handle = ctypes.c_uint64()
    prop = _prop(device, handle_type)
    _call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop), ctypes.c_ulonglong(0))
    return handle.value


def export_fd(handle: int) -> int:
    fd = ctypes.c_int()
    _call("cuMemExportToShareableHandle", ctypes.byref(fd), ctypes.c_uint64(handle), HANDLE_TYPE_POSIX_FD,
          ctypes.c_ulonglong(0))
    return fd.value


def export_fabric(handle: int) -> bytes:
    data = (ctypes.c_ubyte * FABRIC_HANDLE_BYTES)()
    _call("cuMemExportToShareableHandle", ctypes.byref(data), ctypes.c_uint64(handle), HANDLE_TYPE_FABRIC,
          ctypes.c_ulonglong(0))
    return bytes(data)


def import_fd(fd: int) -> int:
    handle = ctypes.c_uint64()
    _call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd), HANDLE_TYPE_POSIX_FD)
    return handle.value


def import_fabric(data: bytes) -> int:
    handle = ctypes.c_uint64()
    buffer = (ctypes.c_ubyte * FABRIC_HANDLE_BYTES).from_buffer_copy(data)
    _call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.byref(buffer), HANDLE_TYPE_FABRIC)
    return handle.value


def address_reserve(size: int, alignment: int) -> int:
    ptr = ctypes.c_uint64()
    _call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(alignment),
          ctypes.c_uint64(0), ctypes.c_ulonglong(0))
    return ptr.value


def map_and_enable(ptr: int, size: int, handle: int, device: int) -> None:
    _call("cuMemMap", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(handle),
          ctypes.c_ulonglong(0))
    desc = _AccessDesc(_Location(_LOCATION_TYPE_DEVICE, device), _ACCESS_READWRITE)
    _call("cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1))


def unmap(ptr: int, size: int) -> None:
    _call("cuMemUnmap", ctypes.c_uint64(ptr), ctypes.c_size_t(size))


def release(handle: int) -> None:
    _call("cuMemRelease", ctypes.c_uint64(handle))


def address_free(ptr: int, size: int) -> None:
    _call("cuMemAddressFree", ctypes.c_uint64(ptr), ctypes.c_size_t(size))
