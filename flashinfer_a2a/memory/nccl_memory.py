"""Buffers from NCCL's own allocator, for what the ``nccl`` transport's peer exchange sends and receives.

A send or receive captured in a CUDA graph on memory from ``ncclMemAlloc`` (torch's ``ProcessGroupNCCL.mem_allocator``)
is registered with NCCL at capture, and NCCL then moves the bytes straight between the two ranks' buffers instead of
through its own staging buffers. Measured with one group of sends and receives to every peer, 2026-11-27, graph
replay, µs per exchange (blocks per peer: 33.6 MB, 60.6 MB): 4×H100 340.8 -> 310.7 and 578.1 -> 540.2; 2×H100
156.5 -> 116.5 and 236.8 -> 192.6. Eager calls ran at about the same speed either way.

The buffers of one exchange must be of one kind, on every rank, sent and received alike: a group whose sends came
from this memory and whose receives went to the caching allocator's hung (4×H100, NCCL 2.28.9). The transport takes
this memory only for exchanges whose every buffer it owns.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


def nccl_pool(group: Any, device: torch.device) -> Optional[Any]:
    """A ``torch.cuda.MemPool`` on the NCCL allocator of ``group``'s backend for ``device``; None where there is none
    (a CPU device, a gloo group, a torch without ``ProcessGroupNCCL.mem_allocator``)."""
    if device.type != "cuda" or not hasattr(torch.cuda, "MemPool"):
        return None
    try:
        allocator = group._get_backend(device).mem_allocator
    except (AttributeError, RuntimeError):
        return None
    return torch.cuda.MemPool(allocator)


@contextlib.contextmanager
def allocating_from(pool: Optional[Any], device: torch.device) -> Iterator[None]:
    """New tensors on ``device`` in the block come from ``pool``; from the caching allocator where ``pool`` is None
    or a CUDA graph is being captured (whose own pool takes what the capture allocates)."""
    if pool is None or torch.cuda.is_current_stream_capturing():
        yield
        return
    with torch.cuda.use_mem_pool(pool, device=device):
        yield
