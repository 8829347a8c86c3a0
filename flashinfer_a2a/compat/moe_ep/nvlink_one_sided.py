"""FlashInfer 0.7.4's ``nvlink_one_sided`` backend, :class:`NVLinkOneSidedAlltoAll`, over the native
:class:`flashinfer_a2a.MoeAlltoAll`.

A dispatch sends the activations (and their scales), the top-k ids as int32 and the top-k weights as the payloads of
one native dispatch, and returns its receive views flattened to ``[ep_size * tokens_per_rank, ...]`` rows, the ids'
padding rows set to ``invalid_expert_id``. A combine takes the experts' rows from the buffer
:meth:`NVLinkOneSidedAlltoAll.get_combine_input_buffer` handed out (recognised by its address: no copy) or from any
tensor. Layers with the same sizes share one workspace, as FlashInfer's instances of one layout do.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from ... import functional as F
from ...comm import as_communicator
from ...moe_alltoall import MoeAlltoAll
from ..comm_backend import CommBackend, CommBackendCommunicator
from ..flashinfer import (WorkspaceCheckpoint, active_ranks_change, check_combine_ranks, rank_mask, refuse_released,
                          requested_ranks)
from .communication import (QUANTIZING_FORMATS, MoEEpCommParams, MoEEpCommunication, MoEEpDispatchResult,
                            format_name, register_communication)
from .config import BootstrapConfig, NVLinkOneSidedConfig, check_config

# uint64 words of FlashInfer 0.7.4's active_rank_mask: its MAX_RANKS (256) bits.
RANK_MASK_WORDS = 4
# Options passed on to flashinfer_a2a.MoeAlltoAll as they are (its docstring says what each does).
NATIVE_OPTIONS = ("transport", "device", "namespace", "push_combine", "num_sms", "comm_stream", "exact", "node_size")


@register_communication("nvlink_one_sided")
class NVLinkOneSidedAlltoAll(MoEEpCommunication):
    """Rank-major dispatch and combine for one EP group (FlashInfer 0.7.4's class, same constructor and calls).

    Built by :func:`flashinfer_a2a.compat.moe_ep.create_communication` (collective). ``config`` is an
    :class:`NVLinkOneSidedConfig` (its docstring says what each field selects here). Our extras, keyword-only:

    - ``quantize_dispatch=True``: with ``dispatch_format`` DeepSeekFp8, MXFP8 or NVFP4, :meth:`dispatch` takes bf16 or
      fp16 ``hidden_states`` (no ``hidden_states_scale``) and quantizes them while sending (FlashInfer sends rows
      the caller quantized); the result carries the values and their scales, bitwise as
      :mod:`flashinfer_a2a.reference.quant`. ``global_scale``: NVFP4's per-tensor fp32 scale (a float, or a
      one-element device tensor read at each step, so captured graphs see its current value).
    - ``transport``, ``device``, ``namespace``, ``push_combine``, ``num_sms``, ``comm_stream``, ``exact``,
      ``node_size``: passed to :class:`flashinfer_a2a.MoeAlltoAll` (``transport`` defaults to ``"nvlink"``;
      ``"nccl"`` runs the same calls over the process group's collectives, across nodes or on CPU over gloo).
    - :attr:`native`: the :class:`flashinfer_a2a.MoeAlltoAll` underneath (split halves, combine modes, the
      workspace breakdown); :attr:`recv_counts`: the last dispatch's ``[ep_size] int32`` rows received per source.
    """

    def __init__(self, bootstrap: BootstrapConfig, params: MoEEpCommParams,
                 config: Optional[NVLinkOneSidedConfig] = None, *, quantize_dispatch: bool = False,
                 global_scale: Optional[torch.Tensor | float] = None, **native_options: Any) -> None:
        self.config = config = NVLinkOneSidedConfig() if config is None else config
        if not isinstance(config, NVLinkOneSidedConfig):
            raise TypeError(f"config must be an NVLinkOneSidedConfig, got {type(config).__name__}")
        check_config(config, params.num_experts)
        unknown = sorted(set(native_options) - set(NATIVE_OPTIONS))
        if unknown:
            raise TypeError(f"NVLinkOneSidedAlltoAll got unexpected options {unknown}; the native ones it passes on "
                            f"are {list(NATIVE_OPTIONS)}")
        self._quant = _quantizing_format(params, quantize_dispatch, global_scale)
        self._global_scale = global_scale
        self._options = {"transport": "nvlink", **native_options}
        group: Any = bootstrap.process_group
        if config.comm_backend is not None:
            group = CommBackendCommunicator(config.comm_backend)
        # a communicator that hands out the workspace (simulated ranks) needs no symmetric memory
        self._simulated = callable(getattr(group, "allocate_workspace", None))
        super().__init__(bootstrap, params)
        comm = as_communicator(group)
        if (comm.rank, comm.size) != (bootstrap.rank, bootstrap.world_size):
            raise ValueError(f"the communicator is rank {comm.rank} of {comm.size}, but bootstrap says rank "
                             f"{bootstrap.rank} of world_size={bootstrap.world_size}: pass the EP group")
        values, scales, _ = params.wire_rows()
        # hidden states (values and scales), int32 ids, weights of up to 4 bytes, and the room the config asks for
        dispatch_bytes = values + scales + 2 * params.top_k * 4 + config.extra_payload_bytes_per_token
        self._combine_format = "fp8_block" if config.use_low_precision_combine else None
        options = dict(self._options)
        namespace = options.pop("namespace", None) or _layout_namespace(params, dispatch_bytes, config)
        if options.get("device") is None:
            options["device"] = bootstrap.device
        refuse_released(group, comm, namespace)
        self.native = MoeAlltoAll(group, max_num_tokens=params.max_tokens_per_rank, top_k=params.top_k,
                                  num_experts=params.num_experts, hidden_size=params.hidden_size,
                                  dtype=params.token_dtype, dispatch_bytes_per_token=dispatch_bytes,
                                  combine_format=self._combine_format,
                                  eplb_stats_num_experts=config.eplb_stats_num_experts, namespace=namespace,
                                  **options)
        self._workspace = WorkspaceCheckpoint(self.native)
        #: no Lamport transport here (FlashInfer: the largest step it takes, 0 when none)
        self.lamport_max_tokens = 0
        #: ``[ep_size] int32``: rows received from each source rank by the last dispatch (on the device)
        self.recv_counts: Optional[torch.Tensor] = None
        self._round: Optional[tuple[int, int]] = None  # (tokens_per_rank, num_tokens) of this object's dispatch
        self._given: tuple[torch.Tensor, ...] = ()  # the combine buffers handed out for it
        self._destroyed = False

    @classmethod
    def is_platform_supported(cls) -> bool:
        """Whether the default (nvlink) transport can run here: a CUDA device is present. The nccl transport runs
        anywhere ``torch.distributed`` does; ``MoeAlltoAll(transport="auto")`` picks between them."""
        return torch.cuda.is_available()

    def _platform_supported(self) -> bool:
        return self._options["transport"] != "nvlink" or self._simulated or self.is_platform_supported()

    @property
    def lamport_enabled(self) -> bool:
        """False: flashinfer_a2a has no Lamport transport (every step takes the one-sided path)."""
        return False

    workspace = property(lambda self: self.native.workspace, doc="The workspace tensor (None: nccl transport).")
    metainfo = property(lambda self: self.native.metainfo, doc="The workspace's layout entries.")

    def active_rank_mask(self, active_ranks: Iterable[int]) -> torch.Tensor:
        """The CPU ``[4] uint64`` mask of ``active_ranks`` (bit ``r`` for rank ``r``) for ``active_rank_mask``."""
        return rank_mask(active_ranks, self.ep_size, RANK_MASK_WORDS)

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor] = None,
                 *, hidden_states_scale: Optional[torch.Tensor] = None,
                 runtime_max_tokens_per_rank: Optional[int] = None, eplb_local_stats: Optional[torch.Tensor] = None,
                 active_rank_mask: Optional[torch.Tensor] = None) -> MoEEpDispatchResult:
        """Sends each token to the ranks owning its experts (see :mod:`flashinfer_a2a.compat.moe_ep.communication`).

        ``hidden_states`` ``[num_tokens, ...]`` must match ``dispatch_format`` (with its ``hidden_states_scale``
        ``[num_tokens, ...]`` where the format has per-block scales); ``topk_ids`` ``[num_tokens, top_k]`` int32 or
        int64 global expert ids (-1: no expert); ``topk_weights`` ``[num_tokens, top_k]`` of up to 4 bytes each.
        ``runtime_max_tokens_per_rank`` in ``(0, max_tokens_per_rank]``, the same on every rank (None: the
        capacity). ``eplb_local_stats`` ``[eplb_stats_num_experts] int32`` on the layer's device: every rank's
        arrive in ``eplb_gathered_stats`` ``[ep_size, n]`` (rows ``MAX_EPLB_EXPERTS`` apart, zeros for inactive
        ranks). ``active_rank_mask`` (with ``enable_rank_mask``; :meth:`active_rank_mask` makes one, None means every
        rank): tokens routed to other ranks' experts are dropped (no top-k renormalisation), and the set stays in
        force for every layer of the workspace (CUDA graphs follow the set in force at replay). To take ranks back,
        every rank of the group, the returning ones included, calls ``native.set_active_ranks`` at one step. Every
        check runs before anything is launched.
        """
        if self._destroyed:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        if self._round is not None:
            raise RuntimeError("dispatch called twice without an intervening combine")
        ranks = requested_ranks(active_rank_mask, self.config.enable_rank_mask, self.ep_size, self.ep_rank,
                                RANK_MASK_WORDS)
        tokens_per_rank = self._resolve_runtime_max_tokens_per_rank(runtime_max_tokens_per_rank)
        ids, payloads = self._payloads(hidden_states, topk_ids, topk_weights, hidden_states_scale, tokens_per_rank)
        self._workspace.check_attached("dispatch")
        recv, counts = self.native.dispatch(ids, payloads, tokens_per_rank, timeout_s=float(self.config.timeout_sec),
                                            quant_format=self._quant, global_scale=self._global_scale,
                                            eplb_local_stats=eplb_local_stats,
                                            active_ranks=active_ranks_change(self.native, ranks))
        scaled = self._quant is not None or hidden_states_scale is not None
        _sanitize(recv[1 + scaled], counts, self.params.invalid_expert_id)
        self._round, self._given, self.recv_counts = (tokens_per_rank, ids.shape[0]), (), counts
        rows = [view.flatten(0, 1) for view in recv]
        return MoEEpDispatchResult(
            hidden_states=rows[0], topk_ids=rows[1 + scaled],
            topk_weights=rows[2 + scaled] if topk_weights is not None else None, tokens_per_rank=tokens_per_rank,
            hidden_states_scale=rows[1] if scaled else None,
            eplb_gathered_stats=self.native.eplb_gathered_stats if eplb_local_stats is not None else None)

    def get_combine_input_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """``[ep_size * tokens_per_rank, hidden_size]`` of ``dtype`` in this rank's workspace, for the pending
        dispatch: the experts write their rows here, and :meth:`combine` given it (or its ``[ep_size,
        tokens_per_rank, hidden_size]`` view) publishes them without a copy."""
        if self._round is None:
            raise RuntimeError("get_combine_input_buffer called before dispatch")
        self._workspace.check_attached("get_combine_input_buffer")
        region = self.native.combine_input(self.params.hidden_size, dtype)
        rows = region.view(-1, self.params.hidden_size)
        self._given = (*self._given, rows, region)
        return rows

    def combine(self, expert_output: torch.Tensor, *, output: Optional[torch.Tensor] = None,
                active_rank_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[num_tokens, hidden]``: each token's rows of ``expert_output`` (``[ep_size * tokens_per_rank, hidden]``
        or ``[ep_size, tokens_per_rank, hidden]``, bf16, fp16 or fp32) summed over the ranks it went to, in
        increasing rank order in fp32 (bitwise reproducible), into ``output`` if given. ``active_rank_mask``: the
        dispatch's. With ``use_low_precision_combine`` the rows cross as FP8 with an fp32 scale per 128."""
        if self._round is None:
            raise RuntimeError("combine called before dispatch")
        ranks = requested_ranks(active_rank_mask, self.config.enable_rank_mask, self.ep_size, self.ep_rank,
                                RANK_MASK_WORDS)
        check_combine_ranks(ranks, self.native)
        tokens_per_rank, num_tokens = self._round
        partials = _partials(expert_output, self.ep_size, tokens_per_rank)
        self._workspace.check_attached("combine")
        if output is None:
            output = torch.empty(num_tokens, partials.shape[-1], dtype=partials.dtype, device=partials.device)
        result = self.native.combine(None if self._is_combine_buffer(expert_output) else partials, out=output,
                                     timeout_s=float(self.config.timeout_sec), quant_format=self._combine_format)
        self._round, self._given = None, ()
        return result

    def _is_combine_buffer(self, expert_output: torch.Tensor) -> bool:
        """Whether ``expert_output`` is the buffer :meth:`get_combine_input_buffer` handed out for this dispatch
        (by address; the very tensor while torch.compile traces, where tensors have no address)."""
        if torch.compiler.is_compiling():
            return any(expert_output is given for given in self._given)
        return any(expert_output.data_ptr() == given.data_ptr() and expert_output.dtype == given.dtype
                   and expert_output.shape == given.shape and expert_output.is_contiguous() for given in self._given)

    def checkpoint_prepare(self) -> None:
        """Releases the workspace's memory before a process checkpoint, keeping its addresses (see
        :meth:`flashinfer_a2a.compat.flashinfer.MoeAlltoAll.checkpoint_prepare`). Collective; covers every layer of
        the workspace; RuntimeError on every rank while any rank has a dispatch awaiting its combine."""
        if self._destroyed:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        self._workspace.prepare()

    def checkpoint_restore(self, comm_backend: CommBackend) -> None:
        """Maps new memory at the workspace's addresses after a restore and re-initializes it, over
        ``comm_backend`` (same rank and size). Collective; a no-op unless :meth:`checkpoint_prepare` released it.
        Captured CUDA graphs replay as before; rows received before the checkpoint are gone."""
        if self._destroyed:
            raise RuntimeError("NVLinkOneSidedAlltoAll has been destroyed")
        self._workspace.restore(comm_backend)
        self._round, self._given = None, ()

    def destroy(self) -> None:
        """Releases this layer's share of the workspace (the last layer frees it). Collective, idempotent."""
        if self._destroyed:
            return
        self._destroyed, self._round, self._given = True, None, ()
        self._workspace.destroy()

    def _payloads(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                  hidden_states_scale: Optional[torch.Tensor],
                  tokens_per_rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The int32 ids and the payload list of a dispatch, after checking every tensor against the params."""
        params = self.params
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != params.top_k:
            raise ValueError(f"topk_ids must be [num_tokens, top_k={params.top_k}], got {list(topk_ids.shape)}")
        num_tokens = topk_ids.shape[0]
        if num_tokens > tokens_per_rank:
            raise ValueError(f"topk_ids has {num_tokens} tokens, more than runtime_max_tokens_per_rank="
                             f"{tokens_per_rank} (the same on every rank: the most tokens any rank sends)")
        if self._quant is not None:
            if hidden_states.dtype not in (torch.bfloat16, torch.float16) or \
                    tuple(hidden_states.shape) != (num_tokens, params.hidden_size):
                raise ValueError(f"hidden_states: quantize_dispatch quantizes [num_tokens={num_tokens}, hidden_size="
                                 f"{params.hidden_size}] bf16|fp16 rows, got {hidden_states.dtype} "
                                 f"{list(hidden_states.shape)}")
            if hidden_states_scale is not None:
                raise ValueError("hidden_states_scale: quantize_dispatch makes the scales; pass none")
        else:
            _check_wire_rows(params, hidden_states, hidden_states_scale, num_tokens)
        if topk_weights is not None and (topk_weights.dim() != 2 or tuple(topk_weights.shape) !=
                                         (num_tokens, params.top_k) or topk_weights.element_size() > 4):
            raise ValueError(f"topk_weights must be [num_tokens={num_tokens}, top_k={params.top_k}] of up to 4 "
                             f"bytes each, got {topk_weights.dtype} {list(topk_weights.shape)}")
        ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
        scale = [hidden_states_scale] if hidden_states_scale is not None else []
        weights = [topk_weights] if topk_weights is not None else []
        return ids, [hidden_states, *scale, ids, *weights]


def _quantizing_format(params: MoEEpCommParams, quantize_dispatch: bool,
                       global_scale: Optional[torch.Tensor | float]) -> Optional[str]:
    """Our wire format for ``quantize_dispatch`` (None: the rows travel as the caller made them), checked."""
    name = format_name(params.dispatch_format)
    if not quantize_dispatch:
        if global_scale is not None:
            raise ValueError("global_scale is for quantize_dispatch=True with dispatch_format=QuantFormat.NVFP4")
        return None
    if name not in QUANTIZING_FORMATS:
        raise ValueError(f"quantize_dispatch=True needs dispatch_format QuantFormat.DeepSeekFp8, MXFP8 or NVFP4, got "
                         f"{params.dispatch_format!r}")
    if params.token_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"quantize_dispatch=True quantizes bf16|fp16 rows, but MoEEpCommParams.dtype is "
                         f"{params.token_dtype}")
    if (global_scale is None) != (name != "NVFP4"):
        raise ValueError(f"global_scale is required with dispatch_format=QuantFormat.NVFP4 and only there, got "
                         f"{global_scale!r} for {params.dispatch_format!r}")
    return QUANTIZING_FORMATS[name]


def _layout_namespace(params: MoEEpCommParams, dispatch_bytes: int, config: NVLinkOneSidedConfig) -> str:
    """The workspace namespace of a layer: layers of the same sizes share one workspace (FlashInfer shares one per
    layout), any other layer gets its own."""
    combine_bytes = params.hidden_size * max(params.token_dtype.itemsize, 2)
    return (f"flashinfer-moe-ep:{params.max_tokens_per_rank}:{params.top_k}:{dispatch_bytes}:{combine_bytes}:"
            f"{int(config.use_low_precision_combine)}:{config.eplb_stats_num_experts}")


def _row_bytes(tensor: torch.Tensor, name: str, num_tokens: int) -> int:
    if tensor.dim() < 2 or tensor.shape[0] != num_tokens:
        raise ValueError(f"{name} must be [num_tokens={num_tokens}, ...], got {list(tensor.shape)}")
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _check_wire_rows(params: MoEEpCommParams, hidden_states: torch.Tensor, scale: Optional[torch.Tensor],
                     num_tokens: int) -> None:
    """``hidden_states`` (and ``scale``) hold what ``params.dispatch_format`` carries per token."""
    values, scales, dtype = params.wire_rows()
    fmt = f"dispatch_format={params.dispatch_format!r}"
    got = _row_bytes(hidden_states, "hidden_states", num_tokens)
    if got != values or (dtype is not None and hidden_states.dtype != dtype):
        want = f"{dtype} [num_tokens, {params.hidden_size}]" if dtype is not None else f"{values} bytes a token"
        raise ValueError(f"hidden_states: {fmt} carries {want} (hidden_size={params.hidden_size}), got "
                         f"{hidden_states.dtype} {list(hidden_states.shape)}")
    if not scales and scale is not None:
        raise ValueError(f"hidden_states_scale: {fmt} carries no per-token scales; pass none")
    if scales and scale is None:
        raise ValueError(f"hidden_states_scale is required: {fmt} carries {scales} bytes of scales a token")
    if scales and _row_bytes(scale, "hidden_states_scale", num_tokens) != scales:
        raise ValueError(f"hidden_states_scale: {fmt} carries {scales} bytes of scales a token (hidden_size="
                         f"{params.hidden_size}), got {scale.dtype} {list(scale.shape)}")


def _partials(expert_output: torch.Tensor, ep_size: int, tokens_per_rank: int) -> torch.Tensor:
    """``expert_output`` as ``[ep_size, tokens_per_rank, hidden]``."""
    if expert_output.dim() == 2 and expert_output.shape[0] == ep_size * tokens_per_rank:
        return expert_output.view(ep_size, tokens_per_rank, expert_output.shape[1])
    if expert_output.dim() == 3 and tuple(expert_output.shape[:2]) == (ep_size, tokens_per_rank):
        return expert_output
    raise ValueError(f"expert_output must be [ep_size * tokens_per_rank = {ep_size * tokens_per_rank}, hidden] or "
                     f"[{ep_size}, {tokens_per_rank}, hidden], got {list(expert_output.shape)}")


def _sanitize(recv_ids: torch.Tensor, recv_counts: torch.Tensor, invalid_id: int) -> None:
    """Sets every id of the rows past each source's count to ``invalid_id`` (``recv_ids`` ``[ep_size, T, top_k]``):
    the kernel on a GPU, the same rule in torch on the CPU (the nccl transport over gloo)."""
    if recv_ids.is_cuda:
        F.sanitize_expert_ids(recv_ids, recv_counts, invalid_id)
        return
    rows = torch.arange(recv_ids.shape[1], device=recv_ids.device)
    recv_ids.masked_fill_((rows[None, :] >= recv_counts[:, None].to(rows.dtype))[..., None], invalid_id)
