"""The libraries flashinfer_a2a builds. Each source is listed by hand: adding a .cu file is a reviewed change."""

from __future__ import annotations

import functools

import tvm_ffi

from . import toolchain
from .spec import JitSpec

#: Sources of ``flashinfer_a2a_ops``, relative to ``csrc/``; ``a2a_binding.cu`` holds every exported function.
A2A_SOURCES = ("a2a_binding.cu", "workspace.cu", "dispatch.cu", "combine.cu", "nccl.cu")


def gen_a2a_module() -> JitSpec:
    """The spec of ``flashinfer_a2a_ops``, the one library holding every exported function."""
    csrc = toolchain.csrc_dir()
    return JitSpec(name="flashinfer_a2a_ops", sources=tuple(csrc / s for s in A2A_SOURCES))


def all_specs() -> list[JitSpec]:
    """Every library of the package: what aot.py builds and a wheel ships."""
    return [gen_a2a_module()]


@functools.cache
def get_a2a_module() -> tvm_ffi.Module:
    """The loaded ``flashinfer_a2a_ops`` (AOT, else JIT-built on first call); one load per process."""
    return gen_a2a_module().load()
