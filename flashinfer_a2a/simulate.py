"""Simulated ranks: ``ep_size`` ranks on one GPU, one workspace tensor, each rank's kernels on its own stream.

The kernels cannot tell this from real peers: row r of the workspace is rank r's workspace either way, and the
ranks' kernels run concurrently and meet only through the workspace signals. Used by the tests and the benchmark's
single-GPU mode.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import torch

from . import functional as F
from .errors import check_error

T = TypeVar("T")


class SimulatedRanks:
    """``ep_size`` ranks sharing one GPU.

    Args:
        config: the workspace sizes (``config.ep_size`` ranks).
        device: the GPU.
    """

    def __init__(self, config: F.WorkspaceConfig, device: torch.device | str | int = "cuda") -> None:
        self.config = config
        self.device = torch.device(device)
        self.workspace = F.empty_workspace(config.ep_size, config.bytes_per_rank, self.device)
        self.streams = [torch.cuda.Stream(self.device) for _ in range(config.ep_size)]
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        #: The SM budget each rank's dispatch gets unless the call names one: an equal share of the GPU, so that
        #: the ranks' grids run side by side instead of in turns (a rank's dispatch blocks each take a whole
        #: multiprocessor, and every rank's must have started before any can finish).
        self.dispatch_sms = max(1, sms // config.ep_size)
        self.initialize()

    @property
    def ep_size(self) -> int:
        return self.config.ep_size

    def initialize(self) -> None:
        """Initializes every rank, then waits for all: the barrier that must precede the first dispatch."""
        self.run(lambda rank: F.initialize(self.workspace, rank, self.config))

    def run(self, fn: Callable[[int], T], ranks: Optional[Sequence[int]] = None) -> list[T]:
        """Calls ``fn(rank)`` for each rank on that rank's stream (after the current stream's work), then makes
        the current stream wait for every rank's stream. With ``FLASHINFER_A2A_DEBUG`` the ranks' error records
        are checked once all ranks' calls are launched (a check after each call would stall the others)."""
        ranks = range(self.ep_size) if ranks is None else ranks
        current = torch.cuda.current_stream(self.device)
        results = []
        token = F.DEFER_DEBUG_CHECKS.set(True)
        try:
            for rank in ranks:
                stream = self.streams[rank]
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    results.append(fn(rank))
        finally:
            F.DEFER_DEBUG_CHECKS.reset(token)
        for rank in ranks:
            current.wait_stream(self.streams[rank])
        if F.debug_checks_due():
            for rank in ranks:
                check_error(self.workspace, rank)
        return results

    def dispatch(self, topk_ids: Sequence[torch.Tensor], payloads: Sequence[Sequence[torch.Tensor]],
                 runtime_max_tokens_per_rank: int, num_experts: int, **kwargs):
        """Dispatch on every rank; returns per rank ``(recv_payloads, recv_counts)``. ``num_sms`` defaults to
        :attr:`dispatch_sms`."""
        kwargs["num_sms"] = kwargs.get("num_sms") or self.dispatch_sms
        return self.run(lambda r: F.dispatch(self.workspace, r, self.config, topk_ids[r], payloads[r],
                                             runtime_max_tokens_per_rank, num_experts, **kwargs))

    def combine(self, recv_counts: Sequence[torch.Tensor], num_tokens: Sequence[int], runtime_max_tokens_per_rank: int,
                partials: Optional[Sequence[Optional[torch.Tensor]]] = None, **kwargs) -> list[torch.Tensor]:
        """Combine on every rank; ``partials[r]`` None (or no ``partials``) means rank r's zero-copy input."""
        return self.run(lambda r: F.combine(self.workspace, r, self.config, recv_counts[r], num_tokens[r],
                                            runtime_max_tokens_per_rank, None if partials is None else partials[r],
                                            **kwargs))

    def combine_input(self, rank: int, runtime_max_tokens_per_rank: int, hidden: int, dtype: torch.dtype):
        return F.combine_input(self.workspace, rank, self.config, runtime_max_tokens_per_rank, hidden, dtype)
