"""The ``hierarchical`` transport: NCCL between nodes, the node's own transport inside it.

Contiguous ranks form a node of ``node_size`` ranks (:mod:`.node_groups`); the ranks of one local index, one per
node, form a peer group. A token crosses the network once per node that holds one of its experts, to its peer of
the same local index there, which forwards it over the node's links to the ranks that hold its experts (one-sided
NVLink on GPUs, :mod:`.nvlink`; the ``nccl`` transport over gloo on CPU, :mod:`.nccl`). The results are the flat
transports' bit for bit (DESIGN.md §2, :mod:`flashinfer_a2a.reference`): the same receive layout, order and
``recv_counts``, and each token's partials summed in increasing global rank order in fp32.

That last rule decides the combine. A node-level partial sum would round differently (``(r0 + r1) + (r2 + r3)``
is not ``((r0 + r1) + r2) + r3``), so every rank's partial travels back unreduced and only the token's owner sums.
The node-local stage moves one row per (token, rank) pair both ways: it dispatches each forwarded token once per
local destination, as a token of its own, so that the node's combine (a sum over the ranks a token went to) returns
each rank's partial exactly. Steps, with ``L = node_size``, ``N = ep_size / L``, ``R`` = runtime_max and
``c = min(L, top_k)`` (the most ranks of one node a token can reach):

dispatch
    1. **network** (peer group, one ``all_to_all_single``): for each node, this rank's tokens bound there, in
       increasing token order, padded to ``R`` rows; each row carries its payload bytes, the source node and the
       token's destination ranks as bytes.
    2. **node** (node transport, ``c`` token slots per row received): each forwarded row once to each destination
       in this node, the pairs of a row in increasing rank order.
    3. **reorder**: the rows from local rank ``i`` arrive grouped by source node, each group in token order; group
       ``j`` is the block of source rank ``j * L + i`` of the flat layout.

combine
    1. **node**: each rank's partials, in the node stage's layout, through the node transport's combine: one
       contributor per pair, so its fp32 sum is that rank's partial unchanged.
    2. **network** (peer group, one ``all_to_all_single``): ``c`` partials per forwarded row back to its source
       (``combine(quant_format="fp8_block")``: as FP8 with an fp32 scale per 128, quantized once).
    3. **sum**: the owner adds a token's partials in increasing (node, local rank) order in fp32: the global rank
       order, so the flat transports' bits.

Padded (no host synchronisation, CUDA-graph capturable where the node transport is). Bytes each rank sends over the
network per step (``B`` = dispatch row bytes, ``H`` = combine row bytes): dispatch ``(N - 1) * R * (B + h)`` with
``h = 16 * ceil((4 + ep_size) / 16)`` bytes of routing per row, combine ``(N - 1) * R * c * H``; the flat ``nccl``
transport's padded mode sends ``(P - L) * R * (B + ceil(P / 8))`` and ``(P - L) * R * H`` of its bytes off the node.
The node stage's workspace holds ``c`` token slots per forwarded row: ``c`` times a flat NVLink workspace of
``ep_size`` ranks (docs/multi_node.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import torch

from ..comm import as_communicator
from ..library import ops
from ..library.checks import check_combine_tensors, check_topk_ids_on_host
from ..library.errors import eager_call
from ..library.layout import WorkspaceConfig
from ..library.nccl_wire import dispatch_wire
from ..library.wire_formats import WireFormat, check_combine_format
from ..reference import quant
from .nccl import TRANSPORTS as FLAT_TRANSPORTS
from .nccl import NcclTransport, check_transport
from .nccl_torch import combine_wire, quantize, rank_mask, row_width, swizzle_rows, to_bytes
from . import scratch as shared_scratch
from .node_groups import NodeSplit, check_node_size, node_groups
from .nvlink import NvlinkTransport

TRANSPORTS = (*FLAT_TRANSPORTS, "hierarchical")
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_ALIGN = 16  # routed rows are padded to 16 bytes: the node stage copies them with 16-byte vectors


def check_transport_choice(transport: str, exact: bool, node_size: Any, ep_size: int) -> None:
    """The ``transport``, ``exact`` and ``node_size`` arguments of :class:`flashinfer_a2a.MoeAlltoAll`: ValueError
    (or TypeError) naming the one that is wrong."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
    if transport != "hierarchical":
        check_transport(transport, exact)
        if node_size is not None:
            raise ValueError(f"node_size is used by transport='hierarchical' only, got node_size={node_size!r} with "
                             f"transport={transport!r}")
        return
    if exact:
        raise ValueError("exact=True needs transport='nccl', got transport='hierarchical'")
    check_node_size(node_size, ep_size)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class _RowLayout:
    """One routed row: the source node (int32), the token's destination ranks (one byte each), then each payload's
    bytes from ``header`` on; ``width`` bytes in all, a multiple of 16."""

    header: int
    widths: tuple[int, ...]

    @property
    def offsets(self) -> list[int]:
        return [self.header + sum(self.widths[:i]) for i in range(len(self.widths))]

    @property
    def width(self) -> int:
        return _round_up(self.header + sum(self.widths), _ALIGN)


@dataclasses.dataclass
class _Pending:
    """What combine needs from its dispatch."""

    mask: torch.Tensor  # [num_tokens, ep_size] bool: the ranks each local token went to
    runtime_max: int
    gather_rows: torch.Tensor  # [node_size, num_nodes * runtime_max]: flat receive row of each node-stage row


class HierarchicalTransport:
    """Dispatch and combine of one expert-parallel group split into nodes (module docstring).

    Args:
        comm: the group's communicator; it must wrap a ``torch.distributed`` process group whose ranks are in
            increasing global rank order.
        node_size: ranks per node (contiguous ranks form a node); divides ``comm.size``.
        num_experts: experts over all ranks.
        requested: the flat sizes (``max_num_tokens``, ``top_k``, dispatch and combine bytes per token) the node
            stage is sized from.
        device: this rank's device (default: the current CUDA device); ``"cpu"`` runs both stages over gloo.
        namespace, num_sms, timeout_s, debug: passed to the node stage's NVLink transport (see
            :class:`flashinfer_a2a.MoeAlltoAll`).
    """

    def __init__(self, comm: Any, *, node_size: int, num_experts: int, requested: WorkspaceConfig, device: Any = None,
                 namespace: str = "default", num_sms: int = 0, timeout_s: float = 60.0, debug: bool = False) -> None:
        import torch.distributed as dist

        group = getattr(comm, "group", None)
        if group is None:
            raise TypeError(f"transport='hierarchical' creates sub-groups of a torch.distributed process group; got "
                            f"{type(comm).__name__}, which has none (pass the process group)")
        check_node_size(node_size, comm.size)
        self._dist, self.comm, self.num_experts, self.debug = dist, comm, num_experts, debug
        self.timeout_s = timeout_s  # the node stage's waits, when a call names none
        if device is None or isinstance(device, int):
            device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.device = torch.device(device)
        self.split = NodeSplit(comm.size, node_size, comm.rank)
        self.peer_group, self.node_group = node_groups(group, self.split, self.device)
        self.max_num_tokens, self.top_k = requested.max_num_tokens, requested.top_k
        self.dispatch_bytes = requested.dispatch_bytes_per_token
        self.pairs = min(node_size, requested.top_k)  # c: the most ranks of one node a token reaches
        node_tokens = self.split.num_nodes * requested.max_num_tokens * self.pairs
        row = _round_up(self._header() + requested.dispatch_bytes_per_token, _ALIGN)
        if self.device.type == "cpu":
            self.node_stage: Any = NcclTransport(self.node_group, num_experts=node_size, max_num_tokens=node_tokens,
                                                 device=self.device)
        else:
            config = WorkspaceConfig(ep_size=node_size, max_num_tokens=node_tokens, dispatch_bytes_per_token=row,
                                     combine_bytes_per_token=requested.combine_bytes_per_token, top_k=1)
            self.node_stage = NvlinkTransport(as_communicator(self.node_group), self.node_group, namespace, config,
                                              self.device.index, num_experts=node_size, num_sms=num_sms,
                                              pushed_wires=frozenset(), timeout_s=timeout_s, debug=debug)
        self.recv_counts = torch.zeros(comm.size, dtype=torch.int32, device=self.device)
        self._pending: Optional[_Pending] = None
        self._calls = 0
        self._alive = True
        # The layers of one namespace take turns (one pending dispatch, as on the node stage's workspace), so they
        # share their buffers, each as large as the largest layer's.
        key = (tuple(dist.get_process_group_ranks(group)), node_size, namespace, str(self.device))
        self.scratch = shared_scratch.acquire(key, self.device)
        most, nodes = requested.max_num_tokens, self.split.num_nodes
        combine_row = requested.combine_bytes_per_token
        for name, nbytes in (("rows", most * row), ("send", nodes * most * row), ("forwarded", nodes * most * row),
                             ("pair rows", node_tokens * row), ("combine input", comm.size * most * combine_row),
                             ("pair partials", node_tokens * combine_row), ("returned", node_tokens * combine_row),
                             ("arange", 8 * max(node_tokens, node_size))):
            self.scratch.reserve(name, nbytes)

    def _header(self) -> int:
        return _round_up(4 + self.split.ep_size, _ALIGN)

    def _buffer(self, name: str, shape: Sequence[int], dtype: torch.dtype, most: int = 0) -> torch.Tensor:
        return self.scratch.take(name, shape, dtype, most)

    def _arange(self, n: int) -> torch.Tensor:
        return self.scratch.arange(n)

    # ----------------------------------------------------------------------------------------------- dispatch

    def dispatch(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor], runtime_max: int,
                 timeout_s: Optional[float] = None, quant_format: Optional[str] = None,
                 global_scale: Optional[torch.Tensor | float] = None, swizzled_scales: bool = False,
                 eplb_local_stats: None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Steps 1-3 of the module docstring; returns what the flat transports return, in their layout (receive
        buffers shared by the layers of this namespace, valid until its next dispatch)."""
        if not self._alive:
            raise RuntimeError("this MoeAlltoAll was destroyed")
        if torch.compiler.is_compiling():
            raise RuntimeError("transport='hierarchical' runs eagerly or captured in a CUDA graph; torch.compile "
                               "cannot trace it (use transport='nccl' or 'nvlink' inside a compiled region)")
        self.scratch.order.check("dispatch")
        # The flat collective transport's checks and messages (they read max_num_tokens), all before a collective.
        fmt = NcclTransport._check_dispatch(self, topk_ids, payloads, runtime_max, quant_format, global_scale,
                                            swizzled_scales)
        if topk_ids.shape[1] > self.top_k:
            raise ValueError(f"topk_ids has top_k={topk_ids.shape[1]}, this MoeAlltoAll was built for top_k <= "
                             f"{self.top_k}")
        widths = [row_width(p) for p in payloads]
        if fmt is not None:
            widths[:1] = [fmt.value_bytes(payloads[0].shape[1]), fmt.scale_bytes_per_token(payloads[0].shape[1])]
        if sum(widths) > self.dispatch_bytes:
            raise ValueError(f"payloads need {sum(widths)} bytes per token, this MoeAlltoAll was sized for "
                             f"dispatch_bytes_per_token={self.dispatch_bytes}")
        if self.debug and eager_call():
            check_topk_ids_on_host(topk_ids, self.num_experts)
            self._check_same_call(runtime_max)
        wire = list(payloads)
        if fmt is not None:
            wire[:1] = self._quantize(payloads[0], topk_ids, fmt, global_scale)
        layout = _RowLayout(self._header(), tuple(widths))
        mask = rank_mask(topk_ids, self.num_experts, self.split.ep_size)
        forwarded = self._to_nodes(mask, wire, layout, runtime_max)
        rows, counts = self._fan_out(forwarded, runtime_max, self.timeout_s if timeout_s is None else timeout_s)
        recv, gather_rows = self._reorder(rows, counts, wire, layout, runtime_max)
        if fmt is not None and swizzled_scales:  # one 128x4-tile grid per source block, columns padded to 4
            scales = recv[1].view(torch.uint8)
            scales = torch.nn.functional.pad(scales, (0, -scales.shape[2] % 4))
            recv[1] = swizzle_rows(scales, runtime_max).view(fmt.scale_dtype)
        self._pending = _Pending(mask, runtime_max, gather_rows)
        self.scratch.order.advance("dispatch")
        self._calls += 1
        return recv, self.recv_counts

    def _quantize(self, x: torch.Tensor, topk_ids: torch.Tensor, fmt: WireFormat, global_scale) -> list[torch.Tensor]:
        """Values and scales of ``x`` in ``fmt``: on a GPU by the nccl transport's pack kernel for one rank (one
        launch, the NVLink fused dispatch's quantizer), on CPU by its torch twin; the same bits either way."""
        if fmt.name == "nvfp4" and not isinstance(global_scale, torch.Tensor):  # made on the device: no host copy
            global_scale = torch.full((1,), float(global_scale), dtype=torch.float32, device=self.device)
        if self.device.type != "cuda" or x.shape[0] == 0:
            return quantize(x, fmt, global_scale)
        num_tokens, hidden = x.shape
        wire = dispatch_wire(1, num_tokens, [hidden * x.element_size()], fmt, hidden)
        packed = self._buffer("quantized", (wire.total_bytes,), torch.uint8)
        scale = None if global_scale is None else global_scale.reshape(1).float()
        ops.nccl_pack(packed, topk_ids.contiguous(), [x.contiguous()], 1, num_tokens, self.num_experts, fmt.code,
                      scale, False)
        return [wire.segment(packed, 0).view(fmt.value_dtype), wire.segment(packed, 1).view(fmt.scale_dtype)]

    def _to_nodes(self, mask: torch.Tensor, wire: Sequence[torch.Tensor], layout: _RowLayout,
                  runtime_max: int) -> torch.Tensor:
        """Step 1: ``[num_nodes * runtime_max, width]``: block ``j`` holds node ``j``'s rows for this rank's node
        (its peer's tokens bound here first, in increasing token order; then rows bound nowhere here)."""
        split, n, rows = self.split, mask.shape[0], runtime_max
        table = self._buffer("rows", (rows, layout.width), torch.uint8)
        table[:, :4].view(torch.int32).fill_(split.node)
        destinations = table[:, 4 : 4 + split.ep_size]
        destinations[:n] = mask
        destinations[n:] = 0  # padding rows go nowhere
        for payload, offset, width in zip(wire, layout.offsets, layout.widths):
            table[:n, offset : offset + width] = to_bytes(payload)
        bound = destinations.view(rows, split.num_nodes, split.node_size).amax(-1)  # [rows, num_nodes] 0 or 1
        # A stable sort of "not bound there" puts each node's tokens first, in increasing token order.
        order = torch.argsort(1 - bound.t(), dim=1, stable=True)
        send = self._buffer("send", (split.num_nodes * rows, layout.width), torch.uint8)
        torch.index_select(table, 0, order.reshape(-1), out=send)
        received = self._buffer("forwarded", (split.num_nodes * rows, layout.width), torch.uint8)
        self._dist.all_to_all_single(received, send, group=self.peer_group)
        return received

    def _fan_out(self, forwarded: torch.Tensor, runtime_max: int,
                 timeout_s: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2: row ``s`` of ``forwarded`` becomes node-stage tokens ``s * c .. s * c + c - 1``, one per
        destination in this node in increasing local rank (token ``s * c + q`` to the ``q``-th; the rest go
        nowhere). Returns the node stage's ``[node_size, slots, width]`` rows and ``[node_size]`` counts."""
        split, c = self.split, self.pairs
        slots = split.num_nodes * runtime_max
        first = 4 + split.node * split.node_size
        here = forwarded[:, first : first + split.node_size].bool()  # [slots, node_size]
        # Each row's local destinations in increasing order, then node_size for "none": the c smallest keys.
        local = self._arange(split.node_size)
        keys = torch.where(here, local, split.node_size).sort(dim=1).values[:, :c]
        ids = torch.where(keys < split.node_size, keys, -1).to(torch.int32).reshape(slots * c, 1)
        pairs = self._buffer("pair rows", (slots * c, forwarded.shape[1]), torch.uint8)
        torch.index_select(forwarded, 0, self._arange(slots * c) // c, out=pairs)
        recv, counts = self.node_stage.dispatch(ids, [pairs], slots * c, timeout_s, None, None, False)
        return recv[0], counts

    def _reorder(self, rows: torch.Tensor, counts: torch.Tensor, wire: Sequence[torch.Tensor], layout: _RowLayout,
                 runtime_max: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Step 3: the flat receive buffers ``[ep_size, runtime_max, ...]`` and ``recv_counts`` from the node
        stage's rows. Block ``i`` of ``rows`` holds at most one row per forwarded row of local rank ``i``: its
        first ``num_nodes * runtime_max`` rows, by source node, each node's in token order."""
        split = self.split
        size, nodes, total = split.node_size, split.num_nodes, split.ep_size * runtime_max
        slots = nodes * runtime_max
        blocks = rows[:, :slots]
        valid = self._arange(slots).unsqueeze(0) < counts.unsqueeze(1)  # [node_size, slots]
        node = torch.where(valid, blocks[..., :4].view(torch.int32).squeeze(-1), nodes).long()
        per_node = torch.zeros(size, nodes + 1, dtype=torch.int64, device=self.device)
        per_node.scatter_add_(1, node, torch.ones_like(node))
        got = per_node[:, :nodes]  # [node_size, num_nodes]: rows from rank (node j, local i)
        first = got.cumsum(1) - got
        slot = self._arange(slots).unsqueeze(0) - first.gather(1, node.clamp(max=nodes - 1))
        source = node * size + self._arange(size).unsqueeze(1)  # the flat source rank (node * size + local)
        flat_row = torch.where(valid, source * runtime_max + slot, total)  # row `total`: a sink for the rest
        self.recv_counts.copy_(got.t().reshape(-1))
        recv = []
        for i, (payload, offset, width) in enumerate(zip(wire, layout.offsets, layout.widths)):
            most = (split.ep_size * self.max_num_tokens + 1) * width
            buffer = self._buffer(f"recv{i}", (total + 1, *payload.shape[1:]), payload.dtype, most)
            flat = buffer.view(torch.uint8).view(total + 1, width)
            flat.index_put_((flat_row,), blocks[..., offset : offset + width])
            recv.append(buffer[:total].view(split.ep_size, runtime_max, *payload.shape[1:]))
        return recv, torch.where(valid, flat_row, 0)

    def _check_same_call(self, runtime_max: int) -> None:
        """Debug mode: every rank makes the same call with the same runtime_max (a host round trip)."""
        seen = [s.decode() for s in self.comm.allgather(f"{self._calls}:{runtime_max}".encode())]
        if len(set(seen)) != 1:
            calls = ", ".join(f"rank {r}: call {s.replace(':', ' runtime_max ')}" for r, s in enumerate(seen))
            raise RuntimeError(f"ranks disagree on the dispatch call sequence ({calls}); every rank must call "
                               "dispatch/combine the same number of times with the same runtime_max_tokens_per_rank")

    # ------------------------------------------------------------------------------------------------ combine

    def combine_input(self, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        """``[ep_size, runtime_max, hidden]`` for the expert outputs of the pending dispatch (then combine with no
        partials)."""
        pending = self._require_pending("combine_input")
        return self._buffer("combine input", (self.split.ep_size, pending.runtime_max, hidden), dtype)

    def combine(self, partials: Optional[torch.Tensor], out: Optional[torch.Tensor], hidden: int, dtype: torch.dtype,
                timeout_s: Optional[float] = None, quant_format: Optional[str] = None) -> torch.Tensor:
        """``out[t]`` = the partials of the ranks token t went to, summed in increasing rank order in fp32, cast
        to the partials' dtype (``quant_format="fp8_block"``: other ranks' partials cross the network as FP8, as
        :func:`flashinfer_a2a.reference.quant.reference_combine_fp8`)."""
        check_combine_tensors(partials, out)
        pending = self._require_pending("combine")
        partials = self.combine_input(hidden, dtype) if partials is None else partials
        out = self._check_combine(partials, out, pending, quant_format)
        per_pair = self._to_forwarders(partials, pending, self.timeout_s if timeout_s is None else timeout_s)
        rows = self._to_owners(per_pair, quant_format is not None)
        own = None
        if quant_format is not None:  # this rank's partials for its own tokens cross no link: they stay exact
            own = partials[self.split.rank].index_select(0, _slots(pending.mask[:, self.split.rank]))
        self._ordered_sum(rows, pending, own, out)
        self._pending = None
        self.scratch.order.advance("combine")
        return out

    def _check_combine(self, partials: torch.Tensor, out: Optional[torch.Tensor], pending: _Pending,
                       quant_format: Optional[str]) -> torch.Tensor:
        """The flat transports' combine checks and messages; returns ``out`` (made when None)."""
        shape = (self.split.ep_size, pending.runtime_max)
        if partials.dim() != 3 or tuple(partials.shape[:2]) != shape or partials.dtype not in _COMBINE_DTYPES:
            raise ValueError(f"partials must be [ep_size={shape[0]}, runtime_max={shape[1]}, hidden] bf16|fp16|fp32, "
                             f"got {partials.dtype} {tuple(partials.shape)}")
        rows = (pending.mask.shape[0], partials.shape[2])
        if out is not None and (tuple(out.shape) != rows or out.dtype != partials.dtype):
            raise ValueError(f"out must be [num_tokens={rows[0]}, hidden={rows[1]}] {partials.dtype}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        check_combine_format(quant_format, "combine quant_format")
        if quant_format is not None and (partials.dtype == torch.float32 or rows[1] % 8):
            raise ValueError(f"combine quant_format='fp8_block' needs bf16|fp16 partials with hidden % 8 == 0, got "
                             f"{partials.dtype} hidden={rows[1]}")
        return torch.empty(rows, dtype=partials.dtype, device=self.device) if out is None else out

    def _to_forwarders(self, partials: torch.Tensor, pending: _Pending, timeout_s: float) -> torch.Tensor:
        """Combine step 1: ``[slots * c, hidden]``: the partial of the ``q``-th destination of forwarded row ``s``
        at row ``s * c + q`` (the node stage sums one partial per token: it stays as it was)."""
        hidden, dtype = partials.shape[2], partials.dtype
        slots = self.split.num_nodes * pending.runtime_max
        staged = self.node_stage.combine_input(hidden, dtype)  # [node_size, slots * c, hidden]
        staged[:, :slots] = partials.reshape(-1, hidden)[pending.gather_rows]
        per_pair = self._buffer("pair partials", (slots * self.pairs, hidden), dtype)
        self.node_stage.combine(None, per_pair, hidden, dtype, timeout_s, None)
        return per_pair

    def _to_owners(self, per_pair: torch.Tensor, fp8: bool) -> torch.Tensor:
        """Combine step 2: the rows of ``per_pair`` back to the nodes they came from; block ``k`` of the result
        holds node ``k``'s partials for this rank's tokens, ``c`` per row it forwarded (fp32 when FP8)."""
        hidden = per_pair.shape[1]
        wire = combine_wire(per_pair) if fp8 else to_bytes(per_pair)
        back = self._buffer("returned", tuple(wire.shape), torch.uint8)
        self._dist.all_to_all_single(back, wire, group=self.peer_group)
        if not fp8:
            return back.view(per_pair.dtype).view(-1, hidden)
        scales = back[:, hidden : hidden + 4 * -(-hidden // quant.FP8_BLOCK)].contiguous().view(torch.float32)
        return quant.dequantize_fp8_block(back[:, :hidden].view(torch.float8_e4m3fn), scales)

    def _ordered_sum(self, rows: torch.Tensor, pending: _Pending, own: Optional[torch.Tensor],
                     out: torch.Tensor) -> None:
        """``out[t] = ((+0 + p(t, r0)) + p(t, r1)) + ...`` over the ranks r0 < r1 < ... token t went to, one fp32
        addition each, then one rounding to ``out``'s dtype: the flat transports' bits. Node ``k``'s ranks come in
        increasing local rank, as the ``c`` partials of the token's row there."""
        split, c, n = self.split, self.pairs, pending.mask.shape[0]
        by_node = pending.mask.view(n, split.num_nodes, split.node_size)
        reached = by_node.sum(-1)  # [n, num_nodes]: the token's destinations in each node
        row = _slots(reached > 0, dim=0)  # [n, num_nodes]: the token's row among those sent to each node
        if own is not None:  # which of the token's partials from this node is this rank's
            mine = by_node[:, split.node, : split.local].sum(-1)
            mine = torch.where(by_node[:, split.node, split.local], mine, c)
        acc = torch.zeros(out.shape, dtype=torch.float32, device=self.device)
        for k in range(split.num_nodes):
            first = (k * pending.runtime_max + row[:, k]) * c
            for q in range(c):
                picked = rows.index_select(0, first + q).float()
                if own is not None and k == split.node:
                    picked = torch.where((mine == q).unsqueeze(1), own.float(), picked)
                acc = torch.where((reached[:, k] > q).unsqueeze(1), acc + picked, acc)
        out.copy_(acc)

    # -------------------------------------------------------------------------------------------------- state

    def _require_pending(self, what: str) -> _Pending:
        if not self._alive:
            raise RuntimeError("this MoeAlltoAll was destroyed")
        self.scratch.order.check("combine_input", what)  # a dispatch of this namespace is pending
        if self._pending is None:
            raise RuntimeError(f"MoeAlltoAll.{what}: the pending dispatch is another layer's of this namespace (one "
                               "may be pending per namespace): call combine on that layer first")
        return self._pending

    def combine_mode(self, quant_format: Optional[str] = None, runtime_max: Optional[int] = None) -> str:
        check_combine_format(quant_format, "combine quant_format")
        return "pull"  # the owners sum their tokens' partials, whatever the size

    def destroy(self) -> None:
        """Releases the node stage's workspace and the buffers; idempotent."""
        if not self._alive:
            return
        if self._pending is not None:  # the namespace has no pending dispatch any more
            self.scratch.order.reset()
        self.node_stage.destroy()
        shared_scratch.release(self.scratch)
        self._pending = None
        self._alive = False

    active_ranks = property(lambda self: tuple(range(self.comm.size)))

    def set_active_ranks(self, ranks, restore: bool = False) -> None:
        if ranks is not None:  # every rank takes part, as ever
            raise ValueError("active rank sets need transport='nvlink': NCCL's collectives between nodes take every rank")

    def workspace_breakdown(self) -> str:
        split = self.split
        lines = [f"transport hierarchical: {split.num_nodes} nodes of {split.node_size} ranks; the node stage holds "
                 f"{self.pairs} token slots per forwarded row"]
        lines += self.node_stage.workspace_breakdown().splitlines()
        return "\n".join(lines)


def _refused(call: str):
    def refuse(self, *args, **kwargs):
        raise NotImplementedError(f"MoeAlltoAll.{call} needs transport='nvlink' (split-phase calls and stream "
                                  "binding are the one-sided transport's)")

    return refuse


for _call in ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv", "bind_stream"):
    setattr(HierarchicalTransport, _call, _refused(_call))


def _slots(mask: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Each True entry's rank among the True entries before it along ``dim`` (0 where False): the row a token takes
    in the block of the tokens sent the same way."""
    return (torch.cumsum(mask.to(torch.int64), dim=dim) - 1).clamp_min(0)
