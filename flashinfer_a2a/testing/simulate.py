"""Simulated ranks: ``ep_size`` ranks on one GPU, one workspace tensor, each rank's kernels on its own stream.

The kernels cannot tell this from real peers: row r of the workspace is rank r's workspace either way, and the
ranks' kernels run concurrently and meet only through the workspace signals. Used by the tests and the benchmark's
single-GPU mode. Captured into a CUDA graph, every step runs as its two halves (every rank's send before any rank's
receive), so that the graph completes whatever order its branches run in.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, TypeVar

import torch

from .. import functional as F
from .. import split_phase
from ..library.errors import DEFER_DEBUG_CHECKS, check_error, debug_checks_due

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
        token = DEFER_DEBUG_CHECKS.set(True)
        try:
            for rank in ranks:
                stream = self.streams[rank]
                stream.wait_stream(current)
                with torch.cuda.stream(stream):
                    results.append(fn(rank))
        finally:
            DEFER_DEBUG_CHECKS.reset(token)
        for rank in ranks:
            current.wait_stream(self.streams[rank])
        if debug_checks_due():
            for rank in ranks:
                check_error(self.workspace, rank)
        return results

    def dispatch(self, topk_ids: Sequence[torch.Tensor], payloads: Sequence[Sequence[torch.Tensor]],
                 runtime_max_tokens_per_rank: int, num_experts: int, **kwargs):
        """Dispatch on every rank; returns per rank ``(recv_payloads, recv_counts)``. ``num_sms`` defaults to
        :attr:`dispatch_sms`. Captured into a CUDA graph, as every rank's send half, then every rank's receive half
        (see :meth:`_captured`)."""
        kwargs["num_sms"] = kwargs.get("num_sms") or self.dispatch_sms
        if not self._captured():
            return self.run(lambda r: F.dispatch(self.workspace, r, self.config, topk_ids[r], payloads[r],
                                                 runtime_max_tokens_per_rank, num_experts, **kwargs))
        sent = self.run(lambda r: split_phase.dispatch_send(self.workspace, r, self.config, topk_ids[r], payloads[r],
                                                            runtime_max_tokens_per_rank, num_experts, **kwargs))
        self.run(lambda r: split_phase.dispatch_recv(self.workspace, r, self.config, sent[r][1],
                                                     runtime_max_tokens_per_rank, timeout_s=kwargs.get("timeout_s"),
                                                     debug=kwargs.get("debug")))
        return sent

    def combine(self, recv_counts: Sequence[torch.Tensor], num_tokens: Sequence[int], runtime_max_tokens_per_rank: int,
                partials: Optional[Sequence[Optional[torch.Tensor]]] = None, **kwargs) -> list[torch.Tensor]:
        """Combine on every rank; ``partials[r]`` None (or no ``partials``) means rank r's zero-copy input. Captured
        into a CUDA graph, as every rank's send half, then every rank's receive half (always pulled, the same sums
        bit for bit; see :meth:`_captured`)."""
        def part(r: int) -> Optional[torch.Tensor]:
            return None if partials is None else partials[r]

        if not self._captured():
            return self.run(lambda r: F.combine(self.workspace, r, self.config, recv_counts[r], num_tokens[r],
                                                runtime_max_tokens_per_rank, part(r), **kwargs))
        kwargs = {k: v for k, v in kwargs.items() if k not in ("combine_mode", "one_gpu_per_rank")}
        out = kwargs.pop("out", None)
        if out is not None:
            kwargs.setdefault("hidden", out.shape[-1])
            kwargs.setdefault("dtype", out.dtype)
        self.run(lambda r: split_phase.combine_send(self.workspace, r, self.config, recv_counts[r],
                                                    runtime_max_tokens_per_rank, part(r), **kwargs))
        return self.run(lambda r: split_phase.combine_recv(self.workspace, r, self.config, recv_counts[r],
                                                           num_tokens[r], runtime_max_tokens_per_rank, part(r),
                                                           out=out, **kwargs))

    @staticmethod
    def _captured() -> bool:
        """Whether the calls are being captured into a CUDA graph. A graph does not promise to run its independent
        branches at the same time, and a one-kernel dispatch or combine waits inside the kernel for the peers':
        replays of 5 to 8 ranks' one-kernel steps waited for a peer whose branch had not started, until the
        timeout. Captured as halves, no kernel waits for one that runs beside it: every send (which waits for
        nothing) comes before any receive."""
        return torch.cuda.is_current_stream_capturing()

    def combine_input(self, rank: int, runtime_max_tokens_per_rank: int, hidden: int, dtype: torch.dtype):
        return F.combine_input(self.workspace, rank, self.config, runtime_max_tokens_per_rank, hidden, dtype)
