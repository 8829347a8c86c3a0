"""Functional API over an explicit workspace tensor ``[ep_size, bytes_per_rank] uint8``.

Row ``r`` of the workspace addresses rank ``r``'s workspace: on one GPU a plain tensor (simulated ranks), across
processes the peers' memory mapped into this process (symmetric memory). Each call acts as rank ``ep_rank`` and
runs on the current CUDA stream; all ranks must make the same calls in the same order with the same
``runtime_max_tokens_per_rank``: dispatch, then combine, then the next dispatch.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Optional, Sequence

import torch

from . import config as _config
from .library import ops
from .library.combine_mode import combine_mode_code
from .library.constants import MAX_EP_SIZE, MAX_PAYLOADS, MAX_TOP_K, check_sizes  # noqa: F401 - public re-exports
from .library.errors import check_error
from .library.layout import empty_workspace  # noqa: F401 - public re-export
from .library.checks import check_combine_tensors, check_dispatch_inputs, check_topk_ids_on_host
from .library.wire_formats import WIRE_FORMATS, WireFormat, check_combine_format, wire_format



@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkspaceConfig:
    """The sizes a workspace is built for, per rank. Keyword-only, every size required (no default ``top_k``: a
    wrong guess sizes the routing record for other calls than the ones made).

    Args:
        ep_size: ranks in the expert-parallel group, 1..72.
        max_num_tokens: most tokens any rank dispatches in one call (``runtime_max_tokens_per_rank`` bound).
        top_k: most experts per token, 1..32 (the routing record holds this many entries per token).
        dispatch_bytes_per_token: sum of the row bytes of every payload dispatched in one call.
        combine_bytes_per_token: bytes of one combine row (``hidden * element size``).
    """

    ep_size: int
    max_num_tokens: int
    top_k: int
    dispatch_bytes_per_token: int
    combine_bytes_per_token: int

    def __post_init__(self) -> None:
        for name in ("ep_size", "max_num_tokens", "top_k", "dispatch_bytes_per_token", "combine_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"WorkspaceConfig: {name} must be an int, got {type(value).__name__} {value!r}")
        check_sizes(*self.sizes())

    def sizes(self) -> tuple[int, int, int, int, int]:
        """The size arguments in the order every op takes them."""
        return (self.ep_size, self.max_num_tokens, self.top_k, self.dispatch_bytes_per_token,
                self.combine_bytes_per_token)

    @property
    def bytes_per_rank(self) -> int:
        return get_workspace_size(*self.sizes())


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row of a ``[num_tokens, ...]`` tensor."""
    return t.element_size() * math.prod(t.shape[1:])


@torch.compiler.assume_constant_result
def get_workspace_size(ep_size: int, max_num_tokens: int, top_k: int, dispatch_bytes_per_token: int,
                       combine_bytes_per_token: int) -> int:
    """Bytes of one rank's workspace (metadata, routing record, dispatch and combine regions).

    Memory cost: about ``ep_size * max_num_tokens * (dispatch_bytes_per_token + combine_bytes_per_token)``.
    A constant under ``torch.compile`` (host arithmetic on static sizes).
    """
    return ops.get_workspace_size(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token)


def get_metainfo_index_pairs() -> dict[str, int]:
    """Names of the metainfo entries and their index in the tensor :func:`initialize` returns."""
    index = ops.get_metainfo_index_pairs()
    return {name: int(index[i]) for i, name in enumerate(ops.METAINFO_NAMES)}


def initialize(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig) -> torch.Tensor:
    """Clears rank ``ep_rank``'s metadata (epochs, signals, error record) on the current stream.

    Every rank must initialize, then pass a barrier, before any rank dispatches. Returns the metainfo: a CPU
    ``[len(METAINFO_NAMES)] int64`` tensor of byte offsets (see :func:`get_metainfo_index_pairs`).
    """
    metainfo = torch.empty(len(ops.METAINFO_NAMES), dtype=torch.int64)
    ops.initialize(workspace, metainfo, ep_rank, *config.sizes())
    return metainfo


_LAYOUTS: dict[tuple, tuple[int, ...]] = {}


@torch.compiler.assume_constant_result  # dynamo calls it at trace time and keeps the result as a constant
def _layout(sizes: tuple[int, ...], runtime_max: int, payload_row_bytes: tuple[int, ...], quant_code: int = 0,
            quant_hidden: int = 0, swizzled_scales: int = 0) -> tuple[int, ...]:
    """``(combine_offset, *recv_offsets)`` from the C++ layout, cached per distinct call shape. Plain ints in and
    out: dynamo passes them through as constants."""
    key = (sizes, runtime_max, payload_row_bytes, quant_code, quant_hidden, swizzled_scales)
    if key not in _LAYOUTS:
        quant = (quant_code, quant_hidden, bool(swizzled_scales))
        recv_offsets, combine_offset = ops.dispatch_layout(*sizes, runtime_max, payload_row_bytes, quant)
        _LAYOUTS[key] = (combine_offset, *recv_offsets)
    return _LAYOUTS[key]


def _align128(x):
    return (x + 127) // 128 * 128


@torch.compiler.assume_constant_result
def _push_flags_offset() -> int:
    """Where a rank's metadata ends (from the C++ layout, read off a one-token CPU workspace once)."""
    if "push_flags_offset" not in _LAYOUT_CONSTANTS:
        config = WorkspaceConfig(ep_size=1, max_num_tokens=1, dispatch_bytes_per_token=0,
                                 combine_bytes_per_token=0, top_k=1)
        metainfo = initialize(empty_workspace(1, config.bytes_per_rank, "cpu"), 0, config)
        _LAYOUT_CONSTANTS["push_flags_offset"] = int(metainfo[ops.METAINFO_NAMES.index("push_flags_offset")])
    return _LAYOUT_CONSTANTS["push_flags_offset"]


_LAYOUT_CONSTANTS: dict[str, int] = {}


def _traced_layout(sizes: tuple, runtime_max, payload_row_bytes: tuple, quant_code: int = 0, quant_hidden=0,
                   swizzled_scales: int = 0) -> tuple:
    """``_layout`` while dynamo traces: any size may be symbolic there (``torch.compile(dynamic=True)`` makes
    ``runtime_max``, the row bytes, even the config's ints read from objects, SymInts), and ``_layout`` only takes
    constants. The offsets become expressions the compiled graph evaluates per call (constants where the sizes are).

    It repeats ``ComputeLayout``, ``PlanRecvRegions`` and ``ComputeRecvOffsets`` (workspace_layout.cuh,
    csrc/workspace.h): regions one after the other, each starting on 128 bytes, the receive regions ``ep_size``
    source blocks each. That copy must exist (the C++ takes ints, not expressions); tests/test_dynamic_shapes.py
    pins it to the C++ over random shapes and every wire format. The size checks run in the ops, on real sizes.
    """
    ep_size, max_tokens, top_k, dispatch_bytes, _ = sizes
    routing = _align128(_push_flags_offset() + ep_size * max_tokens * 4)
    offset = _align128(routing + max_tokens * top_k * 4)  # the dispatch region, where the first receive region is
    combine_offset = _align128(offset + ep_size * max_tokens * dispatch_bytes + MAX_PAYLOADS * 128)
    blocks = []
    for p, row in enumerate(payload_row_bytes):
        if p == 0 and quant_code:
            fmt = next(f for f in WIRE_FORMATS.values() if f.code == quant_code)
            cols = fmt.scale_cols(quant_hidden)
            blocks.append(runtime_max * fmt.value_bytes(quant_hidden))
            blocks.append((runtime_max + 127) // 128 * 128 * ((cols + 3) // 4 * 4) if swizzled_scales
                          else runtime_max * cols * fmt.scale_bytes)
        else:
            blocks.append(runtime_max * row)
    offsets = []
    for block in blocks:
        offsets.append(offset)
        offset = _align128(offset + ep_size * block)
    return (combine_offset, *offsets)


def _quant_format(name: Optional[str]) -> Optional[WireFormat]:
    return None if name is None else wire_format(name, "quant_format")


def _global_scale(global_scale, workspace: torch.Tensor) -> Optional[torch.Tensor]:
    if global_scale is None or isinstance(global_scale, torch.Tensor):
        return global_scale
    return torch.full((1,), float(global_scale), dtype=torch.float32, device=workspace.device)


def _view(workspace: torch.Tensor, ep_rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype):
    nbytes = dtype.itemsize * math.prod(shape)  # no int(): a symbolic size must stay symbolic
    return workspace[ep_rank, offset : offset + nbytes].view(dtype).view(shape)


def _timeout(timeout_s: Optional[float]) -> float:
    return _config.timeout_s() if timeout_s is None else float(timeout_s)


# Set while one process launches several ranks' calls (simulated ranks): a host sync after one rank's call would
# wait on kernels that wait on ranks not launched yet, so the debug check runs once all are launched.
DEFER_DEBUG_CHECKS = contextvars.ContextVar("flashinfer_a2a_defer_debug_checks", default=False)


def _debug(debug: Optional[bool]) -> bool:
    return _config.debug() if debug is None else debug


def _eager() -> bool:
    """Neither tracing nor capturing a CUDA graph (a torch without CUDA captures nothing)."""
    return not torch.compiler.is_compiling() and not (torch.cuda.is_available()
                                                      and torch.cuda.is_current_stream_capturing())


def debug_checks_due(debug: Optional[bool] = None) -> bool:
    """Whether the eager debug check should run now: ``debug`` (default ``FLASHINFER_A2A_DEBUG``) and an eager
    call that is neither deferred (simulated ranks) nor captured."""
    return _debug(debug) and not DEFER_DEBUG_CHECKS.get() and _eager()


def debug_check_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Debug mode, before a dispatch: its ids checked on the host, in eager calls (this waits on this rank's stream
    only, never on peers)."""
    if _eager():
        check_topk_ids_on_host(topk_ids, num_experts)


def _debug_check(workspace: torch.Tensor, ep_rank: int, debug: Optional[bool]) -> None:
    if debug_checks_due(debug):
        check_error(workspace, ep_rank)


def dispatch(
    workspace: torch.Tensor,
    ep_rank: int,
    config: WorkspaceConfig,
    topk_ids: torch.Tensor,
    payloads: Sequence[torch.Tensor],
    runtime_max_tokens_per_rank: int,
    num_experts: int,
    *,
    timeout_s: Optional[float] = None,
    quant_format: Optional[str] = None,
    global_scale: Optional[torch.Tensor | float] = None,
    swizzled_scales: bool = False,
    debug: Optional[bool] = None,
    num_sms: int = 0,
) -> tuple[list[torch.Tensor], torch.Tensor]:
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

    Returns:
        ``(recv_payloads, recv_counts)``: for each payload a zero-copy view ``[ep_size, runtime_max, ...]`` of the
        workspace (source rank major; rows ``0..recv_counts[src]-1`` valid; valid until the next dispatch), and
        ``recv_counts`` ``[ep_size] int32`` on the device.
    """
    recv_counts = launch_dispatch(workspace, ep_rank, config, topk_ids, payloads, runtime_max_tokens_per_rank,
                                  num_experts, timeout_s=timeout_s, quant_format=quant_format,
                                  global_scale=global_scale, swizzled_scales=swizzled_scales, debug=debug,
                                  num_sms=num_sms)
    views = recv_views(workspace, ep_rank, config, runtime_max_tokens_per_rank, payloads, quant_format=quant_format,
                       swizzled_scales=swizzled_scales)
    return views, recv_counts


def check_dispatch_call(topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max_tokens_per_rank: int,
                        quant_format: Optional[str] = None) -> Optional[WireFormat]:
    """The host checks of a dispatch's tensors (kinds, token counts, payload count; the C++ checks the rest) with
    errors in the caller's terms; returns the quantization format asked for."""
    check_dispatch_inputs(topk_ids, payloads)
    fmt = _quant_format(quant_format)
    if len(payloads) > MAX_PAYLOADS - (fmt is not None):
        raise ValueError(f"payloads: at most {MAX_PAYLOADS - (fmt is not None)} tensors per dispatch"
                         f"{' that quantizes' if fmt else ''}, got {len(payloads)}")
    num_tokens = topk_ids.shape[0] if topk_ids.dim() == 2 else -1
    if num_tokens < 0 or num_tokens > runtime_max_tokens_per_rank:
        raise ValueError(
            f"topk_ids must be [num_tokens, top_k] with num_tokens <= runtime_max_tokens_per_rank="
            f"{runtime_max_tokens_per_rank}, got {tuple(topk_ids.shape)}"
        )
    for i, p in enumerate(payloads):
        if p.dim() < 1 or p.shape[0] != num_tokens:
            raise ValueError(f"payloads[{i}] must be [num_tokens={num_tokens}, ...], got {tuple(p.shape)}")
    return fmt


def launch_dispatch(
    workspace: torch.Tensor,
    ep_rank: int,
    config: WorkspaceConfig,
    topk_ids: torch.Tensor,
    payloads: Sequence[torch.Tensor],
    runtime_max_tokens_per_rank: int,
    num_experts: int,
    *,
    timeout_s: Optional[float] = None,
    recv_counts: Optional[torch.Tensor] = None,
    quant_format: Optional[str] = None,
    global_scale: Optional[torch.Tensor | float] = None,
    swizzled_scales: bool = False,
    debug: Optional[bool] = None,
    num_sms: int = 0,
    phase: int = 0,
) -> torch.Tensor:
    """:func:`dispatch` without building the receive views (see :func:`recv_views`); returns ``recv_counts``,
    written into the given ``[ep_size] int32`` tensor if any. ``num_sms``: size the grid for at most this many
    multiprocessors (0: all). ``phase=1`` sends only (see :mod:`flashinfer_a2a.split_phase`)."""
    fmt = check_dispatch_call(topk_ids, payloads, runtime_max_tokens_per_rank, quant_format)
    debug = _debug(debug)
    if debug:
        debug_check_ids(topk_ids, num_experts)
    if recv_counts is None:
        recv_counts = torch.empty(config.ep_size, dtype=torch.int32, device=topk_ids.device)
    ops.dispatch(workspace, topk_ids, list(payloads), recv_counts, ep_rank, *config.sizes(),
                 runtime_max_tokens_per_rank, num_experts, _timeout(timeout_s), 0 if fmt is None else fmt.code,
                 _global_scale(global_scale, workspace), swizzled_scales, phase, num_sms)
    if debug:
        _debug_check(workspace, ep_rank, True)
    return recv_counts


def recv_views(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig, runtime_max_tokens_per_rank: int,
               payloads: Sequence[torch.Tensor], *, quant_format: Optional[str] = None,
               swizzled_scales: bool = False) -> list[torch.Tensor]:
    """The receive views of a dispatch of ``payloads``: per payload ``[ep_size, runtime_max, ...]`` of rank
    ``ep_rank``'s workspace, a quantized first payload as values and scales (see :func:`dispatch`). Host work only:
    the same views serve every dispatch of this shape."""
    fmt = _quant_format(quant_format)
    ep_size, rows_per_block = config.ep_size, runtime_max_tokens_per_rank
    shapes = [((ep_size, rows_per_block, *p.shape[1:]), p.dtype) for p in payloads]
    quant = ()
    if fmt is not None:
        hidden = payloads[0].shape[-1]
        quant = (fmt.code, hidden, int(swizzled_scales))
        scales = ((ep_size, fmt.swizzled_scale_bytes(rows_per_block, hidden)) if swizzled_scales
                  else (ep_size, rows_per_block, fmt.scale_cols(hidden)))
        shapes[:1] = [((ep_size, rows_per_block, fmt.value_bytes(hidden)), fmt.value_dtype), (scales, fmt.scale_dtype)]
    rows = tuple(row_bytes(p) for p in payloads)
    # Under dynamo any size may be symbolic, and a SymInt from a shape does not always say so to isinstance.
    layout = _traced_layout if torch.compiler.is_compiling() else _layout
    _, *recv_offsets = layout(config.sizes(), rows_per_block, rows, *quant)
    return [_view(workspace, ep_rank, off, shape, dtype) for off, (shape, dtype) in zip(recv_offsets, shapes)]


def combine_input(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig, runtime_max_tokens_per_rank: int,
                  hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The zero-copy combine input: a ``[ep_size, runtime_max, hidden]`` view of this rank's combine region.

    The expert side writes row ``[src, i]`` (the partial of the i-th token received from ``src``) straight here;
    :func:`combine` with ``partials=None`` then publishes it without a copy.
    """
    # The combine region does not move with runtime_max (which may be symbolic while tracing).
    if torch.compiler.is_compiling():
        combine_offset = _traced_layout(config.sizes(), 0, ())[0]
    else:
        combine_offset = _layout(config.sizes(), runtime_max_tokens_per_rank, ())[0]
    return _view(workspace, ep_rank, combine_offset, (config.ep_size, runtime_max_tokens_per_rank, hidden), dtype)


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


def combine(
    workspace: torch.Tensor,
    ep_rank: int,
    config: WorkspaceConfig,
    recv_counts: torch.Tensor,
    num_tokens: int,
    runtime_max_tokens_per_rank: int,
    partials: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    hidden: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    timeout_s: Optional[float] = None,
    one_gpu_per_rank: bool = False,
    quant_format: Optional[str] = None,
    combine_mode: str = "pull",
    debug: Optional[bool] = None,
    num_sms: int = 0,
    phase: int = 0,
) -> torch.Tensor:
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

    Returns:
        ``[num_tokens, hidden]``.
    """
    out = combine_output(workspace, num_tokens, partials, out, hidden, dtype)
    check_combine_format(quant_format, "combine quant_format")
    ops.combine(workspace, partials, recv_counts, out, ep_rank, *config.sizes(), runtime_max_tokens_per_rank,
                _timeout(timeout_s), one_gpu_per_rank, 0 if quant_format is None else 1,
                combine_mode_code(combine_mode), phase, num_sms)
    _debug_check(workspace, ep_rank, debug)
    return out


def sanitize_expert_ids(recv_topk_ids: torch.Tensor, recv_counts: torch.Tensor, invalid_id: int = -1) -> None:
    """Fills, in place, the rows of ``recv_topk_ids`` ``[ep_size, runtime_max, top_k] int32|int64`` at index
    ``>= recv_counts[src]`` in each source block with ``invalid_id``, so expert kernels can run on the padded shape.
    """
    ops.sanitize_expert_ids(recv_topk_ids, recv_counts, invalid_id)
