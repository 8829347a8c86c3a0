"""The ``nccl`` transport: dispatch and combine over the collectives of a ``torch.distributed`` process group.

One-sided NVLink needs every rank to map every peer's memory (one NVLink domain). Past that edge this transport runs
the same contract (DESIGN.md §2, :mod:`flashinfer_a2a.reference`) over whatever backend the group has: NCCL across
nodes, gloo on CPU (where CI runs it). Receive layout, receive order, ``recv_counts`` and combine's ordered fp32 sum
are those of the NVLink path, so the results equal it bit for bit, quantized ones included.

Two modes:

- **padded** (default, no host synchronisation, CUDA-graph capturable, traceable by ``torch.compile``: while tracing
  the collectives are the functional ones and every result a fresh tensor,
  :mod:`flashinfer_a2a.transports.nccl_traced`). Dispatch: one kernel (``nccl_pack``) writes this rank's send
  buffer (:mod:`flashinfer_a2a.library.nccl_wire`): each token's destination bitmask, ``payloads[0]`` quantized
  into its wire format by the NVLink fused dispatch's device code (the same bytes), the other payloads' rows, into
  this rank's block of the gathered buffer; one ``all_gather_into_tensor`` in place (``all_gather_single`` in torch
  2.13; from ``PEER_EXCHANGE_MIN_TOKENS`` per rank one group of sends and receives with the peers instead); then
  one kernel (``nccl_select``) keeps, per source block, the rows whose bitmask names this rank, in increasing token
  order, and writes ``recv_counts``.
  Combine: one ``all_to_all_single`` of the ``[ep_size, runtime_max, hidden]`` combine region (from
  ``PEER_EXCHANGE_MIN_TOKENS`` per rank one group of sends and receives to the peers instead, without the rank's
  own block, which the sum reads from its partials; the peer exchange's own buffers come from NCCL's allocator,
  :mod:`flashinfer_a2a.memory.nccl_memory`; with
  ``quant_format="fp8_block"`` first quantized by a kernel, ``nccl_combine_wire``, to FP8 with an fp32 scale per
  128: the NVLink combine's FP8 wire), then one kernel (``nccl_combine_sum``) sums each token's rows in increasing
  rank order in fp32. No step synchronises with the host.
- **exact** (eager only). Dispatch: the same pack kernel, then the per-destination counts (one small
  ``all_to_all_single`` and a host synchronisation), then a variable-size ``all_to_all_single`` of only the routed
  rows (gathered and scattered by torch ops); combine returns only those rows and sums them with the same kernel.
  For large prefill batches, where padding every rank to ``runtime_max`` moves too many bytes.

On CPU tensors the same steps run as torch ops (:mod:`flashinfer_a2a.transports.nccl_torch`, the kernels' twins:
the same wire, rows and bits).

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
import warnings
from typing import Any, Optional, Sequence

import torch

from ..library import ops
from ..library.checks import check_combine_tensors, check_dispatch_inputs, check_topk_ids_on_host
from ..library.errors import eager_call
from ..library.nccl_wire import WIRE_ALIGN, NcclWire, dispatch_wire
from ..library.wire_formats import WireFormat, check_combine_format, fp8_wire_row_bytes, wire_format
from ..memory.nccl_memory import allocating_from, nccl_pool
from . import nccl_torch as local
from . import nccl_traced as traced
from .nccl_torch import rank_mask, row_width  # noqa: F401 (rank_mask: documented here, docs/api.md)

TRANSPORTS = ("auto", "nvlink", "nccl")
MAX_TOP_K = 32
MAX_PAYLOADS = 8
# From this runtime_max on, the padded mode moves its blocks with one group of sends and receives to the peers, which
# leaves this rank's own block out, where all_gather_into_tensor and all_to_all_single run NCCL's collectives (the
# all-to-all copies the own block too). Slowest rank, graph mode, the group against the collective in one session,
# 8192 tokens per rank: dispatch 2xH100 bf16 682 against 723 us, NVFP4 263 against 270, 4xH100 1471 against 1504 and 499
# against 503; combine 4xH100 bf16 1344 against 1396, FP8 wire 934 against 955, 2xH100 635 against 653 and 440
# against 443. At 1024 tokens the groups were 2-7 us slower, at 128 4-5 us: they take longer to start.
PEER_EXCHANGE_MIN_TOKENS = 4096
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


# ----------------------------------------------------------------------------------------------------- state


@dataclasses.dataclass
class Pending:
    """What combine needs from its dispatch."""

    send: torch.Tensor  # this rank's send buffer: its mask planes say where each local token went
    wire: NcclWire
    num_tokens: int
    recv_counts: torch.Tensor  # [ep_size] int32
    exact_splits: Optional[tuple[list[int], list[int]]] = None  # exact mode: (sent to each rank, got from each)
    combine_input: Optional[torch.Tensor] = None  # traced calls: the combine input combine_input handed out

    @property
    def runtime_max(self) -> int:
        return self.wire.runtime_max


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
        self._nccl_pool: Optional[Any] = None  # NCCL's allocator, made at the first peer exchange
        self._pending: Optional[Pending] = None
        self.recv_counts = torch.zeros(self.ep_size, dtype=torch.int32, device=self.device)
        self._calls = 0
        self._alive = True

    # ------------------------------------------------------------------------------------------------ buffers

    def _buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype, exchanged: bool = False) -> torch.Tensor:
        """A tensor kept per (name, shape, dtype): a replayed CUDA graph reuses its memory, eager calls allocate
        nothing after the first of a shape. A traced call allocates: the graph owns its memory, nothing is kept.
        ``exchanged``: a buffer the peer exchange sends or receives, taken from NCCL's allocator
        (memory/nccl_memory.py); part of the key, as the buffers of one exchange must be of one kind (a send from
        NCCL's memory into torch's hangs).
        """
        if traced.tracing():
            return torch.empty(shape, dtype=dtype, device=self.device)
        key = (name, tuple(shape), dtype, exchanged)
        buf = self._buffers.get(key)
        if buf is None:
            if len(self._buffers) >= 256:  # runtime_max varies per step: start over rather than grow without bound
                self._buffers.clear()
            if exchanged and self._nccl_pool is None:
                self._nccl_pool = nccl_pool(self.group, self.device)
            with allocating_from(self._nccl_pool if exchanged else None, self.device):
                buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buf

    def _peer_exchange(self, runtime_max: int) -> bool:
        """Whether the padded mode moves its blocks by one group of sends and receives to the peers."""
        return not self.exact and self._kernels and runtime_max >= PEER_EXCHANGE_MIN_TOKENS

    # ----------------------------------------------------------------------------------------------- dispatch

    def dispatch(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int,
                 timeout_s: Optional[float] = None, quant_format: Optional[str] = None,
                 global_scale: Optional[torch.Tensor | float] = None, swizzled_scales: bool = False,
                 eplb_local_stats: None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
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
        hidden = payloads[0].shape[-1] if fmt is not None else 0
        wire = dispatch_wire(self.ep_size, runtime_max, [row_width(p) for p in payloads], fmt, hidden,
                             swizzled_scales)
        # Packed straight into this rank's block of the padded mode's gathered buffer (on GPUs), the all-gather runs
        # in place (no copy of this rank's rows into its own block).
        gathered = None
        if not self.exact and not traced.tracing():
            gathered = self._buffer("gathered", (self.ep_size, wire.total_bytes), torch.uint8,
                                    exchanged=self._peer_exchange(runtime_max))
        send = self._pack(topk_ids, payloads, wire, fmt, global_scale, swizzled_scales,
                          None if gathered is None else gathered[self.ep_rank])
        recv_like = self._recv_like(payloads, fmt, hidden, swizzled_scales, runtime_max)
        swizzled = 1 if swizzled_scales else None
        if self.exact:
            recv, splits = self._dispatch_exact(send, wire, topk_ids.shape[0], recv_like, swizzled)
            counts = self.recv_counts
        else:
            (recv, counts), splits = self._dispatch_padded(send, gathered, wire, recv_like, fmt, hidden,
                                                           swizzled_scales), None
        self._pending = Pending(send, wire, topk_ids.shape[0], counts, splits)
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

    @property
    def _kernels(self) -> bool:
        """Whether the steps run as CUDA kernels (else as their torch twins, nccl_torch)."""
        return self.device.type == "cuda"

    def _pack(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], wire: NcclWire,
              fmt: Optional[WireFormat], global_scale, swizzled: bool,
              into: Optional[torch.Tensor] = None) -> torch.Tensor:
        """This rank's send buffer (library/nccl_wire.py): on GPUs ``into`` when given, else one kept; on the CPU a
        fresh tensor."""
        if fmt is not None and fmt.name == "nvfp4" and not isinstance(global_scale, torch.Tensor):
            # Filled on the device: no host-to-device copy enters a CUDA graph.
            global_scale = torch.full((1,), float(global_scale), dtype=torch.float32, device=self.device)
        if not self._kernels:
            return local.pack(topk_ids, payloads, wire, self.num_experts, fmt, global_scale, swizzled)
        send = into if into is not None else self._buffer("send", (wire.total_bytes,), torch.uint8)
        gs = None if global_scale is None else global_scale.reshape(1).float()
        ops.nccl_pack(send, topk_ids, list(payloads), self.ep_size, wire.runtime_max, self.num_experts,
                      0 if fmt is None else fmt.code, gs, swizzled)
        return send

    def _recv_like(self, payloads: Sequence[torch.Tensor], fmt: Optional[WireFormat], hidden: int, swizzled: bool,
                   runtime_max: int) -> list[tuple[torch.dtype, tuple]]:
        """(dtype, shape) of each receive buffer: ``[ep_size, runtime_max, ...]`` per payload; a quantized first
        payload as values and scales (swizzled: one 128x4-tile block per source)."""
        block = (self.ep_size, runtime_max)
        like = [(p.dtype, (*block, *p.shape[1:])) for p in payloads]
        if fmt is not None:
            scales = (self.ep_size, fmt.swizzled_scale_bytes(runtime_max, hidden)) if swizzled else \
                (*block, fmt.scale_cols(hidden))
            like[:1] = [(fmt.value_dtype, (*block, fmt.value_bytes(hidden))), (fmt.scale_dtype, scales)]
        return like

    def _dispatch_padded(self, send: torch.Tensor, gathered: Optional[torch.Tensor], wire: NcclWire, recv_like,
                         fmt: Optional[WireFormat], hidden: int, swizzled: bool):
        """``gathered``: the kept buffer the all-gather fills (None while tracing); on GPUs ``send`` is its block."""
        if traced.tracing():
            gathered = traced.all_gather(send, self.group).view(self.ep_size, wire.total_bytes)
        elif self._peer_exchange(wire.runtime_max):
            self._exchange_with_peers([(d, send, gathered[d]) for d in range(self.ep_size)])
        else:
            self._all_gather(gathered.view(-1), send, group=self.group)
        if not self._kernels:
            recv, counts = local.select(gathered, wire, self.ep_rank, recv_like, 1 if swizzled else None)
            if not traced.tracing():  # eagerly, the counts tensor this transport keeps, as on GPUs
                counts = self.recv_counts.copy_(counts)
            return recv, counts
        recv = [self._buffer(f"recv{i}", shape, dtype) for i, (dtype, shape) in enumerate(recv_like)]
        # A fresh counts tensor while tracing: a traced graph must not write one kept between calls.
        counts = torch.empty_like(self.recv_counts) if traced.tracing() else self.recv_counts
        ops.nccl_select(gathered, recv, counts, self.ep_rank, wire.runtime_max, 0 if fmt is None else fmt.code, hidden,
                        swizzled)
        return recv, counts

    def _dispatch_exact(self, send: torch.Tensor, wire: NcclWire, num_tokens: int, recv_like,
                        swizzled: Optional[int]):
        if not eager_call():
            raise RuntimeError("exact=True synchronises with the host (it exchanges the counts first): call it "
                               "eagerly, not inside a CUDA graph or torch.compile")
        ep_size, dist, runtime_max = self.ep_size, self._dist, wire.runtime_max
        mask = local.unpack_mask(send, wire, num_tokens)
        sent = mask.sum(0)
        got = torch.empty_like(sent)
        dist.all_to_all_single(got, sent, group=self.group)
        send_splits, recv_splits = sent.tolist(), got.tolist()
        self.recv_counts.copy_(got)
        tokens = mask.t().nonzero()[:, 1]  # (destination, token) pairs, destination major, tokens increasing
        segments = range(len(wire.row_bytes))
        packed = torch.cat([wire.segment(send, s)[:num_tokens].index_select(0, tokens) for s in segments], dim=1)
        recv_rows = torch.empty(sum(recv_splits), packed.shape[1], dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(recv_rows, packed, recv_splits, send_splits, group=self.group)
        dest = self._exact_rows(recv_splits, runtime_max)
        recv, off = [], 0
        for s, (dtype, shape) in enumerate(recv_like):
            width = wire.row_bytes[s]
            rows = recv_rows[:, off : off + width]
            off += width
            if s == swizzled:
                flat = torch.zeros(ep_size * runtime_max, width, dtype=torch.uint8, device=self.device)
                flat.index_copy_(0, dest, rows)
                recv.append(local.swizzle_rows(flat.view(ep_size, runtime_max, width), runtime_max).view(dtype))
                continue
            buf = self._buffer(f"recv{s}", shape, dtype)
            buf.view(torch.uint8).view(ep_size * runtime_max, width).index_copy_(0, dest, rows)
            recv.append(buf)
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
        fp8_wire = quant_format is not None
        wire = self._combine_wire(partials, pending, fp8_wire)
        returned = self._exchange_partials(wire, pending, fp8_wire)
        self._sum(out, returned, partials, pending, fp8_wire)
        self._pending = None
        return out

    def _combine_wire(self, partials: torch.Tensor, pending: Pending, fp8_wire: bool) -> torch.Tensor:
        """``[ep_size * runtime_max, wire_row_bytes] uint8``: the partials, or their FP8 values and scales."""
        ep_size, rm, hidden = partials.shape
        if not fp8_wire:
            return local.to_bytes(partials.reshape(ep_size * rm, hidden))
        if not self._kernels:
            return local.combine_wire(partials)
        wire = self._buffer("combine wire", (ep_size * rm, fp8_wire_row_bytes(hidden)), torch.uint8,
                            exchanged=self._peer_exchange(rm))
        ops.nccl_combine_wire(wire, _dense(partials), pending.recv_counts, self.ep_rank)
        return wire

    def _exchange_partials(self, wire: torch.Tensor, pending: Pending, fp8_wire: bool) -> torch.Tensor:
        """Block ``[d]`` of the result: the rows rank d computed for this rank's tokens, in d's slot order."""
        ep_size, rm = self.ep_size, pending.runtime_max
        if pending.exact_splits is None and traced.tracing():
            return traced.all_to_all(wire, self.group)
        # Over the FP8 wire both sides of a peer exchange are this transport's buffers; plain rows are sent from the
        # caller's partials (torch's memory), so they land in torch's memory too.
        returned = self._buffer("returned", (ep_size * rm, wire.shape[1]), torch.uint8,
                                exchanged=fp8_wire and self._peer_exchange(rm))
        if pending.exact_splits is None:
            if self._peer_exchange(rm):
                blocks = [slice(d * rm, (d + 1) * rm) for d in range(ep_size)]
                self._exchange_with_peers([(d, wire[b], returned[b]) for d, b in enumerate(blocks)])
            else:
                self._dist.all_to_all_single(returned, wire, group=self.group)
            return returned
        send_splits, recv_splits = pending.exact_splits  # dispatch's, now reversed
        rows = self._exact_rows(recv_splits, rm)
        back = torch.empty(sum(send_splits), wire.shape[1], dtype=torch.uint8, device=self.device)
        self._dist.all_to_all_single(back, wire.index_select(0, rows), send_splits, recv_splits, group=self.group)
        returned.index_copy_(0, self._exact_rows(send_splits, rm), back)
        return returned

    def _exchange_with_peers(self, blocks: Sequence[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """``(d, sent, received)`` per rank d: ``sent`` to rank d and ``received`` from it, as one group of sends and
        receives that leaves this rank's own entry out."""
        dist, p2p = self._dist, []
        for d, sent, received in blocks:
            if d != self.ep_rank:
                peer = dist.get_global_rank(self.group, d)
                p2p += [dist.P2POp(dist.isend, sent, peer, self.group),
                        dist.P2POp(dist.irecv, received, peer, self.group)]
        for work in dist.batch_isend_irecv(p2p) if p2p else ():
            work.wait()

    def _sum(self, out: torch.Tensor, returned: torch.Tensor, partials: torch.Tensor, pending: Pending,
             fp8_wire: bool) -> None:
        """``out[t]``: token t's rows summed in increasing rank order in fp32 (nccl_torch.ordered_sum)."""
        if not self._kernels:
            out.copy_(local.ordered_sum(returned, pending.send, pending.wire, partials, self.ep_rank, fp8_wire,
                                        pending.num_tokens))
            return
        # The kernel writes dense rows (16-byte aligned ones over the FP8 wire): a caller's strided or misaligned out
        # gets them through a dense one.
        target = out if _dense(out) is out else torch.empty(out.shape, dtype=out.dtype, device=out.device)
        ops.nccl_combine_sum(target, returned, pending.send, _dense(partials), self.ep_rank, fp8_wire)
        if target is not out:
            out.copy_(target)

    # -------------------------------------------------------------------------------------------------- state

    def destroy(self) -> None:
        """Drops the buffers. Idempotent."""
        self._buffers.clear()
        self._nccl_pool = None  # after its tensors
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

    active_ranks = property(lambda self: tuple(range(self.ep_size)))

    def set_active_ranks(self, ranks, restore: bool = False) -> None:
        if ranks is not None:  # every rank takes part, as ever
            raise ValueError("active rank sets need transport='nvlink': NCCL's collectives take every rank")

    def bind_stream(self, stream: Optional[torch.cuda.Stream]) -> None:
        raise _nvlink_only("bind_stream")

    def combine_mode(self, quant_format: Optional[str] = None, runtime_max: Optional[int] = None) -> str:
        check_combine_format(quant_format, "combine quant_format")
        return "pull"  # each rank gets its tokens' partials back and sums them

    def workspace_breakdown(self) -> str:
        return "transport nccl: no symmetric workspace (buffers are kept per call shape, docs/multi_node.md)"

    def _require_pending(self, what: str) -> Pending:
        self._check_alive()
        if self._pending is None:
            raise RuntimeError(f"MoeAlltoAll.{what} called without a pending dispatch: call dispatch first")
        return self._pending


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` if contiguous and starting on a 16-byte boundary (read off its storage offset: torch's CUDA memory starts
    on coarser ones; the ops check the pointer itself), else such a copy: what the kernels read in 16-byte vectors."""
    if torch.compiler.is_compiling():
        # Dynamo cannot read the storage offset of a tensor made in the graph (torch 2.11); the buffers a compiled
        # graph allocates start on the allocator's boundaries, and the ops check the pointer of any other.
        return t if t.is_contiguous() else t.contiguous()
    if t.is_contiguous() and t.storage_offset() * t.element_size() % WIRE_ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _nvlink_only(call: str) -> NotImplementedError:
    return NotImplementedError(f"MoeAlltoAll.{call} needs transport='nvlink' (split-phase calls and stream binding "
                               "are the one-sided transport's)")
