"""The workspace's layout, all read from the C++ (Python never re-derives offsets, but where a traced size must stay
symbolic): the sizes a workspace is built for (:class:`WorkspaceConfig`), its bytes per rank, the offsets of its
metadata fields and regions, and the views of a rank's receive and combine regions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Sequence

import torch

from . import ops
from .constants import MAX_EPLB_EXPERTS, MAX_PAYLOADS, check_sizes
from .wire_formats import WIRE_FORMATS, wire_format


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


_LAYOUTS: dict[tuple, tuple[int, ...]] = {}


@torch.compiler.assume_constant_result  # dynamo calls it at trace time and keeps the result as a constant
def layout_offsets(sizes: tuple[int, ...], runtime_max: int, payload_row_bytes: tuple[int, ...], quant_code: int = 0,
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
def _eplb_offset() -> int:
    """Where a rank's metadata ends and its EPLB region begins (from the C++ layout; no size moves it)."""
    return metadata_offsets()["eplb_offset"]


def traced_layout_offsets(sizes: tuple, runtime_max, payload_row_bytes: tuple, quant_code: int = 0, quant_hidden=0,
                          swizzled_scales: int = 0) -> tuple:
    """:func:`layout_offsets` while dynamo traces: any size may be symbolic there (``torch.compile(dynamic=True)`` makes
    ``runtime_max``, the row bytes, even the config's ints read from objects, SymInts), and ``_layout`` only takes
    constants. The offsets become expressions the compiled graph evaluates per call (constants where the sizes are).

    It repeats ``ComputeLayout``, ``PlanRecvRegions`` and ``ComputeRecvOffsets`` (workspace_layout.cuh,
    csrc/workspace.h): regions one after the other, each starting on 128 bytes, the EPLB region ``ep_size`` rows of
    ``MAX_EPLB_EXPERTS`` int32, the receive regions ``ep_size`` source blocks each. That copy must exist (the C++ takes ints, not expressions); tests/test_dynamic_shapes.py
    pins it to the C++ over random shapes and every wire format. The size checks run in the ops, on real sizes.
    """
    ep_size, max_tokens, top_k, dispatch_bytes, _ = sizes
    push_flags = _align128(_eplb_offset() + ep_size * MAX_EPLB_EXPERTS * 4)
    routing = _align128(push_flags + ep_size * max_tokens * 4)
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


def workspace_view(workspace: torch.Tensor, ep_rank: int, offset: int, shape: Sequence[int], dtype: torch.dtype):
    nbytes = dtype.itemsize * math.prod(shape)  # no int(): a symbolic size must stay symbolic
    return workspace[ep_rank, offset : offset + nbytes].view(dtype).view(shape)


def recv_views(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig, runtime_max_tokens_per_rank: int,
               payloads: Sequence[torch.Tensor], *, quant_format: Optional[str] = None,
               swizzled_scales: bool = False) -> list[torch.Tensor]:
    """The receive views of a dispatch of ``payloads``: per payload ``[ep_size, runtime_max, ...]`` of rank
    ``ep_rank``'s workspace, a quantized first payload as values and scales (see :func:`dispatch`). Host work only:
    the same views serve every dispatch of this shape."""
    fmt = None if quant_format is None else wire_format(quant_format, "quant_format")
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
    layout = traced_layout_offsets if torch.compiler.is_compiling() else layout_offsets
    _, *recv_offsets = layout(config.sizes(), rows_per_block, rows, *quant)
    return [workspace_view(workspace, ep_rank, off, shape, dtype) for off, (shape, dtype) in zip(recv_offsets, shapes)]


def combine_input(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig, runtime_max_tokens_per_rank: int,
                  hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The zero-copy combine input: a ``[ep_size, runtime_max, hidden]`` view of this rank's combine region.

    The expert side writes row ``[src, i]`` (the partial of the i-th token received from ``src``) straight here;
    :func:`combine` with ``partials=None`` then publishes it without a copy.

    Not for writing inside a ``torch.compile`` graph: a compiled graph writes a view of one of its inputs through a
    copy of the whole input (here the workspace, every peer's row included), so the kernels would read and publish
    the copy. There, pass the partials to :func:`combine`; :meth:`flashinfer_a2a.MoeAlltoAll.combine_input` does so
    for you (it hands a compiled graph a buffer of its own, which the combine takes as the partials).
    """
    # The combine region does not move with runtime_max (which may be symbolic while tracing).
    if torch.compiler.is_compiling():
        combine_offset = traced_layout_offsets(config.sizes(), 0, ())[0]
    else:
        combine_offset = layout_offsets(config.sizes(), runtime_max_tokens_per_rank, ())[0]
    shape = (config.ep_size, runtime_max_tokens_per_rank, hidden)
    return workspace_view(workspace, ep_rank, combine_offset, shape, dtype)


def eplb_gathered_stats(workspace: torch.Tensor, ep_rank: int, config: WorkspaceConfig,
                        eplb_stats_num_experts: int) -> torch.Tensor:
    """The EPLB statistics a dispatch with ``eplb_local_stats`` gathered on rank ``ep_rank``: a
    ``[ep_size, eplb_stats_num_experts] int32`` view of its workspace (row r: rank r's statistics, 0 for an inactive
    rank), valid until this rank's combine (a peer's next dispatch may land after it). Rows are
    ``MAX_EPLB_EXPERTS`` apart (not contiguous unless that many)."""
    rows = workspace_view(workspace, ep_rank, _eplb_offset(), (config.ep_size, MAX_EPLB_EXPERTS), torch.int32)
    return rows[:, :eplb_stats_num_experts]


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
