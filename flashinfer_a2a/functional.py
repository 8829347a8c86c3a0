"""Functional API over an explicit workspace tensor ``[ep_size, bytes_per_rank] uint8``.

Row ``r`` of the workspace addresses rank ``r``'s workspace: on one GPU a plain tensor (simulated ranks), across
processes the peers' memory mapped into this process (symmetric memory). Each call acts as rank ``ep_rank`` and
runs on the current CUDA stream; all ranks must make the same calls in the same order with the same
``runtime_max_tokens_per_rank``: dispatch, then combine, then the next dispatch.
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import torch

from . import config as _config
from .library import active_ranks, ops
from .library.checks import check_combine_tensors, check_dispatch_call, global_scale_tensor
from .library.combine_mode import combine_mode_code
from .library.constants import MAX_EP_SIZE, MAX_PAYLOADS, MAX_TOP_K  # noqa: F401 - public re-exports
from .library.errors import check_error, debug_check, debug_check_ids, debug_enabled  # noqa: F401 - check_error too
from .library.constants import MAX_EPLB_EXPERTS  # noqa: F401 - public re-export
from .library.layout import (  # noqa: F401 - public re-exports
    WorkspaceConfig,
    combine_input,
    empty_workspace,
    eplb_gathered_stats,
    get_metainfo_index_pairs,
    get_workspace_size,
    initialize,
    recv_views,
    row_bytes,
)
from .library.wire_formats import check_combine_format


def dispatch(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig, topk_ids: torch.Tensor,
             payloads: Sequence[torch.Tensor], runtime_max_tokens_per_rank: int, num_experts: int, *,
             timeout_s: Optional[float] = None, quant_format: Optional[str] = None,
             global_scale: Optional[torch.Tensor | float] = None, swizzled_scales: bool = False,
             debug: Optional[bool] = None, num_sms: int = 0, one_gpu_per_rank: bool = False,
             eplb_local_stats: Optional[torch.Tensor] = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Sends each local token to every distinct rank that owns one of its top-k experts.

    Args:
        workspace: ``[ep_size, bytes_per_rank] uint8``, row r addressing rank r's workspace.
        ep_rank: this rank.
        config: the sizes the workspace was built for.
        topk_ids: ``[num_tokens, top_k] int32|int64``; -1 means no expert; num_tokens <= runtime_max.
        payloads: up to 8 tensors ``[num_tokens, ...]`` of any dtype, each row copied unchanged.
        runtime_max_tokens_per_rank: rows per source rank on the receive side; the same on every rank.
        num_experts: experts over all ranks (contiguous partition, the first ``num_experts % ep_size`` ranks own
            one extra).
        timeout_s: bound on the wait for peers (default ``FLASHINFER_A2A_TIMEOUT_S``).
        debug: check the ids on the host before the launch and the error record after it, in eager calls (default
            ``FLASHINFER_A2A_DEBUG``; slow).
        quant_format: quantize ``payloads[0]`` (``[num_tokens, hidden]`` bf16|fp16 hidden states) while sending it:
            ``"fp8_block"``, ``"mxfp8"`` or ``"nvfp4"`` (:mod:`flashinfer_a2a.library.wire_formats`), bitwise as the
            reference quantizers of :mod:`flashinfer_a2a.reference.quant`. It then arrives as two views: values
            ``[ep_size, runtime_max, value_bytes]`` and scales.
        global_scale: NVFP4 only (required): the per-tensor fp32 scale, a one-element device tensor (or a float).
        swizzled_scales: mxfp8 / nvfp4 scales in the 128x4-tile layout Blackwell block-scaled GEMMs read, one tile
            grid per source block: ``[ep_size, ceil(runtime_max / 128) * 128 * ceil(cols / 4) * 4]``; otherwise
            ``[ep_size, runtime_max, cols]`` row-major (``cols = ceil(hidden / block)``). Scales of rows past
            ``recv_counts`` are unspecified; padding columns of valid rows are 0.
        num_sms: size the grid for at most this many multiprocessors (0: all), leaving the rest to other work.
        one_gpu_per_rank: promise that no two ranks share a GPU (true across processes, false for simulated ranks):
            the kernel then lets the stream's next kernel launch early, as combine's do.
        eplb_local_stats: ``[n] int32`` (``1 <= n <= MAX_EPLB_EXPERTS``) EPLB statistics of this rank, carried to every
            active rank inside the dispatch: afterwards :func:`eplb_gathered_stats` with ``n`` holds every rank's.

    Tokens routed to the experts of ranks outside the active set (:func:`set_active_ranks`) are not sent.

    Returns:
        ``(recv_payloads, recv_counts)``: for each payload a zero-copy view ``[ep_size, runtime_max, ...]`` of the
        workspace (source rank major; rows ``0..recv_counts[src]-1`` valid; valid until the next dispatch), and
        ``recv_counts`` ``[ep_size] int32`` on the device.
    """
    recv_counts = dispatch_counts(workspace, ep_rank, config, topk_ids, payloads, runtime_max_tokens_per_rank,
                                  num_experts, timeout_s=timeout_s, quant_format=quant_format,
                                  global_scale=global_scale, swizzled_scales=swizzled_scales, debug=debug,
                                  num_sms=num_sms, one_gpu_per_rank=one_gpu_per_rank,
                                  eplb_local_stats=eplb_local_stats)
    views = recv_views(workspace, ep_rank, config, runtime_max_tokens_per_rank, payloads, quant_format=quant_format,
                       swizzled_scales=swizzled_scales)
    return views, recv_counts


def dispatch_counts(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig, topk_ids: torch.Tensor,
                    payloads: Sequence[torch.Tensor], runtime_max_tokens_per_rank: int, num_experts: int, *,
                    timeout_s: Optional[float] = None, recv_counts: Optional[torch.Tensor] = None,
                    quant_format: Optional[str] = None, global_scale: Optional[torch.Tensor | float] = None,
                    swizzled_scales: bool = False, debug: Optional[bool] = None, num_sms: int = 0,
                    phase: int = 0, one_gpu_per_rank: bool = False,
                    launch: Optional[Callable[..., None]] = None,
                    eplb_local_stats: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`dispatch` without building the receive views (see :func:`recv_views`); returns ``recv_counts``,
    written into the given ``[ep_size] int32`` tensor if any. ``num_sms``: size the grid for at most this many
    multiprocessors (0: all). ``phase=1`` sends only (see :mod:`flashinfer_a2a.split_phase`). ``one_gpu_per_rank``:
    as for :func:`dispatch`. ``launch``: what launches the op (default :func:`flashinfer_a2a.library.ops.dispatch`;
    a communication stream's form, :meth:`flashinfer_a2a.transports.overlap.CommStream.op`)."""
    fmt = check_dispatch_call(topk_ids, payloads, runtime_max_tokens_per_rank, quant_format)
    debug = debug_enabled(debug)
    if debug:
        debug_check_ids(topk_ids, num_experts)
    if recv_counts is None:
        recv_counts = torch.empty(config.ep_size, dtype=torch.int32, device=topk_ids.device)
    # `launch is None`, not `launch or ops.dispatch`: dynamo (torch 2.11) cannot take the truth of a function
    # made inside the traced code (CommStream.op's).
    (ops.dispatch if launch is None else launch)(
        workspace, topk_ids, list(payloads), recv_counts, ep_rank, *config.sizes(), runtime_max_tokens_per_rank,
        num_experts, _config.timeout_or_default(timeout_s), 0 if fmt is None else fmt.code,
        global_scale_tensor(global_scale, workspace), swizzled_scales, phase, num_sms, one_gpu_per_rank,
        eplb_local_stats)
    if debug:
        debug_check(workspace, ep_rank, True)
    return recv_counts


def combine_output(workspace: torch.Tensor, num_tokens: int, partials: Optional[torch.Tensor],
                   out: Optional[torch.Tensor], hidden: Optional[int], dtype: Optional[torch.dtype]) -> torch.Tensor:
    """A combine's output: ``out`` checked to be ``[num_tokens, hidden]`` (the kernels take its rows as the token
    count), or a new one; the row shape comes from ``partials``, else ``out``, else ``hidden`` and ``dtype``."""
    check_combine_tensors(partials, out)
    if partials is not None:
        hidden, dtype = partials.shape[-1], partials.dtype
    elif out is not None:
        hidden, dtype = out.shape[-1], out.dtype
    if hidden is None or dtype is None:
        raise ValueError("combine: pass partials, out, or hidden and dtype for the zero-copy combine input")
    if out is None:
        return torch.empty(num_tokens, hidden, dtype=dtype, device=workspace.device)
    if tuple(out.shape) != (num_tokens, hidden):
        raise ValueError(f"out must be [num_tokens={num_tokens}, hidden={hidden}], got {tuple(out.shape)}")
    return out


def combine(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig, recv_counts: torch.Tensor, num_tokens: int,
            runtime_max_tokens_per_rank: int, partials: Optional[torch.Tensor] = None, *,
            out: Optional[torch.Tensor] = None, hidden: Optional[int] = None, dtype: Optional[torch.dtype] = None,
            timeout_s: Optional[float] = None, one_gpu_per_rank: bool = False, quant_format: Optional[str] = None,
            combine_mode: str = "pull", debug: Optional[bool] = None, num_sms: int = 0, phase: int = 0,
            launch: Optional[Callable[..., None]] = None) -> torch.Tensor:
    """Sums, for each local token, the partials of the distinct ranks it was sent to.

    ``out[t] = sum over ranks r (increasing) of partial(t, r)``, accumulated in fp32 and cast to the output dtype:
    bitwise reproducible whatever the arrival order.

    Args:
        recv_counts: ``[ep_size] int32`` from the matching dispatch.
        num_tokens: local tokens of the matching dispatch.
        runtime_max_tokens_per_rank: as passed to the matching dispatch.
        partials: ``[ep_size, runtime_max, hidden] bf16|fp16|fp32`` expert outputs (row ``[src, i]`` for the i-th
            token received from src), or None when they were written into :func:`combine_input` (zero copy).
        out: optional ``[num_tokens, hidden]`` output of the partials' dtype.
        hidden, dtype: the combine row shape when neither ``partials`` nor ``out`` gives it.
        one_gpu_per_rank: promise that no two ranks share a GPU (true across processes, false for simulated ranks).
            A small zero-copy combine runs as one kernel whose blocks all wait for the peers, a launch fewer: with
            the promise while a block per multiprocessor (up to 32 warps) gives every piece of the pull a warp.
            Without it only with a grid small enough that the waiting blocks of all ``ep_size`` ranks together
            leave a multiprocessor free, so a peer on the same GPU can always run what it still has to, each warp
            pulling up to 4 pieces; larger pulls use the two-kernel combine.
        combine_mode: ``"pull"`` (default): every rank publishes its partials and each token's owner loads and sums
            them. ``"push"``: each rank stores its partials into their owners' workspaces and the owners sum them
            as they land; needs ``one_gpu_per_rank`` and ``config.combine_bytes_per_token`` with room for a landing
            row per token after the partials (:func:`flashinfer_a2a.library.wire_formats.push_combine_bytes_per_token`),
            else ``ValueError`` before any launch. The mode is never inferred from the sizes: every rank of a call
            must pass the same one.
        quant_format: ``"fp8_block"``: the partials for other ranks cross NVLink as FP8 E4M3 with an fp32 scale per
            128 elements (quantized on the rank that computed them, over the front of their rows in the combine
            region, or on the way when pushed; dequantized and summed in fp32 by the token's owner; a rank's own
            partials stay exact). About half the bytes; the error is documented in ``docs/quantized_formats.md``
            and equals :func:`flashinfer_a2a.reference.quant.reference_combine_fp8` bit for bit. bf16|fp16,
            ``hidden % 8 == 0``.
        debug: check the error record after an eager call (default ``FLASHINFER_A2A_DEBUG``; slow).
        num_sms: size the grids for at most this many multiprocessors (0: all).
        phase: 0 the whole combine; 1 send, 2 receive (:mod:`flashinfer_a2a.split_phase`; always pulled).
        launch: what launches the op (default :func:`flashinfer_a2a.library.ops.combine`; a communication stream's
            form, :meth:`flashinfer_a2a.transports.overlap.CommStream.op`).

    Returns:
        ``[num_tokens, hidden]``.
    """
    out = combine_output(workspace, num_tokens, partials, out, hidden, dtype)
    check_combine_format(quant_format, "combine quant_format")
    (ops.combine if launch is None else launch)(  # not `launch or ...`: see dispatch_counts
        workspace, partials, recv_counts, out, ep_rank, *config.sizes(), runtime_max_tokens_per_rank,
        _config.timeout_or_default(timeout_s), one_gpu_per_rank, 0 if quant_format is None else 1,
        combine_mode_code(combine_mode), phase, num_sms)
    debug_check(workspace, ep_rank, debug)
    return out


def launch_dispatch(*args, **kwargs) -> torch.Tensor:
    """The former name of :func:`dispatch_counts` (C++ has a ``LaunchDispatch`` of its own); it goes in the next
    release."""
    warnings.warn("flashinfer_a2a.functional.launch_dispatch is now dispatch_counts; the old name goes in the next "
                  "release", DeprecationWarning, stacklevel=2)
    return dispatch_counts(*args, **kwargs)


def sanitize_expert_ids(recv_topk_ids: torch.Tensor, recv_counts: torch.Tensor, invalid_id: int = -1) -> None:
    """Fills, in place, the rows of ``recv_topk_ids`` ``[ep_size, runtime_max, top_k] int32|int64`` at index
    ``>= recv_counts[src]`` in each source block with ``invalid_id``, so expert kernels can run on the padded shape.
    """
    ops.sanitize_expert_ids(recv_topk_ids, recv_counts, invalid_id)


def set_active_ranks(workspace: torch.Tensor, ep_rank: int, ep_size: int, ranks: Optional[Sequence[int]]) -> None:
    """Makes ``ranks`` (None: every rank) the active set of rank ``ep_rank``'s steps from the next dispatch on, on the
    current stream (:mod:`flashinfer_a2a.library.active_ranks`): tokens routed to the experts of other ranks are not
    sent, and no kernel signals or waits for them. Call it between a combine and the next dispatch, on every active
    rank alike. A rank that comes back must first take the epoch of the ranks that stayed
    (:func:`flashinfer_a2a.library.active_ranks.write_epoch`; :meth:`flashinfer_a2a.MoeAlltoAll.set_active_ranks`
    does so)."""
    active_ranks.write_inactive(workspace, ep_rank, active_ranks.inactive_bits(ranks, ep_size, ep_rank))
