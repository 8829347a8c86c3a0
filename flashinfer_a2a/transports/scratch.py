"""Buffers every layer of one group and namespace shares, for transports that keep their own (the hierarchical one).

An engine builds a ``MoeAlltoAll`` per MoE layer, and the layers of one namespace take turns: one dispatch may be
pending per namespace, as on the NVLink transport's shared workspace. So they can share their send and receive
buffers, which are as large as the workspace would be. Each buffer is allocated once, at the largest size a layer
reserved, and handed out as a view of its first bytes; a call that needs more allocates a larger one and keeps the
old one alive, so a CUDA graph captured earlier still finds its buffers where it left them.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import torch

from ..memory.call_order import CallOrder

_REGISTRY: dict[Hashable, "Scratch"] = {}


class Scratch:
    """Named byte buffers on ``device``, the call order of the layers sharing them, and how many layers do."""

    def __init__(self, key: Hashable, device: torch.device) -> None:
        self.key, self.device = key, device
        self.order = CallOrder()
        self.users = 0
        self._reserved: dict[str, int] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []  # replaced buffers a captured graph may still use
        self._arange = torch.arange(0, device=device)

    def reserve(self, name: str, nbytes: int) -> None:
        """Makes buffer ``name`` at least ``nbytes`` long when it is first taken."""
        self._reserved[name] = max(self._reserved.get(name, 0), nbytes)

    def take(self, name: str, shape: Sequence[int], dtype: torch.dtype, most: int = 0) -> torch.Tensor:
        """``[*shape] dtype`` over the first bytes of buffer ``name`` (contents left from earlier calls). A new buffer
        is at least ``most`` bytes long, and at least what was reserved."""
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:
            if buffer is not None:
                self._retired.append(buffer)
            size = max(nbytes, most, self._reserved.get(name, 0))
            buffer = self._buffers[name] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buffer[:nbytes].view(dtype).view(shape)

    def arange(self, n: int) -> torch.Tensor:
        """``[0, n)`` int64 on the device: a slice of one kept range, made (eagerly) as long as ``reserve("arange",
        nbytes)`` asked."""
        if self._arange.numel() < n:
            self._retired.append(self._arange)
            self._arange = torch.arange(max(n, self._reserved.get("arange", 0) // 8), device=self.device)
        return self._arange[:n]


def acquire(key: Hashable, device: torch.device) -> Scratch:
    """The scratch of ``key`` (group, namespace, device, ...), with one more user. Pair with :func:`release`."""
    scratch = _REGISTRY.get(key)
    if scratch is None:
        scratch = _REGISTRY[key] = Scratch(key, device)
    scratch.users += 1
    return scratch


def release(scratch: Scratch) -> None:
    """One user fewer; the last one drops the buffers."""
    scratch.users -= 1
    if scratch.users <= 0 and _REGISTRY.get(scratch.key) is scratch:
        del _REGISTRY[scratch.key]
