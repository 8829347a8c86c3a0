"""What :class:`flashinfer_a2a.MoeAlltoAll` asks of a transport. The object checks the arguments every transport
shares (sizes against the construction, the runtime maximum, the combine row) and delegates each step; the transport
checks the call order of its workspace, launches, and keeps what a later step needs (the pending dispatch)."""

from __future__ import annotations

from typing import Iterable, Optional, Protocol, Sequence

import torch


class Transport(Protocol):
    """One expert-parallel group's dispatch and combine. ``runtime_max`` is already checked against the
    construction's ``max_num_tokens``; ``hidden`` / ``dtype`` are the combine row; ``timeout_s`` bounds every wait."""

    device: torch.device

    def dispatch(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int, timeout_s: float,
                 quant_format: Optional[str], global_scale: Optional[torch.Tensor | float],
                 swizzled_scales: bool, eplb_local_stats: Optional[torch.Tensor] = None,
                 ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(recv_payloads, recv_counts)``: views ``[ep_size, runtime_max, ...]`` and ``[ep_size] int32``.
        ``eplb_local_stats``: carried to every active rank (nvlink only)."""

    def dispatch_send(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int,
                      timeout_s: float, quant_format: Optional[str], global_scale: Optional[torch.Tensor | float],
                      swizzled_scales: bool, eplb_local_stats: Optional[torch.Tensor] = None) -> None: ...

    @property
    def active_ranks(self) -> tuple[int, ...]:
        """The ranks taking part in the steps (flashinfer_a2a.library.active_ranks)."""

    def set_active_ranks(self, ranks: Optional[Iterable[int]], restore: bool = False) -> None:
        """The active set from the next dispatch on (nvlink only); ``restore``: every rank's collective return to
        the whole group (``ranks`` None)."""

    def dispatch_recv(self) -> tuple[list[torch.Tensor], torch.Tensor]: ...

    def combine_input(self, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """Where the experts write the pending dispatch's partials ``[ep_size, runtime_max, hidden]`` (zero copy)."""

    def combine(self, partials: Optional[torch.Tensor], out: Optional[torch.Tensor], hidden: int, dtype: torch.dtype,
                timeout_s: float, quant_format: Optional[str]) -> torch.Tensor:
        """``[num_tokens, hidden]``: each token's partials summed over the ranks it went to."""

    def combine_send(self, partials: Optional[torch.Tensor], hidden: int, dtype: torch.dtype, timeout_s: float,
                     quant_format: Optional[str], out: Optional[torch.Tensor]) -> None:
        """``out``: where :meth:`combine_recv` writes (None: there, or a new tensor)."""

    def combine_recv(self, out: Optional[torch.Tensor], hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """``out`` (the one given to :meth:`combine_send`, else a new one when None)."""

    def combine_mode(self, quant_format: Optional[str], runtime_max: Optional[int] = None) -> str:
        """``"push"`` or ``"pull"``: how :meth:`combine` with this wire moves the partials after a dispatch of
        ``runtime_max`` tokens per rank (default: the pending dispatch's, else the largest)."""

    def workspace_breakdown(self) -> str: ...

    def bind_stream(self, stream: Optional[torch.cuda.Stream]) -> None: ...

    def destroy(self) -> None:
        """Releases what the transport holds; idempotent. Later steps raise."""
