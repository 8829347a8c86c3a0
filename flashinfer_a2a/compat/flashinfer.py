"""FlashInfer's ``MoeAlltoAll`` API (``flashinfer.comm``, 0.7.x) over flashinfer_a2a: an engine changes its import
line and nothing else::

    from flashinfer_a2a.compat.flashinfer import Mapping, MnnvlConfig, MoeAlltoAll, moe_a2a_get_workspace_size_per_rank

Same names, signatures (positional and keyword, as in FlashInfer 0.7.2) and call sequence, checkpoint and restore
included (:meth:`MoeAlltoAll.checkpoint_prepare`, :meth:`MoeAlltoAll.checkpoint_restore`). Where we differ on purpose
(documented in ``docs/integration.md``): int64 ids are accepted; id -1 means "no expert" and is skipped (FlashInfer
sends it to rank 0); combine sums in increasing rank order in fp32 (bitwise reproducible); ``use_low_precision=True``
sends FP8 with one fp32 scale per 128 elements. EPLB statistics (``eplb_stats_num_experts``, ``eplb_local_stats``,
:attr:`MoeAlltoAll.eplb_gathered_stats`) and rank masks (``enable_rank_mask``, ``active_rank_mask``,
:func:`moe_a2a_active_rank_mask`) run on the native ones (:meth:`flashinfer_a2a.MoeAlltoAll.set_active_ranks`);
arguments we do not support (a quantized combine output, scale layouts other than linear) raise
``NotImplementedError`` naming the argument. The communicator is used through ``Get_rank``, ``Get_size``,
``allgather`` and ``Split`` only.

Workspace sizes: :func:`moe_a2a_get_workspace_size_per_rank` returns our size for the given split of dispatch and
combine bytes and remembers the split; the constructor maps a ``workspace_size_per_rank`` back onto a
:class:`flashinfer_a2a.functional.WorkspaceConfig` (see :func:`split_workspace_size`). Workspaces are shared by
every ``MoeAlltoAll`` of the process with the same ``workspace_size_per_rank``, EP rank, EP size, ``max_num_tokens``,
``eplb_stats_num_experts`` and ``backend``, the key of FlashInfer's workspace cache: SGLang's per-layer dispatchers
share one, its draft model (size + 128) gets its own.

:class:`WorkspaceCheckpoint` and the rank-mask helpers serve :mod:`flashinfer_a2a.compat.moe_ep` too: both FlashInfer
surfaces sit on the same native calls.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional

import torch

from .. import functional as F
from ..memory.shared_workspace import group_key
from ..moe_alltoall import MoeAlltoAll as _NativeMoeAlltoAll
from . import checkpoint
from .comm_backend import CommBackend, CommBackendCommunicator, Mapping, MnnvlConfig, TorchDistBackend

__all__ = [
    "CommBackend",
    "Mapping",
    "MnnvlConfig",
    "MoeAlltoAll",
    "TorchDistBackend",
    "moe_a2a_active_rank_mask",
    "moe_a2a_get_workspace_size_per_rank",
    "split_workspace_size",
]


@dataclasses.dataclass(frozen=True)
class _Split:
    ep_size: int
    max_num_tokens: int
    dispatch_bytes_per_token: int
    combine_bytes_per_token: int


# FlashInfer's SfLayout.layout_linear (an IntEnum equal to 2), the default scale layout of a combine output.
SF_LAYOUT_LINEAR = 2
# FlashInfer's kernel backends: both are the one-sided NVLink all-to-all, which our kernels implement.
BACKENDS = ("trtllm", "cake")

# uint64 words of FlashInfer 0.7.2's active_rank_mask (MOE_A2A_RANK_MASK_WORDS): 64 ranks.
RANK_MASK_WORDS = 1

# Splits asked of moe_a2a_get_workspace_size_per_rank in this process, by the size it returned. Every rank computes
# the same sizes in the same order, so every rank maps a size back alike.
_SPLITS: dict[int, list[_Split]] = {}


def _unsupported(argument: str, value: Any, what: str) -> NotImplementedError:
    return NotImplementedError(f"{argument}={value!r}: {what} is not supported by flashinfer_a2a")


def moe_a2a_active_rank_mask(active_ranks: Iterable[int], ep_size: int) -> torch.Tensor:
    """FlashInfer 0.7.2's active-rank mask of ``active_ranks`` (ints, or a 1-D tensor of them, in ``[0, ep_size)``):
    a CPU ``[1] uint64`` tensor, bit ``r`` set for rank ``r``, for ``dispatch`` and ``combine``'s
    ``active_rank_mask``."""
    return rank_mask(active_ranks, ep_size, RANK_MASK_WORDS)


def rank_mask(active_ranks: Iterable[int], ep_size: int, words: int) -> torch.Tensor:
    """A CPU ``[words] uint64`` mask with bit ``r % 64`` of word ``r // 64`` set for each rank ``r`` of
    ``active_ranks``: FlashInfer's layout (0.7.2: one word; 0.7.4: four)."""
    bits = 0
    for rank in active_ranks:
        rank = int(rank)
        if not 0 <= rank < min(ep_size, 64 * words):
            raise ValueError(f"active_ranks: rank {rank} is outside [0, ep_size={ep_size})"
                             + (f" or past the {64 * words} ranks of {words} mask words" if ep_size > 64 * words
                                else ""))
        bits |= 1 << rank
    return torch.tensor([bits >> (64 * word) & (1 << 64) - 1 for word in range(words)], dtype=torch.uint64)


def mask_ranks(mask: torch.Tensor, ep_size: int, ep_rank: int, words: int) -> tuple[int, ...]:
    """The ranks a FlashInfer ``active_rank_mask`` sets, checked on the host before anything is launched: a CPU
    ``[words] uint64`` tensor (as :func:`rank_mask` makes it), no bit at or past ``ep_size``, the calling rank's bit
    set (a rank outside the active set makes no calls). TypeError / ValueError naming ``active_rank_mask``."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"active_rank_mask must be a CPU uint64 tensor of {words} words, got {type(mask).__name__}")
    if mask.dtype != torch.uint64:
        raise TypeError(f"active_rank_mask must be uint64 (bit r = rank r), got {mask.dtype}")
    if tuple(mask.shape) != (words,):
        raise ValueError(f"active_rank_mask must have shape [{words}] ({words} uint64 words), got "
                         f"{list(mask.shape)}")
    if mask.device.type != "cpu":
        raise ValueError(f"active_rank_mask must be a CPU tensor (it is read on the host), got one on {mask.device}")
    if ep_size > 64 * words:
        raise ValueError(f"active_rank_mask: {words} uint64 words hold {64 * words} ranks, fewer than "
                         f"ep_size={ep_size}")
    bits = sum(word << (64 * i) for i, word in enumerate(mask.tolist()))
    if bits >> ep_size:
        extra = [r for r in range(ep_size, 64 * words) if bits >> r & 1]
        raise ValueError(f"active_rank_mask sets ranks {extra}, outside [0, ep_size={ep_size})")
    if not bits >> ep_rank & 1:
        raise ValueError(f"active_rank_mask leaves out the calling rank {ep_rank}: a rank outside the active set "
                         "makes no calls")
    return tuple(r for r in range(ep_size) if bits >> r & 1)


def requested_ranks(mask: Optional[torch.Tensor], enable_rank_mask: bool, ep_size: int, ep_rank: int,
                    words: int) -> Optional[tuple[int, ...]]:
    """The active set a call passing ``active_rank_mask=mask`` asks for, as FlashInfer reads it: with
    ``enable_rank_mask`` every rank when ``mask`` is None, else the mask's ranks; without it no mask may be given
    (ValueError) and the call takes the set in force (None)."""
    if not enable_rank_mask:
        if mask is not None:
            raise ValueError("active_rank_mask requires enable_rank_mask=True at construction")
        return None
    return tuple(range(ep_size)) if mask is None else mask_ranks(mask, ep_size, ep_rank, words)


def active_ranks_change(a2a: _NativeMoeAlltoAll, ranks: Optional[tuple[int, ...]]) -> Optional[tuple[int, ...]]:
    """What to pass as a native dispatch's ``active_ranks`` for the set ``ranks`` (from :func:`requested_ranks`):
    None when it is the set in force already (the nccl transport takes no set, not even the full one)."""
    return None if ranks is None or ranks == a2a.active_ranks else ranks


def check_combine_ranks(ranks: Optional[tuple[int, ...]], a2a: _NativeMoeAlltoAll) -> None:
    """A combine runs with its dispatch's active set, the set in force while the dispatch is pending: ValueError
    naming ``active_rank_mask`` otherwise (``ranks`` None, from :func:`requested_ranks`: nothing to check)."""
    if ranks is not None and ranks != a2a.active_ranks:
        raise ValueError(f"active_rank_mask of combine selects ranks {list(ranks)}, its dispatch ran with ranks "
                         f"{list(a2a.active_ranks)}: pass the dispatch's mask")


def refuse_released(group: Any, comm: Any, namespace: str) -> None:
    """RuntimeError if the workspace a layer built on ``group`` (its communicator ``comm``) in ``namespace`` would
    share was released by ``checkpoint_prepare`` and not restored yet."""
    if checkpoint.detached_like((group_key(group, comm), comm.size, comm.rank, namespace)):
        raise RuntimeError("the workspace this layer would share was released by checkpoint_prepare(); call "
                           "checkpoint_restore(comm_backend) first")


class WorkspaceCheckpoint:
    """Checkpoint, restore and teardown of the shared workspace behind a native :class:`flashinfer_a2a.MoeAlltoAll`
    (:mod:`flashinfer_a2a.compat.checkpoint`), for both FlashInfer surfaces. Over the nccl transport there is no
    workspace: prepare and restore do nothing (the process group is the engine's to checkpoint); the hierarchical one
    refuses them (NotImplementedError)."""

    def __init__(self, a2a: _NativeMoeAlltoAll) -> None:
        self.a2a = a2a
        shared = self.shared
        if shared is not None:
            for user in (a2a, a2a._transport):  # both hold the communicator restore replaces
                checkpoint.register(shared, user)

    @property
    def shared(self) -> Any:
        """The shared workspace (None: destroyed, or the nccl transport). The one place compat reads a transport's
        state: :class:`flashinfer_a2a.MoeAlltoAll` does not expose its shared workspace."""
        return getattr(self.a2a._transport, "shared", None)

    def check_attached(self, what: str) -> None:
        """RuntimeError naming ``what`` between :meth:`prepare` and :meth:`restore`."""
        if self.shared is not None:
            checkpoint.check_attached(self.shared, what)

    def pending(self, what: str) -> tuple[int, int, torch.Tensor]:
        """``(num_tokens, runtime_max, recv_counts)`` of the pending dispatch; RuntimeError without one."""
        return self.a2a._transport.require_pending(what)

    def prepare(self) -> None:
        """See :meth:`MoeAlltoAll.checkpoint_prepare`."""
        if self._has_workspace("checkpoint_prepare"):
            checkpoint.detach(self._live("checkpoint_prepare"))

    def restore(self, comm_backend: CommBackend) -> None:
        """See :meth:`MoeAlltoAll.checkpoint_restore`."""
        if self._has_workspace("checkpoint_restore"):
            checkpoint.attach(self._live("checkpoint_restore"), CommBackendCommunicator(comm_backend))

    def _has_workspace(self, what: str) -> bool:
        if self.a2a.transport not in ("nvlink", "nccl"):
            raise NotImplementedError(f"{what}: the {self.a2a.transport} transport's workspaces are not checkpointed "
                                      "(nvlink and nccl only)")
        return self.a2a.transport == "nvlink"

    def destroy(self) -> None:
        """Releases the native object's share of the workspace, and forgets a released workspace it freed."""
        shared = self.shared
        self.a2a.destroy()
        if shared is not None and shared.allocation is None:
            checkpoint.forget(shared)

    def _live(self, what: str) -> Any:
        if self.shared is None:
            raise RuntimeError(f"MoeAlltoAll.{what}: this MoeAlltoAll was destroyed")
        return self.shared


def moe_a2a_get_workspace_size_per_rank(ep_size: int, max_num_tokens: int, total_dispatch_payload_size_per_token: int,
                                        combine_payload_size_per_token: int, eplb_stats_num_experts: int = 0, *,
                                        backend: str = "trtllm") -> int:
    """Bytes of one rank's workspace for ``max_num_tokens`` tokens per rank whose dispatch payloads add up to
    ``total_dispatch_payload_size_per_token`` bytes and whose combine rows are ``combine_payload_size_per_token``
    bytes (room for up to 32 experts per token). The split is remembered, so that a ``MoeAlltoAll`` built with this
    size (or a size above it, such as SGLang's size + 128) gets room for these rows. ``eplb_stats_num_experts``
    (at most :data:`flashinfer_a2a.functional.MAX_EPLB_EXPERTS`) adds nothing: every workspace has room for the
    statistics of that many experts. ``backend`` (``"trtllm"`` or ``"cake"``) changes nothing here: both run our
    kernels."""
    _check_backend(backend)
    _check_eplb_experts(eplb_stats_num_experts)
    split = _Split(ep_size, max_num_tokens, total_dispatch_payload_size_per_token, combine_payload_size_per_token)
    size = F.get_workspace_size(ep_size, max_num_tokens, F.MAX_TOP_K, split.dispatch_bytes_per_token,
                                split.combine_bytes_per_token)
    if split not in _SPLITS.setdefault(size, []):
        _SPLITS[size].append(split)
    return size


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _check_eplb_experts(eplb_stats_num_experts: int) -> None:
    if (not isinstance(eplb_stats_num_experts, int) or isinstance(eplb_stats_num_experts, bool)
            or not 0 <= eplb_stats_num_experts <= F.MAX_EPLB_EXPERTS):
        raise ValueError(f"eplb_stats_num_experts must be an int in [0, {F.MAX_EPLB_EXPERTS}], got "
                         f"{eplb_stats_num_experts!r}")


def split_workspace_size(workspace_size_per_rank: int, ep_size: int, max_num_tokens: int,
                         hidden_size: Optional[int] = None) -> tuple[int, int]:
    """``(dispatch_bytes_per_token, combine_bytes_per_token)`` for a FlashInfer-style per-rank size.

    - Sizes from :func:`moe_a2a_get_workspace_size_per_rank` in this process: the maximum of each of the splits
      computed for ``ep_size`` with a size up to ``workspace_size_per_rank``. So SGLang's size + 128 gets the
      split of its size, and vLLM's size grown to the largest over its layers fits every layer's rows (a maximum of
      totals matches no single layer's split of dispatch and combine bytes).
    - Any other size (computed by hand): the bytes per token ``b = workspace_size_per_rank // (ep_size *
      max_num_tokens)``; combine rows get ``hidden_size * 2`` (bf16) when ``hidden_size`` is given, else ``b``;
      dispatch rows get the rest of ``b``, or all of it without ``hidden_size``. Without ``hidden_size`` the
      workspace is then about twice the size given: any split of ``b`` fits.
    """
    if workspace_size_per_rank < 1 or ep_size < 1 or max_num_tokens < 1:
        raise ValueError(f"workspace_size_per_rank={workspace_size_per_rank}, ep_size={ep_size} and "
                         f"max_num_tokens={max_num_tokens} must be positive")
    known = [s for size, splits in _SPLITS.items() if size <= workspace_size_per_rank for s in splits
             if s.ep_size == ep_size]
    if known:
        return (max(s.dispatch_bytes_per_token for s in known), max(s.combine_bytes_per_token for s in known))
    per_token = workspace_size_per_rank // (ep_size * max_num_tokens)
    if hidden_size is None:
        return per_token, per_token
    combine = hidden_size * 2
    if per_token <= combine:
        raise ValueError(f"workspace_size_per_rank={workspace_size_per_rank} leaves {per_token} bytes per token for "
                         f"{ep_size} ranks x {max_num_tokens} tokens: less than a bf16 combine row of hidden_size="
                         f"{hidden_size}")
    return per_token - combine, combine


class MoeAlltoAll:
    """FlashInfer's ``MoeAlltoAll`` over :class:`flashinfer_a2a.MoeAlltoAll`. Construction is collective over the
    communicator of ``mnnvl_config`` (default: the ``torch.distributed`` world), split as FlashInfer splits it
    (color ``pp_rank * cp_size + cp_rank``, key ``tp_rank``); the result must be the MoE EP group of ``mapping``.

    Args:
        mapping: a :class:`Mapping` (only ``moe_ep_rank``, ``moe_ep_size`` and the split's ranks are read).
        max_num_tokens: most tokens any rank dispatches per call.
        top_k, num_experts: experts per token and in all.
        workspace_size_per_rank: bytes per rank (see :func:`split_workspace_size`); default: sized from
            ``hidden_size`` for bf16 hidden states, int32 ids and fp32 weights.
        hidden_size: required without ``workspace_size_per_rank``.
        mnnvl_config: its ``comm_backend`` (a :class:`CommBackend`) is the communicator.
        eplb_stats_num_experts: length of the EPLB statistics a :meth:`dispatch` may carry (0: none; at most
            :data:`flashinfer_a2a.functional.MAX_EPLB_EXPERTS`).
        enable_rank_mask: :meth:`dispatch` and :meth:`combine` take ``active_rank_mask`` (a call without one then
            means every rank, as in FlashInfer).
        backend: FlashInfer's kernel choice, ``"trtllm"`` or ``"cake"``: both run our kernels here, and, as in
            FlashInfer, instances of different backends never share a workspace.
    """

    def __init__(self, mapping: Mapping, max_num_tokens: int, top_k: int, num_experts: int,
                 workspace_size_per_rank: Optional[int] = None, hidden_size: Optional[int] = None,
                 mnnvl_config: Optional[MnnvlConfig] = None, eplb_stats_num_experts: int = 0,
                 enable_rank_mask: bool = False, *, backend: str = "trtllm") -> None:
        _check_backend(backend)
        _check_eplb_experts(eplb_stats_num_experts)
        for name, value in (("max_num_tokens", max_num_tokens), ("top_k", top_k), ("num_experts", num_experts)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.ep_rank, self.ep_size = mapping.moe_ep_rank, mapping.moe_ep_size
        if workspace_size_per_rank is None:
            if hidden_size is None:
                raise ValueError("MoeAlltoAll needs workspace_size_per_rank or hidden_size")
            workspace_size_per_rank = self.get_moe_workspace_size_per_rank(self.ep_size, top_k, max_num_tokens,
                                                                           hidden_size)
        dispatch_bytes, combine_bytes = split_workspace_size(workspace_size_per_rank, self.ep_size, max_num_tokens,
                                                             hidden_size)
        comm = CommBackendCommunicator(self._ep_backend(mapping, mnnvl_config))
        if (comm.rank, comm.size) != (self.ep_rank, self.ep_size):
            raise ValueError(f"mapping: moe_ep_rank/moe_ep_size are {self.ep_rank}/{self.ep_size} but the "
                             f"communicator (split by pp/cp group, ordered by tp_rank) is rank {comm.rank} of "
                             f"{comm.size}: pass a comm_backend over the MoE EP group")
        self.workspace_size_per_rank, self.max_num_tokens = workspace_size_per_rank, max_num_tokens
        self.top_k, self.num_experts, self.hidden_size = top_k, num_experts, hidden_size
        self.eplb_stats_num_experts, self.enable_rank_mask = eplb_stats_num_experts, bool(enable_rank_mask)
        self.backend = backend
        # FlashInfer's cache key (size, EP rank, EP size, max tokens, EPLB experts, backend); rank and size are in
        # the shared workspace's own key.
        eplb = f":eplb{eplb_stats_num_experts}" if eplb_stats_num_experts else ""
        namespace = f"flashinfer-compat:{workspace_size_per_rank}:{max_num_tokens}{eplb}:{backend}"
        refuse_released(comm, comm, namespace)
        self._a2a = _NativeMoeAlltoAll(comm, max_num_tokens=max_num_tokens, top_k=top_k, num_experts=num_experts,
                                       hidden_size=hidden_size, dispatch_bytes_per_token=dispatch_bytes,
                                       combine_bytes_per_token=combine_bytes, namespace=namespace,
                                       eplb_stats_num_experts=eplb_stats_num_experts,
                                       transport="nvlink")  # FlashInfer's MoeAlltoAll is the one-sided NVLink one
        self._workspace = WorkspaceCheckpoint(self._a2a)
        self._stats_pending = False  # this instance's dispatch carried EPLB statistics and awaits its combine

    @staticmethod
    def _ep_backend(mapping: Mapping, config: Optional[MnnvlConfig]) -> Any:
        backend = None if config is None else config.comm_backend
        if backend is None:
            backend = TorchDistBackend()
        split = getattr(backend, "Split", None)
        if callable(split):
            backend = split(mapping.pp_rank * mapping.cp_size + mapping.cp_rank, mapping.tp_rank)
        return backend

    @staticmethod
    def get_moe_workspace_size_per_rank(ep_size: int, top_k: int, max_num_tokens: int, hidden_size: int,
                                        extra_payload_bytes_per_token: int = 0, eplb_stats_num_experts: int = 0, *,
                                        backend: str = "trtllm") -> int:
        """The size for bf16 hidden states, int32 ids, fp32 weights and ``extra_payload_bytes_per_token``."""
        dispatch = hidden_size * 2 + top_k * 4 + top_k * 4 + extra_payload_bytes_per_token
        return moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, dispatch, hidden_size * 2,
                                                   eplb_stats_num_experts, backend=backend)

    @property
    def native(self) -> _NativeMoeAlltoAll:
        """The :class:`flashinfer_a2a.MoeAlltoAll` underneath; e.g. its
        :meth:`~flashinfer_a2a.MoeAlltoAll.set_active_ranks`, with which every rank of the group takes masked-out
        ranks back at one step."""
        return self._a2a

    @property
    def workspace(self) -> torch.Tensor:
        return self._a2a.workspace

    @property
    def metainfo(self) -> torch.Tensor:
        return self._a2a.metainfo

    @property
    def eplb_gathered_stats(self) -> Optional[torch.Tensor]:
        """Every rank's EPLB statistics, ``[ep_size, eplb_stats_num_experts] int32`` (row r: rank r's; zeros for a
        rank outside the active set), a view of the workspace, between a :meth:`dispatch` given ``eplb_local_stats``
        and its :meth:`combine`; None otherwise (as in FlashInfer)."""
        return self._a2a.eplb_gathered_stats if self._stats_pending else None

    def dispatch(self, token_selected_experts: torch.Tensor, input_payloads: list[torch.Tensor],
                 runtime_max_tokens_per_rank: int, invalid_token_expert_id: Optional[int] = None,
                 expert_id_payload_index: Optional[int] = None, eplb_local_stats: Optional[torch.Tensor] = None,
                 active_rank_mask: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Sends each token's payload rows to the ranks of its experts. Returns one workspace view
        ``[ep_size, runtime_max_tokens_per_rank, ...]`` per payload, valid until the next dispatch. With
        ``invalid_token_expert_id``, the padded rows of payload ``expert_id_payload_index`` (the received ids) are
        set to it. A second dispatch before :meth:`combine` raises and leaves the pending one usable.

        ``eplb_local_stats``: this rank's ``[eplb_stats_num_experts] int32`` statistics, on the layer's device; every
        rank's are then in :attr:`eplb_gathered_stats`. ``active_rank_mask`` (with ``enable_rank_mask``; see
        :func:`moe_a2a_active_rank_mask`): tokens routed to the experts of ranks outside it are not sent and add
        nothing to the combine; the set stays in force for every layer of the workspace, and CUDA graphs follow the
        set in force at replay. To take ranks back, every rank of the group, the returning ones included, calls
        ``native.set_active_ranks`` at one step."""
        ranks = requested_ranks(active_rank_mask, self.enable_rank_mask, self.ep_size, self.ep_rank,
                                RANK_MASK_WORDS)
        if invalid_token_expert_id is not None and expert_id_payload_index is None:
            raise ValueError("expert_id_payload_index is required with invalid_token_expert_id="
                             f"{invalid_token_expert_id}")
        if expert_id_payload_index is not None and not 0 <= expert_id_payload_index < len(input_payloads):
            raise ValueError(f"expert_id_payload_index={expert_id_payload_index} is not an index of the "
                             f"{len(input_payloads)} input_payloads")
        self._workspace.check_attached("dispatch")
        recv, counts = self._a2a.dispatch(token_selected_experts, list(input_payloads), runtime_max_tokens_per_rank,
                                          eplb_local_stats=eplb_local_stats,
                                          active_ranks=active_ranks_change(self._a2a, ranks))
        self._stats_pending = eplb_local_stats is not None
        if invalid_token_expert_id is not None:
            F.sanitize_expert_ids(recv[expert_id_payload_index], counts, int(invalid_token_expert_id))
        return list(recv)

    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank: int, hidden_size: int,
                                                dtype: torch.dtype) -> torch.Tensor:
        """The zero-copy combine payload ``[ep_size, runtime_max_tokens_per_rank, hidden_size]`` of the pending
        dispatch: write the expert outputs here and call :meth:`combine` with ``payload_in_workspace=True``."""
        self._workspace.check_attached("get_combine_payload_tensor_in_workspace")
        self._check_runtime_max(runtime_max_tokens_per_rank, "get_combine_payload_tensor_in_workspace")
        return self._a2a.combine_input(hidden_size, dtype)

    def combine(self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, payload_in_workspace: bool = False,
                output_dtype: Optional[torch.dtype] = None, output_scales: Optional[torch.Tensor] = None,
                output_scalar_scale: float = 1.0, sf_layout: Any = SF_LAYOUT_LINEAR,
                output: Optional[torch.Tensor] = None, *, use_low_precision: bool = False,
                active_rank_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Returns ``[local_num_tokens, hidden]``: each token's rows of ``payload`` ``[ep_size,
        runtime_max_tokens_per_rank, hidden]`` summed over the ranks it went to (increasing rank order, fp32), into
        ``output`` if given. ``use_low_precision``: the partials cross NVLink as FP8 with fp32 block scales.
        ``active_rank_mask``: the dispatch's (both None, or the same ranks).

        FlashInfer's parameter order: the fourth positional argument is ``output_dtype`` (only the payload's dtype
        or None here), ``output`` the eighth; pass ``output`` by keyword."""
        if output_dtype is not None and not isinstance(output_dtype, torch.dtype):
            raise TypeError(f"output_dtype must be a torch.dtype or None, got {type(output_dtype).__name__}: "
                            "FlashInfer's combine takes output_dtype fourth and output eighth; pass output=...")
        if output_dtype is not None and output_dtype != payload.dtype:
            raise _unsupported("output_dtype", output_dtype, "a combine output dtype other than the payload's")
        if output_scales is not None:
            raise _unsupported("output_scales", "<tensor>", "a quantized combine output")
        if output_scalar_scale != 1.0:
            raise _unsupported("output_scalar_scale", output_scalar_scale, "a quantized combine output")
        if sf_layout is not None and sf_layout != SF_LAYOUT_LINEAR:
            raise _unsupported("sf_layout", sf_layout, "a scale-factor layout other than linear")
        ranks = requested_ranks(active_rank_mask, self.enable_rank_mask, self.ep_size, self.ep_rank,
                                RANK_MASK_WORDS)
        self._workspace.check_attached("combine")
        self._check_runtime_max(runtime_max_tokens_per_rank, "combine")
        check_combine_ranks(ranks, self._a2a)
        want = (self.ep_size, runtime_max_tokens_per_rank)
        if payload.dim() != 3 or tuple(payload.shape[:2]) != want:
            raise ValueError(f"payload must be [ep_size={want[0]}, runtime_max_tokens_per_rank={want[1]}, hidden], "
                             f"got {tuple(payload.shape)}")
        region = self._a2a.combine_input(payload.shape[-1], payload.dtype)
        in_workspace = payload.data_ptr() == region.data_ptr() and payload.is_contiguous()
        if payload_in_workspace and not in_workspace:
            raise ValueError("payload_in_workspace=True but payload is not the tensor "
                             "get_combine_payload_tensor_in_workspace returned")
        if output is None:
            num_tokens = self._workspace.pending("combine")[0]
            output = torch.empty(num_tokens, payload.shape[-1], dtype=payload.dtype, device=payload.device)
        # A payload already in the combine region is published where it lies (never copied onto itself).
        result = self._a2a.combine(None if in_workspace else payload, out=output,
                                   quant_format="fp8_block" if use_low_precision else None)
        self._stats_pending = False
        return result

    def checkpoint_prepare(self) -> None:
        """Releases the memory of this instance's workspace before the process is checkpointed, keeping its
        virtual addresses: waits for this rank's kernels, then every rank unmaps every rank's memory and releases
        its allocation. Collective; a no-op if already released. Raises RuntimeError on every rank, releasing
        nothing, while any rank has a dispatch awaiting its combine on this workspace.

        Covers every ``MoeAlltoAll`` sharing the workspace (call it on any one of them; a process with several
        workspaces, e.g. a draft model's, calls it once per workspace). Until :meth:`checkpoint_restore`,
        ``dispatch``, ``combine`` and the zero-copy payload raise, and neither the workspace tensor nor a view of it
        may be read, nor a CUDA graph holding them replayed."""
        self._workspace.prepare()

    def checkpoint_restore(self, comm_backend: CommBackend) -> None:
        """Maps new memory at the workspace's old addresses after the process was restored, over ``comm_backend``
        (a :class:`CommBackend` of the same rank and size as the one the workspace was built with; the workspace
        uses it from now on), and re-initializes it as a fresh workspace. Collective; a no-op unless
        :meth:`checkpoint_prepare` released the memory.

        Every ``MoeAlltoAll`` sharing the workspace is usable again: tensors, receive views, compiled and captured
        CUDA graphs made before keep their addresses, but the rows received before the checkpoint are gone: dispatch
        again. RuntimeError if the communicator's rank or size differ (before any collective), or if a rank could
        not map its memory (then on every rank, and the workspace stays released)."""
        self._workspace.restore(comm_backend)

    def destroy(self) -> None:
        """Releases the workspace (the last user of a shared one frees it). Collective. Works between
        :meth:`checkpoint_prepare` and :meth:`checkpoint_restore` too."""
        self._stats_pending = False
        self._workspace.destroy()

    _reset_workspace = destroy

    def _check_runtime_max(self, runtime_max: int, what: str) -> None:
        """The pending dispatch (of this shared workspace) used ``runtime_max``; RuntimeError without one."""
        _, pending_max, _ = self._workspace.pending(what)
        if runtime_max != pending_max:
            raise ValueError(f"{what}: runtime_max_tokens_per_rank={runtime_max} differs from the pending "
                             f"dispatch's {pending_max}")
