"""Workspace memory on one device and the byte offsets of its metadata fields, read from the C++ layout.

A module of its own so that both the functional API and the error reader use it without importing each other.
"""

from __future__ import annotations

import functools

import torch

from . import ops


def empty_workspace(ep_size: int, bytes_per_rank: int, device: torch.device | str) -> torch.Tensor:
    """An uninitialized ``[ep_size, bytes_per_rank] uint8`` workspace on one device, rows 128-byte aligned.

    For simulated ranks (all on one GPU) and for CPU tests of :func:`flashinfer_a2a.initialize`; across processes
    the workspace comes from symmetric memory instead.
    """
    if bytes_per_rank % 128:
        raise ValueError(f"bytes_per_rank must be a multiple of 128, got {bytes_per_rank}")
    flat = torch.empty(ep_size * bytes_per_rank + 128, dtype=torch.uint8, device=device)
    skip = -flat.data_ptr() % 128
    return flat[skip : skip + ep_size * bytes_per_rank].view(ep_size, bytes_per_rank)


@functools.cache
def metadata_offsets() -> dict[str, int]:
    """Byte offsets of the metadata fields (they do not depend on the workspace sizes).

    Read from the C++ layout by initializing a minimal workspace on the CPU: Python never re-derives offsets.
    """
    sizes = (1, 1, 1, 0, 0)
    workspace = empty_workspace(1, ops.get_workspace_size(*sizes), "cpu")
    metainfo = torch.empty(len(ops.METAINFO_NAMES), dtype=torch.int64)
    ops.initialize(workspace, metainfo, 0, *sizes)
    index = ops.get_metainfo_index_pairs()
    return {name: int(metainfo[int(index[i])]) for i, name in enumerate(ops.METAINFO_NAMES)}
