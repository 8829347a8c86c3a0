"""The ``nccl`` transport: dispatch and combine over the collectives of a ``torch.distributed`` process group.

One-sided NVLink needs every rank to map every peer's memory (one NVLink domain). Past that edge this transport runs
the same contract (DESIGN.md §2, :mod:`flashinfer_a2a.reference`) over whatever backend the group has: NCCL across
nodes, gloo on CPU (where CI runs it). Receive layout, receive order, ``recv_counts`` and combine's ordered fp32 sum
are those of the NVLink path, so a bf16 result equals it bit for bit.

Two modes:

- **padded** (default, no host synchronisation, CUDA-graph capturable, traceable by ``torch.compile``: while tracing
  the collectives are the functional ones and every result a fresh tensor,
  :mod:`flashinfer_a2a.transports.nccl_traced`). Dispatch: quantize ``payloads[0]`` if asked,
  pack each token's destination bitmask and payload bytes into a ``[runtime_max, row_bytes]`` send buffer, one
  ``all_gather_into_tensor`` (``all_gather_single`` in torch 2.13), then keep, per source block, the rows whose
  bitmask names this rank, in increasing token order (a stable argsort of the mask and a gather). Combine: one
  ``all_to_all_single`` of the ``[ep_size, runtime_max, hidden]`` combine region (optionally as FP8 with block
  scales), then each token's partials summed in increasing rank order in fp32.
- **exact** (eager only). Dispatch: the per-destination counts go first (one small ``all_to_all_single`` and a host
  synchronisation), then a variable-size ``all_to_all_single`` moves only the routed rows; combine returns only
  those rows. For large prefill batches, where padding every rank to ``runtime_max`` moves too many bytes.

Bytes each rank sends (``B`` = dispatch row bytes, ``H`` = combine row bytes, ``R`` = runtime_max, ``n`` = local
tokens, ``m`` = (token, remote destination) pairs of this rank, ``P = ep_size``):

============================  ============================================  ===========================
                              dispatch                                      combine
============================  ============================================  ===========================
padded (this module)          ``(P - 1) * R * (B + ceil(P / 8))``           ``(P - 1) * R * H``
exact (this module)           ``m * B`` (+ ``P`` counts)                    ``m * H``
NCCL ``all_to_all_single``    ``m * B`` (+ the counts an engine exchanges)  ``m * H``
all-gather + reduce-scatter   ``(P - 1) * n * B``                           ``(P - 1) * n * H``
============================  ============================================  ===========================

The padded dispatch moves what all-gather moves (every token to every rank), padded to ``R``; its combine what
reduce-scatter moves. A wire format (``fp8_block``, ``mxfp8``, ``nvfp4``) shrinks ``B``; the FP8 combine shrinks
``H`` to about half. ``docs/multi_node.md`` has the numbers at the DeepSeek-V3 shape.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Optional, Sequence

import torch

from ..library.checks import check_combine_tensors, check_dispatch_inputs, check_topk_ids_on_host
from ..library.errors import eager_call
from ..library.wire_formats import WireFormat, check_combine_format, wire_format
from ..reference import quant
from . import nccl_traced as traced

TRANSPORTS = ("auto", "nvlink", "nccl")
MAX_TOP_K = 32
MAX_PAYLOADS = 8
_ID_DTYPES = (torch.int32, torch.int64)
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------------------------ transport choice


def check_transport(transport: str, exact: bool = False) -> None:
    """ValueError naming ``transport`` unless it is one of :data:`TRANSPORTS`, or ``exact`` without ``nccl``."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if exact and transport != "nccl":
        raise ValueError(f"exact=True needs transport='nccl', got transport={transport!r}")


def resolve_transport(comm: Any, transport: str, device: Any = None) -> str:
    """``"nvlink"`` or ``"nccl"``. ``auto`` picks ``nvlink`` when every rank can map every peer's memory (one host
    with CUDA VMM and POSIX fd handles, or FABRIC handles everywhere), else ``nccl``. Collective for ``auto`` on a
    GPU (one allgather of the ranks' capabilities, decided alike by every rank); a CPU device means ``nccl``."""
    if transport != "auto":
        return transport
    if getattr(comm, "allocate_workspace", None) is not None:  # it hands out the workspace (simulated ranks)
        return "nvlink"
    if _is_cpu(device) or not torch.cuda.is_available():
        return "nccl"
    import json

    from ..memory import symm_mem

    index = torch.cuda.current_device() if device is None else torch.device("cuda", device).index
    caps = [json.loads(b) for b in comm.allgather(json.dumps(symm_mem._capabilities(index)).encode())]
    try:
        symm_mem.choose_handle_type(caps)
    except RuntimeError as exc:
        _say_fallback(comm, str(exc).removesuffix(symm_mem.NCCL_HINT).strip())
        return "nccl"
    return "nvlink"


_fallback_said = False


def _say_fallback(comm: Any, reason: str) -> None:
    """A warning, once per process and on rank 0 only, that ``auto`` fell back from NVLink to NCCL on GPUs.

    Once: an engine builds a ``MoeAlltoAll`` per MoE layer, and every one decides alike. Only on GPUs: on a CPU
    device ``nccl`` is the only transport there is, not a fallback.
    """
    global _fallback_said
    if _fallback_said or getattr(comm, "rank", 0) != 0:
        return
    _fallback_said = True
    warnings.warn(f"flashinfer_a2a: transport='auto' runs over NCCL (the process group's collectives), not "
                  f"one-sided NVLink: {reason} Pass transport='nccl' to choose it explicitly and silence this.",
                  stacklevel=3)


def _is_cpu(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def process_group_of(comm: Any) -> Any:
    """The ``torch.distributed`` process group behind a communicator (TypeError if it has none)."""
    group = getattr(comm, "group", None)
    if group is None:
        raise TypeError(f"transport='nccl' moves tensors through a torch.distributed process group; got "
                        f"{type(comm).__name__}, which has none (pass the process group, not an mpi4py communicator)")
    return group


# ----------------------------------------------------------------------------------------------- local routing


def rank_mask(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """``[num_tokens, ep_size] bool``: which ranks own one of each token's experts. An id of -1 is skipped; so is
    any id outside ``[0, num_experts)`` (debug mode reports those on the host before the call)."""
    base, rem = divmod(num_experts, ep_size)
    ranks = torch.arange(ep_size, device=topk_ids.device)
    first = ranks * base + torch.clamp(ranks, max=rem)  # first expert of each rank (contiguous partition)
    ids = topk_ids.to(torch.int64)
    owner = torch.searchsorted(first, ids, right=True) - 1  # last rank whose first expert <= id
    valid = (ids >= 0) & (ids < num_experts)
    column = torch.where(valid, owner, torch.full_like(owner, ep_size))  # a spare column takes the skipped ids
    mask = torch.zeros(ids.shape[0], ep_size + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, column, True)
    return mask[:, :ep_size]


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """``[n, ep_size] bool`` -> ``[n, ceil(ep_size / 8)] uint8``, rank r at bit ``r % 8`` of byte ``r // 8``."""
    n, ep_size = mask.shape
    num_bytes = -(-ep_size // 8)
    padded = torch.zeros(n, num_bytes * 8, dtype=torch.uint8, device=mask.device)
    padded[:, :ep_size] = mask
    # Made on the device: a host-to-device copy of a literal would break a CUDA-graph capture.
    weights = torch.ones(8, dtype=torch.uint8, device=mask.device) << torch.arange(8, dtype=torch.uint8,
                                                                                   device=mask.device)
    return (padded.view(n, num_bytes, 8) * weights).sum(-1, dtype=torch.uint8)


def _row_width(t: torch.Tensor) -> int:
    return t.element_size() * math.prod(t.shape[1:])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[rows, ...]`` of any dtype as ``[rows, row_bytes] uint8`` (a copy only if strided)."""
    if traced.tracing():
        return traced.to_bytes(t)
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], _row_width(t))


# ----------------------------------------------------------------------------------------------------- state


@dataclasses.dataclass
class Pending:
    """What combine needs from its dispatch."""

    mask: torch.Tensor  # [num_tokens, ep_size] bool: the ranks each local token went to
    runtime_max: int
    recv_counts: torch.Tensor  # [ep_size] int32
    exact_splits: Optional[tuple[list[int], list[int]]] = None  # exact mode: (sent to each rank, got from each)
    combine_input: Optional[torch.Tensor] = None  # traced calls: the combine input combine_input handed out

    @property
    def num_tokens(self) -> int:
        return self.mask.shape[0]


class NcclTransport:
    """Dispatch and combine of one expert-parallel group over its process group's collectives (module docstring).

    ``dispatch``, ``combine_input`` and ``combine`` of the padded mode trace under ``torch.compile(fullgraph=True)``
    (one traced step with the expert computation between them); results equal the eager call's (docs/multi_node.md).

    Args:
        group: the ``torch.distributed`` process group (NCCL on GPUs, gloo on CPU; the default group if None).
        num_experts: experts over all ranks.
        max_num_tokens: bound of ``runtime_max_tokens_per_rank``.
        device: where the buffers live (default: the current CUDA device); ``"cpu"`` with a gloo group.
        exact: counts first, then only the routed rows (eager only: raises inside torch.compile or a CUDA graph).
        debug: check ids on the host and that every rank makes the same call (host synchronisations).
    """

    def __init__(self, group: Any, *, num_experts: int, max_num_tokens: int, device: Any = None,
                 exact: bool = False, debug: bool = False) -> None:
        import torch.distributed as dist

        self._dist = dist
        # torch 2.13 renames all_gather_into_tensor (deprecated there, with a warning per call); older torch lacks
        # the new name.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.group = dist.group.WORLD if group is None else group
        self.ep_rank = dist.get_rank(self.group)
        self.ep_size = dist.get_world_size(self.group)
        self.num_experts, self.max_num_tokens, self.exact, self.debug = num_experts, max_num_tokens, exact, debug
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        self.device = torch.device(device)
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._pending: Optional[Pending] = None
        self.recv_counts = torch.zeros(self.ep_size, dtype=torch.int32, device=self.device)
        self._calls = 0
        self._alive = True

    # ------------------------------------------------------------------------------------------------ buffers

    def _buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor kept per (name, shape, dtype): a replayed CUDA graph reuses its memory, eager calls allocate
        nothing after the first of a shape. A traced call allocates: the graph owns its memory, nothing is kept."""
        if traced.tracing():
            return torch.empty(shape, dtype=dtype, device=self.device)
        key = (name, tuple(shape), dtype)
        buf = self._buffers.get(key)
        if buf is None:
            if len(self._buffers) >= 256:  # runtime_max varies per step: start over rather than grow without bound
                self._buffers.clear()
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    # ----------------------------------------------------------------------------------------------- dispatch

    def dispatch(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int,
                 timeout_s: Optional[float] = None, quant_format: Optional[str] = None,
                 global_scale: Optional[torch.Tensor | float] = None,
                 swizzled_scales: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
        """See :meth:`flashinfer_a2a.MoeAlltoAll.dispatch`: ``(recv_payloads, recv_counts)``, each payload
        ``[ep_size, runtime_max, ...]`` (a quantized first payload as values and scales), valid until the next
        dispatch."""
        self._check_alive()
        if self._pending is not None:
            raise RuntimeError("MoeAlltoAll.dispatch called twice: call combine for the previous dispatch first")
        if self.exact and traced.tracing():
            raise RuntimeError("exact=True synchronises with the host (it exchanges the counts first): call it "
                               "eagerly, not inside torch.compile (the padded mode, exact=False, traces)")
        fmt = self._check_dispatch(topk_ids, payloads, runtime_max, quant_format, global_scale, swizzled_scales)
        if self.debug and eager_call():
            check_topk_ids_on_host(topk_ids, self.num_experts)
            self._check_same_call(runtime_max)
        mask = rank_mask(topk_ids, self.num_experts, self.ep_size)
        wire = list(payloads)
        if fmt is not None:
            wire[:1] = self._quantize(payloads[0], fmt, global_scale)
        if self.exact:
            recv, splits = self._dispatch_exact(mask, wire, runtime_max)
            counts = self.recv_counts
        else:
            (recv, counts), splits = self._dispatch_padded(mask, wire, runtime_max), None
        if fmt is not None and swizzled_scales:
            recv[1] = self._swizzle(recv[1], fmt, payloads[0].shape[-1], runtime_max)
        self._pending = Pending(mask, runtime_max, counts, splits)
        if not traced.tracing():  # only debug mode reads it, eagerly; a traced int would be guarded on
            self._calls += 1
        return recv, counts

    def _check_dispatch(self, topk_ids, payloads, runtime_max, quant_format, global_scale,
                        swizzled_scales) -> Optional[WireFormat]:
        """The checks (and messages) of the NVLink path's dispatch, all before any collective."""
        check_dispatch_inputs(topk_ids, payloads)
        if not 0 <= runtime_max <= self.max_num_tokens:
            raise ValueError(f"runtime_max_tokens_per_rank={runtime_max} exceeds max_num_tokens="
                             f"{self.max_num_tokens} this MoeAlltoAll was built for")
        fmt = None if quant_format is None else wire_format(quant_format, "quant_format")
        if topk_ids.dtype not in _ID_DTYPES:
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if len(payloads) > MAX_PAYLOADS - (fmt is not None):
            raise ValueError(f"payloads: at most {MAX_PAYLOADS - (fmt is not None)} tensors per dispatch"
                             f"{' that quantizes' if fmt else ''}, got {len(payloads)}")
        num_tokens = topk_ids.shape[0] if topk_ids.dim() == 2 else -1
        if num_tokens < 0 or num_tokens > runtime_max or not 1 <= topk_ids.shape[1] <= MAX_TOP_K:
            raise ValueError(f"topk_ids must be [num_tokens, top_k] with num_tokens <= runtime_max_tokens_per_rank="
                             f"{runtime_max} and top_k in 1..{MAX_TOP_K}, got {tuple(topk_ids.shape)}")
        for i, p in enumerate(payloads):
            if p.dim() < 1 or p.shape[0] != num_tokens:
                raise ValueError(f"payloads[{i}] must be [num_tokens={num_tokens}, ...], got {tuple(p.shape)}")
        if fmt is None:
            if global_scale is not None or swizzled_scales:
                raise ValueError("global_scale and swizzled_scales need quant_format")
            return None
        if not payloads or payloads[0].dtype not in (torch.bfloat16, torch.float16) or payloads[0].dim() != 2:
            got = "no payload" if not payloads else f"{payloads[0].dtype} {tuple(payloads[0].shape)}"
            raise ValueError(f"quant_format={quant_format!r} quantizes payloads[0], which must be "
                             f"[num_tokens, hidden] bf16|fp16, got {got}")
        if (global_scale is not None) != (fmt.name == "nvfp4"):
            raise ValueError(f"global_scale is {'required' if fmt.name == 'nvfp4' else 'only used'} by nvfp4 "
                             f"(quant_format={quant_format!r})")
        if swizzled_scales and fmt.scale_bytes != 1:
            raise ValueError(f"swizzled_scales needs mxfp8 or nvfp4 (one-byte scales), got {quant_format!r}")
        return fmt

    def _quantize(self, x: torch.Tensor, fmt: WireFormat, global_scale) -> list[torch.Tensor]:
        """Values and scales, bitwise as the fused quantizing kernels (they equal the reference quantizers)."""
        if fmt.name != "nvfp4":
            return list(quant.quantize(x, fmt.name))
        if not isinstance(global_scale, torch.Tensor):
            global_scale = torch.full((1,), float(global_scale), dtype=torch.float32, device=x.device)
        # The checked quantize_nvfp4 reads the scale on the host: that would synchronise (and break capture).
        return list(quant.quantize_nvfp4_unchecked(x, global_scale.reshape(()).float()))

    def _swizzle(self, scales: torch.Tensor, fmt: WireFormat, hidden: int, runtime_max: int) -> torch.Tensor:
        """``[ep_size, runtime_max, cols]`` -> one 128x4-tile grid per source block, padding zero."""
        cols = fmt.scale_cols(hidden)
        size = fmt.swizzled_scale_bytes(runtime_max, hidden)
        index = traced.swizzled_index(runtime_max, cols, self.device) if traced.tracing() else \
            self._buffers.get(("swizzle index", runtime_max, cols))
        if index is None:  # built in the first (eager) call of this shape; a capture replays it
            index = quant._swizzled_index(runtime_max, cols).flatten().to(self.device)
            self._buffers[("swizzle index", runtime_max, cols)] = index
        out = self._buffer("swizzled", (self.ep_size, size), torch.uint8)
        out.zero_()
        out[:, index] = scales.view(torch.uint8).reshape(self.ep_size, -1)
        return out.view(fmt.scale_dtype)

    def _recv_buffers(self, wire: Sequence[torch.Tensor], runtime_max: int) -> list[torch.Tensor]:
        return [self._buffer(f"recv{i}", (self.ep_size, runtime_max, *p.shape[1:]), p.dtype)
                for i, p in enumerate(wire)]

    def _dispatch_padded(self, mask: torch.Tensor, wire: Sequence[torch.Tensor], runtime_max: int):
        ep_size, n = self.ep_size, mask.shape[0]
        segments = [_pack_bits(mask)] + [_bytes(p) for p in wire]
        widths = [s.shape[1] for s in segments]
        total = sum(widths)
        send = self._buffer("send", (runtime_max, total), torch.uint8)
        send[n:].zero_()  # padding rows: no destination bit set
        offsets = [sum(widths[:i]) for i in range(len(widths))]
        for seg, off, width in zip(segments, offsets, widths):
            send[:n, off : off + width] = seg
        if traced.tracing():
            gathered = traced.all_gather(send, self.group)
        else:
            gathered = self._buffer("gathered", (ep_size * runtime_max, total), torch.uint8)
            self._all_gather(gathered, send, group=self.group)
        byte, bit = divmod(self.ep_rank, 8)
        mine = ((gathered[:, byte] >> bit) & 1).view(ep_size, runtime_max)
        if traced.tracing():  # a fresh counts tensor: a traced graph must not write one kept between calls
            counts = torch.sum(mine, dim=1, dtype=torch.int32)
        else:
            counts = torch.sum(mine, dim=1, dtype=torch.int32, out=self.recv_counts)
        # A stable sort of "not mine" puts each block's rows for this rank first, in increasing token order: the
        # NVLink path's receive order. Rows past the count hold other rows of the block (unspecified by contract).
        order = torch.argsort(1 - mine, dim=1, stable=True)
        # Each source block's first row; a product, not arange's step, which may not be 0 (runtime_max 0: every
        # rank without tokens).
        order += (torch.arange(ep_size, device=self.device) * runtime_max).unsqueeze(1)
        order = order.view(-1)
        if traced.tracing():
            return traced.select_rows(gathered, order, wire, offsets[1:], ep_size, runtime_max), counts
        recv = self._recv_buffers(wire, runtime_max)
        for buf, off, width in zip(recv, offsets[1:], widths[1:]):
            torch.index_select(gathered[:, off : off + width], 0, order,
                               out=buf.view(torch.uint8).view(ep_size * runtime_max, width))
        return recv, counts

    def _dispatch_exact(self, mask: torch.Tensor, wire: Sequence[torch.Tensor], runtime_max: int):
        if not eager_call():
            raise RuntimeError("exact=True synchronises with the host (it exchanges the counts first): call it "
                               "eagerly, not inside a CUDA graph or torch.compile")
        ep_size, dist = self.ep_size, self._dist
        sent = mask.sum(0)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=self.group)
        send_splits, recv_splits = sent.tolist(), got.tolist()
        self.recv_counts.copy_(got)
        pairs = mask.t().nonzero()  # (destination, token), destination major, tokens increasing
        packed = torch.cat([_bytes(p) for p in wire], dim=1)
        recv_rows = torch.empty(sum(recv_splits), packed.shape[1], dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(recv_rows, packed.index_select(0, pairs[:, 1]), recv_splits, send_splits,
                               group=self.group)
        dest = self._exact_rows(recv_splits, runtime_max)
        recv = self._recv_buffers(wire, runtime_max)
        off = 0
        for buf, p in zip(recv, wire):
            width = _row_width(p)
            flat = buf.view(torch.uint8).view(ep_size * runtime_max, width)
            flat.index_copy_(0, dest, recv_rows[:, off : off + width])
            off += width
        return recv, (send_splits, recv_splits)

    def _exact_rows(self, counts: Sequence[int], runtime_max: int) -> torch.Tensor:
        """Flat ``[ep_size * runtime_max]`` rows of the first ``counts[src]`` slots of each source block."""
        rows = [torch.arange(c, device=self.device) + src * runtime_max for src, c in enumerate(counts)]
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.int64, device=self.device)

    def _check_same_call(self, runtime_max: int) -> None:
        """Debug mode: every rank makes the same call with the same runtime_max (a host round trip)."""
        seen: list = [None] * self.ep_size
        self._dist.all_gather_object(seen, (self._calls, runtime_max), group=self.group)
        if len(set(seen)) != 1:
            detail = ", ".join(f"rank {r}: call {c} runtime_max {m}" for r, (c, m) in enumerate(seen))
            raise RuntimeError(f"ranks disagree on the dispatch call sequence ({detail}); every rank must call "
                               "dispatch/combine the same number of times with the same runtime_max_tokens_per_rank")

    # ------------------------------------------------------------------------------------------------ combine

    def combine_input(self, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """``[ep_size, runtime_max, hidden]`` for the expert outputs of the pending dispatch (then combine with no
        partials)."""
        pending = self._require_pending("combine_input")
        shape = (self.ep_size, pending.runtime_max, hidden)
        if traced.tracing():  # kept with the pending dispatch, so combine reads what the caller wrote here
            given = pending.combine_input
            if given is None or tuple(given.shape) != shape or given.dtype != dtype:
                given = pending.combine_input = torch.empty(shape, dtype=dtype, device=self.device)
            return given
        return self._buffer("combine input", shape, dtype)

    def combine(self, partials: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                hidden: Optional[int] = None, dtype: Optional[torch.dtype] = None, timeout_s: Optional[float] = None,
                quant_format: Optional[str] = None) -> torch.Tensor:
        """``out[t]`` = the partials of the ranks token t went to, summed in increasing rank order in fp32, cast
        to the partials' dtype. ``quant_format="fp8_block"``: partials for other ranks cross as FP8 with an fp32
        scale per 128 (a rank's own stay exact), as :func:`flashinfer_a2a.reference.quant.reference_combine_fp8`."""
        check_combine_tensors(partials, out)
        pending = self._require_pending("combine")
        ep_size, rm, n = self.ep_size, pending.runtime_max, pending.num_tokens
        if partials is None:
            if hidden is None or dtype is None:
                raise ValueError("combine: pass partials, or hidden and dtype of the combine input written")
            partials = self.combine_input(hidden, dtype)
        elif partials.dtype not in _COMBINE_DTYPES or tuple(partials.shape[:2]) != (ep_size, rm) \
                or partials.dim() != 3:
            raise ValueError(f"partials must be [ep_size={ep_size}, runtime_max={rm}, hidden] bf16|fp16|fp32, got "
                             f"{partials.dtype} {tuple(partials.shape)}")
        hidden, dtype = partials.shape[2], partials.dtype
        if out is None:
            out = torch.empty(n, hidden, dtype=dtype, device=self.device)
        elif tuple(out.shape) != (n, hidden) or out.dtype != dtype:
            raise ValueError(f"out must be [num_tokens={n}, hidden={hidden}] {dtype}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        check_combine_format(quant_format, "combine quant_format")
        if quant_format is not None and (dtype == torch.float32 or hidden % 8):
            raise ValueError(f"combine quant_format='fp8_block' needs bf16|fp16 partials with hidden % 8 == 0, got "
                             f"{dtype} hidden={hidden}")
        wire = self._combine_wire(partials, quant_format)
        returned = self._exchange_partials(wire, pending)
        rows = self._from_wire(returned, partials, quant_format)
        self._ordered_sum(rows, pending.mask, out)
        self._pending = None
        return out

    def _combine_wire(self, partials: torch.Tensor, quant_format: Optional[str]) -> torch.Tensor:
        """``[ep_size * runtime_max, wire_row_bytes] uint8``: the partials, or their FP8 values and scales."""
        flat = partials.reshape(-1, partials.shape[-1])
        if quant_format is None:
            return _bytes(flat)
        values, scales = quant.quantize_fp8_block(flat)
        return torch.cat([_bytes(values), _bytes(scales)], dim=1)

    def _exchange_partials(self, wire: torch.Tensor, pending: Pending) -> torch.Tensor:
        """Block ``[d]`` of the result: the rows rank d computed for this rank's tokens, in d's slot order."""
        ep_size, rm = self.ep_size, pending.runtime_max
        returned = self._buffer("returned", (ep_size * rm, wire.shape[1]), torch.uint8)
        if pending.exact_splits is None and traced.tracing():
            return traced.all_to_all(wire, self.group)
        if pending.exact_splits is None:
            self._dist.all_to_all_single(returned, wire, group=self.group)
            return returned
        send_splits, recv_splits = pending.exact_splits  # dispatch's, now reversed
        rows = self._exact_rows(recv_splits, rm)
        back = torch.empty(sum(send_splits), wire.shape[1], dtype=torch.uint8, device=self.device)
        self._dist.all_to_all_single(back, wire.index_select(0, rows), send_splits, recv_splits, group=self.group)
        returned.index_copy_(0, self._exact_rows(send_splits, rm), back)
        return returned

    def _from_wire(self, returned: torch.Tensor, partials: torch.Tensor, quant_format: Optional[str]) -> torch.Tensor:
        """``[ep_size, runtime_max, hidden]`` rows to sum (fp32 when they crossed as FP8)."""
        ep_size, rm, hidden = partials.shape
        if traced.tracing():
            if quant_format is None:
                return traced.from_bytes(returned, partials.dtype, (ep_size, rm, hidden))
            values = traced.from_bytes(returned[:, :hidden], torch.float8_e4m3fn, (ep_size * rm, hidden))
            scales = traced.from_bytes(returned[:, hidden:], torch.float32, (ep_size * rm, -1))
        elif quant_format is None:
            return returned.view(partials.dtype).view(ep_size, rm, hidden)
        else:
            values = returned[:, :hidden].view(torch.float8_e4m3fn)
            scales = returned[:, hidden:].contiguous().view(torch.float32)
        rows = quant.dequantize_fp8_block(values, scales).view(ep_size, rm, hidden)
        rows[self.ep_rank] = partials[self.ep_rank].float()  # a rank's own partials cross no link: exact
        return rows

    def _ordered_sum(self, rows: torch.Tensor, mask: torch.Tensor, out: torch.Tensor) -> None:
        """``out[t] = ((+0 + row(t, d0)) + row(t, d1)) + ...`` over the ranks d0 < d1 < ... token t went to, each
        step one fp32 addition, then one rounding to ``out``'s dtype: the NVLink combine's bits."""
        slots = (torch.cumsum(mask.to(torch.int64), dim=0) - 1).clamp_min(0)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=self.device)
        for d in range(self.ep_size):
            picked = rows[d].index_select(0, slots[:, d]).float()
            acc = torch.where(mask[:, d : d + 1], acc + picked, acc)
        out.copy_(acc)

    # -------------------------------------------------------------------------------------------------- state

    def destroy(self) -> None:
        """Drops the buffers. Idempotent."""
        self._buffers.clear()
        self._pending = None
        self._alive = False

    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError("this MoeAlltoAll was destroyed")

    # What only the NVLink transport has (the interface of flashinfer_a2a.transports.base).
    def dispatch_send(self, *args) -> None:
        raise _nvlink_only("dispatch_send")

    def dispatch_recv(self) -> None:
        raise _nvlink_only("dispatch_recv")

    def combine_send(self, *args) -> None:
        raise _nvlink_only("combine_send")

    def combine_recv(self, *args) -> None:
        raise _nvlink_only("combine_recv")

    def bind_stream(self, stream: Optional[torch.cuda.Stream]) -> None:
        raise _nvlink_only("bind_stream")

    def combine_mode(self, quant_format: Optional[str] = None) -> str:
        check_combine_format(quant_format, "combine quant_format")
        return "pull"  # each rank gets its tokens' partials back and sums them

    def workspace_breakdown(self) -> str:
        return "transport nccl: no symmetric workspace (buffers are kept per call shape, docs/multi_node.md)"

    def _require_pending(self, what: str) -> Pending:
        self._check_alive()
        if self._pending is None:
            raise RuntimeError(f"MoeAlltoAll.{what} called without a pending dispatch: call dispatch first")
        return self._pending


def _nvlink_only(call: str) -> NotImplementedError:
    return NotImplementedError(f"MoeAlltoAll.{call} needs transport='nvlink' (split-phase calls and stream binding "
                               "are the one-sided transport's)")
