"""MoeAlltoAll: the object an engine holds per model — symmetric workspace, dispatch, combine, teardown."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch

from . import config as _config
from . import functional as F
from .agreement import check_agreement, construction_record
from .comm import as_communicator
from .library import sizing
from .library.checks import check_combine_tensors, check_eplb_local_stats
from .library.combine_mode import default_push_combine, pushed_wires
from .library.wire_formats import check_combine_format, wire_format
from .transports.base import Transport
from .transports.hierarchical import HierarchicalTransport, check_transport_choice
from .transports.nccl import NcclTransport, process_group_of, resolve_transport
from .transports.nvlink import NvlinkTransport
from .transports.overlap import check_comm_stream


class MoeAlltoAll:
    """One-sided NVLink dispatch and combine for one expert-parallel group.

    Construction is collective (every rank of ``group`` builds it with the same sizes) and ends with a barrier, so a
    late initialization cannot erase a fast peer's first signal. ``FLASHINFER_A2A_TIMEOUT_S`` and
    ``FLASHINFER_A2A_DEBUG`` are read here, once (docs/environment.md).

    Args:
        group: a ``torch.distributed`` process group (default: the default group; an EP sub-group works), an mpi4py
            communicator, or a :class:`flashinfer_a2a.comm.Communicator`.
        max_num_tokens: most tokens any rank dispatches per call.
        top_k: experts per token (1..32).
        num_experts: experts over all ranks.
        hidden_size: activation width; with ``dtype`` it sizes the dispatch and combine rows.
        dtype: activation dtype dispatched and combined (default bf16).
        extra_dispatch_bytes_per_token: room for further payloads (scales, ...). By default room for int64 top-k ids
            and fp32 top-k weights.
        dispatch_format: the hidden states travel quantized in this format (``"fp8_block"``, ``"mxfp8"`` or
            ``"nvfp4"``, see :mod:`flashinfer_a2a.library.wire_formats`), pre-quantized (values and scales as two
            payloads) or quantized by :meth:`dispatch` (``quant_format``): dispatch rows are sized for its values and
            scales instead of ``dtype``; combine rows stay ``hidden_size`` x ``dtype``.
        swizzled_scales: size for scales received in the 128x4-tile layout (its padding to 128 rows).
        combine_format: ``"fp8_block"`` sizes the combine region for the pushed FP8-wire combine (see
            :func:`flashinfer_a2a.library.wire_formats.push_combine_bytes_per_token`): with every rank on a GPU of its
            own, ``combine(quant_format="fp8_block")`` of 2048 tokens per rank or more (128 on three ranks or more)
            then lands the FP8 rows in their owners' workspaces while the owners sum the rows already there, instead
            of quantizing first and pulling after (which is the faster below; see :meth:`combine_mode`).
        push_combine: size the combine region for the pushed combine of plain ``dtype`` partials too (twice the
            combine bytes per token): with every rank on a GPU of its own, :meth:`combine` then stores each partial
            into its owner's workspace and the owner sums the rows as they land (stores cross NVLink faster than
            loads), instead of every owner pulling the partials after all ranks published them; from 4096 tokens
            per rank only (``runtime_max``; 2048 on three ranks or more), where that is the faster one (2-3% at
            4096-8192 tokens on 2 GPUs, 2-3% at 2048-8192 on 4); below, the combine stays pulled
            (:func:`flashinfer_a2a.library.combine_mode.push_min_tokens`, docs/benchmarks.md). None (default): True
            on the nvlink transport when ``max_num_tokens`` reaches that size and the combine bytes are derived (no
            ``combine_bytes_per_token``), else False; pass False to keep the smaller workspace (the combine then
            always pulls). Ranks sharing a GPU pull whatever the room.
            These two arguments alone choose the pushed combine (see :meth:`combine_mode`); a large
            ``combine_bytes_per_token`` never does.
        dispatch_bytes_per_token, combine_bytes_per_token: explicit sizes instead of those the arguments above derive
            (with ``push_combine`` or ``combine_format`` and ``hidden_size``, at least the pushed combine's size).
        device: this rank's GPU (default: the current device); ``"cpu"`` with ``transport="nccl"`` over gloo.
        transport: ``"nvlink"`` (one-sided, symmetric memory), ``"nccl"`` (the collectives of ``group``, a
            ``torch.distributed`` process group: across nodes, or on CPU over gloo; see
            :mod:`flashinfer_a2a.transports.nccl` and docs/multi_node.md) or ``"auto"``: nvlink when every rank can map
            every peer's memory, decided collectively, else nccl. The same calls, layouts and results either way,
            and both trace under ``torch.compile(fullgraph=True)`` (nccl: padded mode, docs/multi_node.md).
            ``"hierarchical"`` (with ``node_size``): NCCL between nodes, one-sided NVLink inside each (gloo on CPU);
            the same calls and results, eager or in CUDA graphs, not traced by torch.compile.
        exact: nccl only: exchange the counts first (a host synchronisation, eager only), then move only the routed
            rows instead of every rank's ``runtime_max`` rows.
        node_size: with ``transport="hierarchical"``, the ranks of one node (contiguous ranks form a node; it divides
            the group's size): each token crosses the network once per node that holds one of its experts, over
            NCCL, then reaches that node's ranks over NVLink (:mod:`flashinfer_a2a.transports.hierarchical`,
            docs/multi_node.md). Results are the other transports' bit for bit.
        namespace: every MoeAlltoAll of one group and namespace shares one workspace, grown to the largest of their
            sizes (:mod:`flashinfer_a2a.memory.shared_workspace`); give a draft model, or graphs live alongside others,
            a namespace of its own. One dispatch may be pending per shared workspace.
        num_sms: SM budget: the kernels size their grids as if the GPU had this many multiprocessors (None: all),
            so compute running beside them (split-phase calls, :mod:`flashinfer_a2a.split_phase`) keeps the rest.
        comm_stream: where the split halves move the bytes (docs/overlap.md). None (default): on the caller's
            stream, as every call. True: on a communication stream the package owns (one per rank of the group on
            its device, shared by every namespace, high priority), or a ``torch.cuda.Stream`` of this device given
            here: :meth:`dispatch_send` and :meth:`combine_send` queue both kernels of their call there after the
            caller's work so far and return; :meth:`dispatch_recv` and :meth:`combine_recv` make the caller's stream
            wait for them. What the caller queues in between runs beside the transfer, on the multiprocessors
            ``num_sms`` leaves. The whole calls stay on the caller's stream. nvlink transport only.
        eplb_stats_num_experts: length of the EPLB statistics a dispatch may carry (0: none; at most
            :data:`flashinfer_a2a.functional.MAX_EPLB_EXPERTS`): each :meth:`dispatch` given ``eplb_local_stats``
            delivers every rank's in :attr:`eplb_gathered_stats`, inside the dispatch (no extra collective, no host
            synchronisation). nvlink transport only.

    Active ranks (:meth:`set_active_ranks`, or ``active_ranks`` of a dispatch): tokens routed to the experts of a
    rank outside the set are not sent and add nothing to the combine (no top-k renormalisation), its receive count
    is 0, and no kernel waits for it; the set lives in device memory, so CUDA graphs follow the set in force at
    replay. nvlink transport only.
    """

    def __init__(
        self,
        group: Any = None,
        *,
        max_num_tokens: int,
        top_k: int,
        num_experts: int,
        hidden_size: Optional[int] = None,
        dtype: torch.dtype = torch.bfloat16,
        extra_dispatch_bytes_per_token: Optional[int] = None,
        dispatch_format: Optional[str] = None,
        swizzled_scales: bool = False,
        combine_format: Optional[str] = None,
        push_combine: Optional[bool] = None,
        dispatch_bytes_per_token: Optional[int] = None,
        combine_bytes_per_token: Optional[int] = None,
        device: Optional[int | str] = None,
        transport: str = "auto",
        exact: bool = False,
        node_size: Optional[int] = None,
        namespace: str = "default",
        num_sms: Optional[int] = None,
        comm_stream: bool | torch.cuda.Stream | None = None,
        eplb_stats_num_experts: int = 0,
    ) -> None:
        self.comm = as_communicator(group)
        # Before anything is checked or allocated: every rank raises alike on a difference (and on a bad argument).
        check_agreement(self.comm, construction_record(
            ep_size=self.comm.size, max_num_tokens=max_num_tokens, top_k=top_k, num_experts=num_experts,
            hidden_size=hidden_size, dtype=dtype, extra_dispatch_bytes_per_token=extra_dispatch_bytes_per_token,
            dispatch_format=dispatch_format, swizzled_scales=swizzled_scales, combine_format=combine_format,
            push_combine=push_combine, dispatch_bytes_per_token=dispatch_bytes_per_token,
            combine_bytes_per_token=combine_bytes_per_token, transport=transport, exact=exact, node_size=node_size,
            num_sms=num_sms, namespace=namespace,  # the namespace too: sharing and growth must be collective
            comm_stream=comm_stream is not None and comm_stream is not False,
            eplb_stats_num_experts=eplb_stats_num_experts))
        check_transport_choice(transport, exact, node_size, self.comm.size)
        check_comm_stream(comm_stream)
        if num_sms is not None and (not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1):
            raise ValueError(f"num_sms must be None (every multiprocessor) or an int >= 1, got {num_sms!r}")
        self.num_sms = 0 if num_sms is None else num_sms  # 0: the ops' "every multiprocessor"
        if hidden_size is None and (dispatch_bytes_per_token is None or combine_bytes_per_token is None):
            raise ValueError("MoeAlltoAll needs hidden_size, or both dispatch_bytes_per_token and "
                             "combine_bytes_per_token")
        if not 1 <= top_k <= F.MAX_TOP_K:
            raise ValueError(f"top_k must be in [1, {F.MAX_TOP_K}], got {top_k}")
        if hidden_size is not None and hidden_size < 1:
            raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if (not isinstance(eplb_stats_num_experts, int) or isinstance(eplb_stats_num_experts, bool)
                or not 0 <= eplb_stats_num_experts <= F.MAX_EPLB_EXPERTS):
            raise ValueError(f"eplb_stats_num_experts must be an int in [0, {F.MAX_EPLB_EXPERTS}], got "
                             f"{eplb_stats_num_experts!r}")
        self.eplb_stats_num_experts = eplb_stats_num_experts
        self._eplb_gathered: Optional[torch.Tensor] = None
        if push_combine is not None and not isinstance(push_combine, bool):
            raise ValueError(f"push_combine must be None (decided by max_num_tokens and the transport), True or "
                             f"False, got {push_combine!r}")
        # Read once, before any allocation: reading the environment would cost every eager call host time (about
        # 1 us a variable that is not set).
        self._timeout_s, self._debug = _config.timeout_s(), _config.debug()
        extra = top_k * (8 + 4) if extra_dispatch_bytes_per_token is None else extra_dispatch_bytes_per_token
        if dispatch_format is not None:
            wire_format(dispatch_format)  # checked even when unused
        if dispatch_bytes_per_token is None:
            dispatch_bytes_per_token = extra + sizing.hidden_bytes_per_token(hidden_size, dtype, dispatch_format,
                                                                             max_num_tokens, swizzled_scales)
        check_combine_format(combine_format)  # checked even when unused
        pushed = push_combine or combine_format is not None
        if combine_bytes_per_token is not None and hidden_size is not None and pushed:
            needed = sizing.combine_bytes_per_token(hidden_size, dtype, combine_format, bool(push_combine))
            if combine_bytes_per_token < needed:
                raise ValueError(f"combine_bytes_per_token={combine_bytes_per_token} is too small for the pushed "
                                 f"combine that push_combine={push_combine}, combine_format={combine_format!r} ask "
                                 f"for: hidden_size={hidden_size} x {dtype} needs >= {needed}")
        # After every argument check (collective for "auto"): the default push_combine depends on the transport.
        self.transport = resolve_transport(self.comm, transport, device)
        if eplb_stats_num_experts and self.transport != "nvlink":
            raise ValueError(f"eplb_stats_num_experts={eplb_stats_num_experts}: EPLB statistics travel with the "
                             f"nvlink transport only (transport={transport!r} resolved to {self.transport})")
        if push_combine is None:
            push_combine = (combine_bytes_per_token is None
                            and default_push_combine(max_num_tokens, self.comm.size, self.transport))
        if combine_bytes_per_token is None:
            combine_bytes_per_token = sizing.combine_bytes_per_token(hidden_size, dtype, combine_format, push_combine)
        self.hidden_size, self.dtype, self.num_experts = hidden_size, dtype, num_experts
        #: what this layer needs; ``config`` is the shared workspace's (at least this in every size)
        self.requested = F.WorkspaceConfig(ep_size=self.comm.size, max_num_tokens=max_num_tokens,
                                           dispatch_bytes_per_token=dispatch_bytes_per_token,
                                           combine_bytes_per_token=combine_bytes_per_token, top_k=top_k)
        self._transport: Transport
        if self.transport == "nccl":  # no workspace: every call goes to the process group's collectives
            if comm_stream is not None and comm_stream is not False:
                raise ValueError("comm_stream is for the split halves, which the nccl transport does not have "
                                 f"(transport={transport!r} resolved to nccl): pass comm_stream=None")
            self._transport = NcclTransport(process_group_of(self.comm), num_experts=num_experts,
                                            max_num_tokens=max_num_tokens, device=device, exact=exact,
                                            debug=self._debug)
        elif self.transport == "hierarchical":  # NCCL between nodes, the node's own transport inside
            self._transport = HierarchicalTransport(self.comm, node_size=node_size, num_experts=num_experts,
                                                    requested=self.requested, device=device, namespace=namespace,
                                                    num_sms=self.num_sms, timeout_s=self._timeout_s,
                                                    debug=self._debug)
        else:  # the combine mode comes from arguments every rank agreed on, so every rank picks the same one
            self._transport = NvlinkTransport(self.comm, group, namespace, self.requested, device,
                                              num_experts=num_experts, num_sms=self.num_sms,
                                              pushed_wires=pushed_wires(push_combine, combine_format),
                                              timeout_s=self._timeout_s, debug=self._debug,
                                              comm_stream=comm_stream)
        self.device = self._transport.device

    @property
    def config(self) -> F.WorkspaceConfig:
        """The workspace's sizes: the shared workspace's (at least :attr:`requested` in every size; a later layer
        may have grown it), or :attr:`requested` without one."""
        return getattr(self._transport, "config", None) or self.requested

    workspace = property(lambda self: getattr(self._transport, "workspace", None))
    metainfo = property(lambda self: self._transport.metainfo)

    @property
    def ep_rank(self) -> int:
        return self.comm.rank

    @property
    def ep_size(self) -> int:
        return self.comm.size

    def dispatch(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor],
                 runtime_max_tokens_per_rank: Optional[int] = None, *, timeout_s: Optional[float] = None,
                 quant_format: Optional[str] = None, global_scale: Optional[torch.Tensor | float] = None,
                 swizzled_scales: bool = False, eplb_local_stats: Optional[torch.Tensor] = None,
                 active_ranks: Optional[Iterable[int]] = None):
        """Sends each token's payload rows to the ranks of its top-k experts (see
        :func:`flashinfer_a2a.functional.dispatch`). Returns ``(recv_payloads, recv_counts)``: views
        ``[ep_size, runtime_max, ...]`` of the workspace and ``[ep_size] int32``, both valid until the next dispatch
        (eager calls return the same tensors each time: they cost host time to make).

        ``runtime_max_tokens_per_rank`` (default ``max_num_tokens``) must be the same on every rank.
        ``quant_format`` / ``global_scale`` / ``swizzled_scales``: quantize ``payloads[0]`` while sending it (see
        :func:`flashinfer_a2a.functional.dispatch`); it then arrives as two views, values and scales.
        ``eplb_local_stats``: this rank's ``[eplb_stats_num_experts] int32`` EPLB statistics; every rank's are then in
        :attr:`eplb_gathered_stats`. ``active_ranks``: the active set from this step on (:meth:`set_active_ranks`;
        None keeps the set in force; it may drop ranks, never take them back: :meth:`set_active_ranks`).
        """
        stats = self._eplb_stats(eplb_local_stats, active_ranks)
        result = self._transport.dispatch(topk_ids, payloads, self._runtime_max(runtime_max_tokens_per_rank),
                                          self._timeout(timeout_s), quant_format, global_scale, swizzled_scales,
                                          stats)
        self._gathered(stats)
        return result

    def dispatch_send(self, topk_ids: torch.Tensor, payloads: Sequence[torch.Tensor],
                      runtime_max_tokens_per_rank: Optional[int] = None, *, timeout_s: Optional[float] = None,
                      quant_format: Optional[str] = None, global_scale: Optional[torch.Tensor | float] = None,
                      swizzled_scales: bool = False, eplb_local_stats: Optional[torch.Tensor] = None,
                      active_ranks: Optional[Iterable[int]] = None) -> None:
        """The send half of :meth:`dispatch` (same arguments; :mod:`flashinfer_a2a.split_phase`):
        :meth:`dispatch_recv` returns what dispatch does."""
        stats = self._eplb_stats(eplb_local_stats, active_ranks)
        self._transport.dispatch_send(topk_ids, payloads, self._runtime_max(runtime_max_tokens_per_rank),
                                      self._timeout(timeout_s), quant_format, global_scale, swizzled_scales, stats)
        self._gathered(stats)

    def dispatch_recv(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Waits for the peers' :meth:`dispatch_send` and returns ``(recv_payloads, recv_counts)``, as
        :meth:`dispatch` does."""
        return self._transport.dispatch_recv()

    def combine_input(self, hidden: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The zero-copy combine input ``[ep_size, runtime_max, hidden]`` of the pending dispatch: write the expert
        outputs here and call :meth:`combine` with no partials."""
        return self._transport.combine_input(*self._combine_row(hidden, dtype))

    def combine_mode(self, quant_format: Optional[str] = None, runtime_max: Optional[int] = None) -> str:
        """``"push"`` or ``"pull"``: how :meth:`combine` with this ``quant_format`` after a dispatch of
        ``runtime_max`` tokens per rank (default: the pending dispatch's, else ``max_num_tokens``) moves the
        partials. Pushed where the construction asked for it (``push_combine``, or ``combine_format`` equal to
        ``quant_format``) and every rank has a GPU of its own (ranks sharing one always pull), and only from
        :func:`flashinfer_a2a.library.combine_mode.push_min_tokens` tokens per rank (plain partials: 4096 on two
        ranks, 2048 on more; the FP8 wire: 2048 and 128), below which the pulled combine is the faster one."""
        return self._transport.combine_mode(quant_format, runtime_max)

    def combine(self, partials: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
                timeout_s: Optional[float] = None, quant_format: Optional[str] = None,
                active_ranks: Optional[Iterable[int]] = None) -> torch.Tensor:
        """Sums each local token's partials over the ranks it went to, in increasing rank order in fp32 (see
        :func:`flashinfer_a2a.functional.combine`). ``partials`` None means :meth:`combine_input` was written.
        ``quant_format="fp8_block"``: the partials cross NVLink as FP8 with block scales. ``active_ranks``, if
        given, must be the dispatch's set (the set changes only between steps)."""
        check_combine_tensors(partials, out)  # first: the row shape is read off them below
        self._check_active(active_ranks)
        given = partials if partials is not None else out  # a row shape given wins over the constructor's
        hidden, dtype = self._combine_row(*((given.shape[-1], given.dtype) if given is not None else (None, None)))
        return self._transport.combine(partials, out, hidden, dtype, self._timeout(timeout_s), quant_format)

    def combine_send(self, partials: Optional[torch.Tensor] = None, *, out: Optional[torch.Tensor] = None,
                     timeout_s: Optional[float] = None, quant_format: Optional[str] = None,
                     active_ranks: Optional[Iterable[int]] = None) -> None:
        """The send half of :meth:`combine` (same arguments): publishes this rank's partials (None:
        :meth:`combine_input` was written). Keep ``partials`` unchanged until :meth:`combine_recv` has run.
        ``out`` here or at :meth:`combine_recv` (with ``comm_stream`` here only: the send queues the receive kernel,
        which writes it)."""
        check_combine_tensors(partials, out)
        self._check_active(active_ranks)
        self._transport.combine_send(partials, *self._combine_row(None, None), self._timeout(timeout_s),
                                     quant_format, out)

    def combine_recv(self, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Waits for the peers' :meth:`combine_send` and returns ``out`` ``[num_tokens, hidden]`` (allocated when
        None, or the one given to :meth:`combine_send`), as :meth:`combine` does."""
        check_combine_tensors(None, out)
        return self._transport.combine_recv(out, *self._combine_row(None, None))

    @property
    def active_ranks(self) -> tuple[int, ...]:
        """The active set in force for this layer's workspace (every rank unless set otherwise)."""
        return self._transport.active_ranks

    def set_active_ranks(self, ranks: Optional[Iterable[int]] = None) -> None:
        """Makes ``ranks`` (None: every rank; it must include this rank) the active set of every layer sharing this
        workspace, from the next dispatch on: tokens routed to the experts of other ranks are not sent and add
        nothing to combines, their receive counts are 0, and no kernel waits for them; ranks outside the set make no
        calls. Between a combine and the next dispatch, never during a CUDA-graph capture (graphs captured before
        follow the set in force at replay). Dropping ranks takes no collective. ``None`` (every rank) is the way
        back, collective over the whole group at one step, the returning ranks included: each synchronises its
        stream, and a rank that missed steps takes the epoch of the ranks that stayed. nvlink transport only."""
        if ranks is None or set(ranks) == set(range(self.ep_size)):
            self._transport.set_active_ranks(None, restore=True)
        else:
            self._transport.set_active_ranks(ranks)

    @property
    def eplb_gathered_stats(self) -> Optional[torch.Tensor]:
        """``[ep_size, eplb_stats_num_experts] int32``: every rank's EPLB statistics carried by the last dispatch
        given ``eplb_local_stats`` (row r: rank r's; 0 for a rank outside the active set), a view of the workspace
        valid until this rank's combine (after it a peer's next dispatch may store its next statistics there);
        None if the last dispatch carried none."""
        return self._eplb_gathered

    def _eplb_stats(self, stats: Optional[torch.Tensor], active_ranks: Optional[Iterable[int]]) -> Optional[torch.Tensor]:
        """Before a dispatch: the active set it asks for, and its EPLB statistics checked against this layer."""
        if stats is not None:
            if not self.eplb_stats_num_experts:
                raise ValueError("eplb_local_stats given, but this MoeAlltoAll was built with "
                                 "eplb_stats_num_experts=0")
            check_eplb_local_stats(stats, self.workspace, num_experts=self.eplb_stats_num_experts)
        if active_ranks is not None:
            self._transport.set_active_ranks(active_ranks)
        return stats

    def _gathered(self, stats: Optional[torch.Tensor]) -> None:
        self._eplb_gathered = None if stats is None else F.eplb_gathered_stats(
            self.workspace, self.comm.rank, self.config, self.eplb_stats_num_experts)

    def _check_active(self, active_ranks: Optional[Iterable[int]]) -> None:
        if active_ranks is not None and tuple(sorted(active_ranks)) != self.active_ranks:
            raise ValueError(f"active_ranks={sorted(active_ranks)} differ from the dispatch's "
                             f"{list(self.active_ranks)}: a combine runs with its dispatch's set")

    def _runtime_max(self, runtime_max_tokens_per_rank: Optional[int]) -> int:
        runtime_max = self.config.max_num_tokens if runtime_max_tokens_per_rank is None else runtime_max_tokens_per_rank
        if not 0 <= runtime_max <= self.config.max_num_tokens:
            raise ValueError(f"runtime_max_tokens_per_rank={runtime_max} exceeds max_num_tokens="
                             f"{self.config.max_num_tokens} this MoeAlltoAll was built for")
        return runtime_max

    def _timeout(self, timeout_s: Optional[float]) -> float:
        return self._timeout_s if timeout_s is None else timeout_s

    def workspace_breakdown(self) -> str:
        """Human-readable sizes of one rank's workspace."""
        return self._transport.workspace_breakdown()

    def destroy(self) -> None:
        """Releases this layer's share of the workspace; the last layer of its group and namespace frees this rank's
        mappings after a barrier bounded by ``FLASHINFER_A2A_TIMEOUT_S`` (if a peer is gone, alone, with a warning).
        Receive views kept past this keep the memory mapped until they die (they read stale rows, never fault);
        dispatch/combine on this instance raise. Collective while the peers live. Idempotent."""
        self._transport.destroy()

    def bind_stream(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        """Not needed: the steps of every instance sharing this workspace are ordered across streams by the package
        (docs/semantics.md, "Streams and threads"). Takes ``stream`` (default: the current one) as the stream of the
        last step without making it wait, for a caller that ordered the streams already."""
        self._transport.bind_stream(stream)

    def _combine_row(self, hidden: Optional[int], dtype: Optional[torch.dtype]) -> tuple[int, torch.dtype]:
        dtype = self.dtype if dtype is None else dtype
        if hidden is None:
            if self.hidden_size is None:
                raise ValueError("pass hidden: this MoeAlltoAll was built from byte sizes")
            hidden = self.hidden_size
        if hidden * dtype.itemsize > self.config.combine_bytes_per_token:
            raise ValueError(f"combine rows of {hidden} x {dtype} exceed combine_bytes_per_token="
                             f"{self.config.combine_bytes_per_token}")
        return hidden, dtype
