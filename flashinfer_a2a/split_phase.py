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

On a single stream the halves hide the wait for the peers, not the transfer: the send kernel stores the rows itself.
With ``comm_stream`` (a :class:`~flashinfer_a2a.transports.overlap.CommStream`, one per rank) the send half queues
the send and the receive kernels on that stream after the caller's work so far and returns, and the receive half
makes the caller's stream wait for them (:mod:`flashinfer_a2a.transports.overlap`): the work queued in between runs
beside the transfer. The combine's output is then written by the send half, so ``combine_send`` takes ``out``.

Under ``torch.compile`` a half with ``comm_stream`` runs outside the graph (a graph break; ``fullgraph=True`` refuses
it): inductor may hand the communication stream's kernels buffers whose memory it gives to the next computation
before the transfer has read them, which in-graph stream switches cannot prevent. The graphs between the halves (the
experts) are compiled as usual; the halves are the eager calls, bit for bit the serial step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence

import torch

from . import config as _config
from . import functional as F
from .library import ops
from .library.checks import check_combine_tensors
from .library.constants import SPLIT_RECV, SPLIT_SEND
from .library.errors import debug_check
from .transports.overlap import CommStream


def _eager_with_comm_stream(half: Callable[..., Any]) -> Callable[..., Any]:
    """``half``, run outside any ``torch.compile`` graph when given a ``comm_stream`` (see the module's docstring)."""
    outside = torch._dynamo.disable(half)

    @functools.wraps(half)
    def call(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("comm_stream") is not None and torch.compiler.is_compiling():
            return outside(*args, **kwargs)
        return half(*args, **kwargs)

    return call


@_eager_with_comm_stream
def dispatch_send(workspace: torch.Tensor, ep_rank: int, config: F.WorkspaceConfig, topk_ids: torch.Tensor,
                  payloads: Sequence[torch.Tensor], runtime_max_tokens_per_rank: int, num_experts: int, *,
                  recv_counts: Optional[torch.Tensor] = None, timeout_s: Optional[float] = None,
                  quant_format: Optional[str] = None, global_scale: Optional[torch.Tensor | float] = None,
                  swizzled_scales: bool = False, debug: Optional[bool] = None, num_sms: int = 0,
                  comm_stream: Optional[CommStream] = None,
                  eplb_local_stats: Optional[torch.Tensor] = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The send half of :func:`flashinfer_a2a.functional.dispatch` (same arguments): routes and stores this rank's
    rows into the peers' workspaces and signals them, without waiting for theirs. With ``comm_stream``: the send
    and the receive kernels, queued on that stream after the current stream's work.

    Returns ``(recv_payloads, recv_counts)`` like dispatch, but neither holds this call's data until
    :func:`dispatch_recv` with the same ``recv_counts`` (and ``comm_stream``) has run on the stream.
    """
    timeout_s = _config.timeout_or_default(timeout_s)
    launch = None if comm_stream is None else comm_stream.op(ops.dispatch)
    counts = F.dispatch_counts(workspace, ep_rank, config, topk_ids, payloads, runtime_max_tokens_per_rank,
                               num_experts, timeout_s=timeout_s, recv_counts=recv_counts, quant_format=quant_format,
                               global_scale=global_scale, swizzled_scales=swizzled_scales, debug=debug,
                               num_sms=num_sms, phase=SPLIT_SEND, launch=launch, eplb_local_stats=eplb_local_stats)
    if comm_stream is not None:  # the receive follows the send on the communication stream
        comm_stream.op(ops.dispatch_recv)(workspace, counts, ep_rank, *config.sizes(), runtime_max_tokens_per_rank,
                                          timeout_s)
    views = F.recv_views(workspace, ep_rank, config, runtime_max_tokens_per_rank, payloads,
                         quant_format=quant_format, swizzled_scales=swizzled_scales)
    return views, counts


@_eager_with_comm_stream
def dispatch_recv(workspace: torch.Tensor, ep_rank: int, config: F.WorkspaceConfig, recv_counts: torch.Tensor,
                  runtime_max_tokens_per_rank: int, *, timeout_s: Optional[float] = None,
                  debug: Optional[bool] = None, comm_stream: Optional[CommStream] = None) -> torch.Tensor:
    """The receive half: waits (bounded by ``timeout_s``) until every peer's :func:`dispatch_send` has landed and
    writes ``recv_counts`` ``[ep_size] int32`` (returned). One block of one kernel. With ``comm_stream`` (the
    send's): the current stream waits for the transfer the send queued there (``timeout_s`` was the send's)."""
    if comm_stream is not None:
        comm_stream.join(workspace, recv_counts)
        return recv_counts
    ops.dispatch_recv(workspace, recv_counts, ep_rank, *config.sizes(), runtime_max_tokens_per_rank,
                      _config.timeout_or_default(timeout_s))
    debug_check(workspace, ep_rank, debug)
    return recv_counts


@_eager_with_comm_stream
def combine_send(workspace: torch.Tensor, ep_rank: int, config: F.WorkspaceConfig, recv_counts: torch.Tensor,
                 runtime_max_tokens_per_rank: int, partials: Optional[torch.Tensor] = None, *,
                 hidden: Optional[int] = None, dtype: Optional[torch.dtype] = None, timeout_s: Optional[float] = None,
                 quant_format: Optional[str] = None, debug: Optional[bool] = None, num_sms: int = 0,
                 out: Optional[torch.Tensor] = None,
                 comm_stream: Optional[CommStream] = None) -> Optional[torch.Tensor]:
    """The send half of :func:`flashinfer_a2a.functional.combine`: copies ``partials`` ``[ep_size, runtime_max,
    hidden]`` into this rank's combine region (nothing to copy when None: the expert side wrote
    :func:`~flashinfer_a2a.functional.combine_input`, whose row shape ``hidden`` / ``dtype`` give), quantizes them
    for the FP8 wire if ``quant_format`` asks, and tells the peers they are there.

    With ``comm_stream``: the send and the receive kernels, queued on that stream after the current stream's work,
    write ``out`` ``[num_tokens, hidden]`` (required), which is returned; :func:`combine_recv` with the same
    ``comm_stream`` and ``out`` makes the current stream wait for it. Without, returns None."""
    check_combine_tensors(partials, out)
    if comm_stream is None and out is not None:
        raise ValueError("combine_send: out is the receive half's argument without a comm_stream")
    if comm_stream is not None and out is None:
        raise ValueError("combine_send with a comm_stream needs out [num_tokens, hidden]: the receive kernel runs "
                         "on the communication stream with the send")
    if partials is not None:
        hidden, dtype = partials.shape[-1], partials.dtype
    elif out is not None:
        hidden, dtype = out.shape[-1], out.dtype
    if hidden is None or dtype is None:
        raise ValueError("combine_send: pass partials, or hidden and dtype for the zero-copy combine input")
    launch = None if comm_stream is None else comm_stream.op(ops.combine)
    # The send writes no output: a row-less out carries the row shape and dtype the checks and kernels need.
    rowless = torch.empty(0, hidden, dtype=dtype, device=workspace.device)
    F.combine(workspace, ep_rank, config, recv_counts, 0, runtime_max_tokens_per_rank, partials, out=rowless,
              timeout_s=timeout_s, quant_format=quant_format, debug=debug, num_sms=num_sms, phase=SPLIT_SEND,
              launch=launch)
    if comm_stream is None:
        return None
    return F.combine(workspace, ep_rank, config, recv_counts, out.shape[0], runtime_max_tokens_per_rank, partials,
                     out=out, timeout_s=timeout_s, quant_format=quant_format, debug=debug, num_sms=num_sms,
                     phase=SPLIT_RECV, launch=launch)


@_eager_with_comm_stream
def combine_recv(workspace: torch.Tensor, ep_rank: int, config: F.WorkspaceConfig, recv_counts: torch.Tensor,
                 num_tokens: int, runtime_max_tokens_per_rank: int, partials: Optional[torch.Tensor] = None, *,
                 out: Optional[torch.Tensor] = None, hidden: Optional[int] = None, dtype: Optional[torch.dtype] = None,
                 timeout_s: Optional[float] = None, quant_format: Optional[str] = None, debug: Optional[bool] = None,
                 num_sms: int = 0, comm_stream: Optional[CommStream] = None) -> torch.Tensor:
    """The receive half: waits for every peer's :func:`combine_send`, then writes and returns ``out``
    ``[num_tokens, hidden]``, ``out[t]`` the sum over the ranks token t went to (as
    :func:`flashinfer_a2a.functional.combine`). ``partials`` and ``quant_format`` must be those of the send. With
    ``comm_stream`` (the send's): the current stream waits for the transfer the send queued, which wrote ``out``
    (the send's, required); returns it."""
    if comm_stream is not None:
        check_combine_tensors(None, out)
        if out is None:
            raise ValueError("combine_recv with a comm_stream needs the out given to combine_send")
        comm_stream.join(workspace, out)
        return out
    return F.combine(workspace, ep_rank, config, recv_counts, num_tokens, runtime_max_tokens_per_rank, partials,
                     out=out, hidden=hidden, dtype=dtype, timeout_s=timeout_s, quant_format=quant_format,
                     debug=debug, num_sms=num_sms, phase=SPLIT_RECV)
