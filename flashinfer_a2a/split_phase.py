"""Split-phase dispatch and combine: each call in two halves, so that other work can run between them.

``dispatch_send`` pushes this rank's tokens and signals the peers, then returns; ``dispatch_recv`` waits for the
peers' signals and writes ``recv_counts``. ``combine_send`` publishes this rank's partials; ``combine_recv`` waits for
the peers' and sums. A send holds no multiprocessor once its rows are stored, and a receive waits in one block of
256 or 512 threads, so compute queued between the halves (the other micro-batch's experts, in dual-batch overlap)
runs on the rest of the GPU. ``dispatch`` equals ``dispatch_send`` + ``dispatch_recv`` and ``combine`` equals
``combine_send`` + ``combine_recv``, bit for bit.

One workspace holds one dispatch at a time: the next dispatch overwrites its receive region. Two micro-batches in
flight at once need two workspaces (two :class:`~flashinfer_a2a.MoeAlltoAll`), one per micro-batch; their calls may
then interleave freely on one stream, e.g. send A, send B, receive A, experts A, ... Each workspace's own calls keep
their order: dispatch (or its two halves), then combine (or its two halves), then the next dispatch; and all ranks
make the same calls, halves included.

A split combine is always the pulled one (two kernels), whatever the workspace was sized for.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import functional as F
from .library import ops
from .library.checks import check_combine_tensors, check_optional_tensor

# Phase codes of the ops' ``phase`` argument, the values of DispatchPhase / CombinePhase in C++.
BOTH, SEND, RECV = 0, 1, 2


def dispatch_send(
    workspace: torch.Tensor,
    ep_rank: int,
    config: F.WorkspaceConfig,
    topk_ids: torch.Tensor,
    payloads: Sequence[torch.Tensor],
    runtime_max_tokens_per_rank: int,
    num_experts: int,
    *,
    recv_counts: Optional[torch.Tensor] = None,
    timeout_s: Optional[float] = None,
    quant_format: Optional[str] = None,
    global_scale: Optional[torch.Tensor | float] = None,
    swizzled_scales: bool = False,
    debug: Optional[bool] = None,
    num_sms: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The send half of :func:`flashinfer_a2a.functional.dispatch` (same arguments): routes and stores this rank's
    rows into the peers' workspaces and signals them, without waiting for theirs.

    Returns ``(recv_payloads, recv_counts)`` like dispatch, but neither holds this call's data until
    :func:`dispatch_recv` with the same ``recv_counts`` has run on the stream.
    """
    counts = F.launch_dispatch(workspace, ep_rank, config, topk_ids, payloads, runtime_max_tokens_per_rank,
                               num_experts, timeout_s=timeout_s, recv_counts=recv_counts, quant_format=quant_format,
                               global_scale=global_scale, swizzled_scales=swizzled_scales, debug=debug,
                               num_sms=num_sms, phase=SEND)
    views = F.recv_views(workspace, ep_rank, config, runtime_max_tokens_per_rank, payloads,
                         quant_format=quant_format, swizzled_scales=swizzled_scales)
    return views, counts


def dispatch_recv(workspace: torch.Tensor, ep_rank: int, config: F.WorkspaceConfig, recv_counts: torch.Tensor,
                  runtime_max_tokens_per_rank: int, *, timeout_s: Optional[float] = None,
                  debug: Optional[bool] = None) -> torch.Tensor:
    """The receive half: waits (bounded by ``timeout_s``) until every peer's :func:`dispatch_send` has landed and
    writes ``recv_counts`` ``[ep_size] int32`` (returned). One block of one kernel."""
    ops.dispatch_recv(workspace, recv_counts, ep_rank, *config.sizes(), runtime_max_tokens_per_rank,
                      F._timeout(timeout_s))
    F._debug_check(workspace, ep_rank, debug)
    return recv_counts


def combine_send(
    workspace: torch.Tensor,
    ep_rank: int,
    config: F.WorkspaceConfig,
    recv_counts: torch.Tensor,
    runtime_max_tokens_per_rank: int,
    partials: Optional[torch.Tensor] = None,
    *,
    hidden: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    timeout_s: Optional[float] = None,
    quant_format: Optional[str] = None,
    debug: Optional[bool] = None,
    num_sms: int = 0,
) -> None:
    """The send half of :func:`flashinfer_a2a.functional.combine`: copies ``partials`` ``[ep_size, runtime_max,
    hidden]`` into this rank's combine region (nothing to copy when None: the expert side wrote
    :func:`~flashinfer_a2a.functional.combine_input`, whose row shape ``hidden`` / ``dtype`` give), quantizes them
    for the FP8 wire if ``quant_format`` asks, and tells the peers they are there."""
    check_optional_tensor(partials, "partials")
    if partials is not None:
        hidden, dtype = partials.shape[-1], partials.dtype
    if hidden is None or dtype is None:
        raise ValueError("combine_send: pass partials, or hidden and dtype for the zero-copy combine input")
    # The send writes no output: a row-less out carries the row shape and dtype the checks and kernels need.
    out = torch.empty(0, hidden, dtype=dtype, device=workspace.device)
    F.combine(workspace, ep_rank, config, recv_counts, 0, runtime_max_tokens_per_rank, partials, out=out,
              timeout_s=timeout_s, quant_format=quant_format, debug=debug, num_sms=num_sms, phase=SEND)


def combine_recv(
    workspace: torch.Tensor,
    ep_rank: int,
    config: F.WorkspaceConfig,
    recv_counts: torch.Tensor,
    num_tokens: int,
    runtime_max_tokens_per_rank: int,
    partials: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    timeout_s: Optional[float] = None,
    quant_format: Optional[str] = None,
    debug: Optional[bool] = None,
    num_sms: int = 0,
) -> torch.Tensor:
    """The receive half: waits for every peer's :func:`combine_send`, then writes and returns ``out``
    ``[num_tokens, hidden]``, ``out[t]`` the sum over the ranks token t went to (as
    :func:`flashinfer_a2a.functional.combine`). ``partials`` and ``quant_format`` must be those of the send."""
    return F.combine(workspace, ep_rank, config, recv_counts, num_tokens, runtime_max_tokens_per_rank, partials,
                     out=out, hidden=hidden, dtype=dtype, timeout_s=timeout_s, quant_format=quant_format,
                     debug=debug, num_sms=num_sms, phase=RECV)


class CallOrder:
    """The order of one workspace's calls, checked on the host before any launch: a dispatch (whole, or send then
    receive), then its combine (whole, or send then receive), then the next dispatch.

    ``check(call)`` raises RuntimeError for a call out of order; ``advance(call)`` records it once launched.
    """

    IDLE, DISPATCH_SENT, DISPATCHED, COMBINE_SENT = "idle", "dispatch_sent", "dispatched", "combine_sent"
    # call -> (state it needs, state it leaves)
    _MOVES = {
        "dispatch": (IDLE, DISPATCHED),
        "dispatch_send": (IDLE, DISPATCH_SENT),
        "dispatch_recv": (DISPATCH_SENT, DISPATCHED),
        "combine_input": (DISPATCHED, DISPATCHED),
        "combine": (DISPATCHED, IDLE),
        "combine_send": (DISPATCHED, COMBINE_SENT),
        "combine_recv": (COMBINE_SENT, IDLE),
    }
    # What to call instead, by the state a call found.
    _HINTS = {
        IDLE: "called without a pending dispatch: call dispatch (or dispatch_send) first",
        DISPATCH_SENT: "called while a dispatch_send is pending: call dispatch_recv first",
        DISPATCHED: "called while a dispatch is pending (dispatch called twice?): call combine (or combine_send) "
                    "for it first",
        COMBINE_SENT: "called while a combine_send is pending: call combine_recv first",
    }

    def __init__(self, owner: str = "MoeAlltoAll") -> None:
        self.owner = owner
        self.state = self.IDLE

    def check(self, call: str, name: Optional[str] = None) -> None:
        """``name``: what the error calls the step (default ``call``), for steps that need what ``call`` needs."""
        if self.state != self._MOVES[call][0]:
            raise RuntimeError(f"{self.owner}.{name or call} {self._HINTS[self.state]}")

    def advance(self, call: str) -> None:
        self.check(call)
        self.state = self._MOVES[call][1]

    def reset(self) -> None:
        self.state = self.IDLE


class SplitPhaseMixin:
    """:class:`~flashinfer_a2a.MoeAlltoAll`'s split-phase calls (see this module's docstring); the class supplies
    the workspace, its settings, its :class:`CallOrder` (``_order``), ``_begin(call)``, the checks before a step,
    and its eager calls (``_eager()``, used where ``_eager_step(counts)``)."""

    def dispatch_send(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor],
                      runtime_max_tokens_per_rank: Optional[int] = None, *, timeout_s: Optional[float] = None,
                      quant_format: Optional[str] = None, global_scale: Optional[torch.Tensor | float] = None,
                      swizzled_scales: bool = False) -> None:
        """The send half of :meth:`dispatch` (same arguments). :meth:`dispatch_recv` returns what dispatch does."""
        self._begin("dispatch_send")
        runtime_max = self._runtime_max(runtime_max_tokens_per_rank)
        if self._debug and F.debug_checks_due(True):
            self._check_same_call(runtime_max)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        if torch.compiler.is_compiling():  # fresh tensors, as in dispatch
            views, counts = dispatch_send(self.workspace, self.ep_rank, self.config, topk_ids, payloads, runtime_max,
                                          self.num_experts, timeout_s=timeout_s, quant_format=quant_format,
                                          global_scale=global_scale, swizzled_scales=swizzled_scales,
                                          debug=self._debug, num_sms=self.num_sms)
        else:
            views = self._eager().dispatch(topk_ids, payloads, runtime_max, timeout_s, quant_format, global_scale,
                                           swizzled_scales, phase=SEND)
            counts = self._recv_counts
        self._pending = (topk_ids.shape[0], runtime_max, counts)
        self._sent = (views, timeout_s)
        self._calls += 1
        self._order.advance("dispatch_send")

    def dispatch_recv(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Waits for the peers' :meth:`dispatch_send` and returns ``(recv_payloads, recv_counts)``, as
        :meth:`dispatch` does."""
        self._begin("dispatch_recv")
        _, runtime_max, counts = self._pending
        views, timeout_s = self._sent
        if self._eager_step(counts):
            self._eager().dispatch_recv(runtime_max, timeout_s)
        else:
            dispatch_recv(self.workspace, self.ep_rank, self.config, counts, runtime_max, timeout_s=timeout_s,
                          debug=self._debug)
        self._sent = None
        self._order.advance("dispatch_recv")
        return views, counts

    def combine_send(self, partials: Optional[torch.Tensor] = None, *, timeout_s: Optional[float] = None,
                     quant_format: Optional[str] = None) -> None:
        """The send half of :meth:`combine` (same arguments but ``out``): publishes this rank's partials (None:
        :meth:`combine_input` was written). Keep ``partials`` unchanged until :meth:`combine_recv` has run."""
        check_optional_tensor(partials, "partials")
        self._begin("combine_send")
        _, runtime_max, counts = self._pending
        hidden, dtype = self._combine_row(None, None)
        timeout_s = self._timeout_s if timeout_s is None else timeout_s
        if self._eager_step(counts):
            self._eager().combine(partials, None, 0, hidden, dtype, runtime_max, timeout_s, quant_format, SEND)
        else:
            combine_send(self.workspace, self.ep_rank, self.config, counts, runtime_max, partials, hidden=hidden,
                         dtype=dtype, timeout_s=timeout_s, quant_format=quant_format, debug=self._debug,
                         num_sms=self.num_sms)
        self._sent = (partials, timeout_s, quant_format)
        self._order.advance("combine_send")

    def combine_recv(self, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Waits for the peers' :meth:`combine_send` and returns ``out`` ``[num_tokens, hidden]`` (allocated when
        None), as :meth:`combine` does."""
        check_combine_tensors(None, out)
        self._begin("combine_recv")
        num_tokens, runtime_max, counts = self._pending
        partials, timeout_s, quant_format = self._sent
        hidden, dtype = self._combine_row(None, None)
        if self._eager_step(counts):
            result = self._eager().combine(partials, out, num_tokens, hidden, dtype, runtime_max, timeout_s,
                                           quant_format, RECV)
        else:
            result = combine_recv(self.workspace, self.ep_rank, self.config, counts, num_tokens, runtime_max,
                                  partials, out=out, hidden=hidden, dtype=dtype, timeout_s=timeout_s,
                                  quant_format=quant_format, debug=self._debug, num_sms=self.num_sms)
        self._pending = self._sent = None
        self._order.advance("combine_recv")
        return result
