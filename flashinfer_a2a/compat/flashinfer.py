"""FlashInfer's ``MoeAlltoAll`` API (``flashinfer.comm``, 0.7.x) over flashinfer_a2a: an engine changes its import
line and nothing else::

    from flashinfer_a2a.compat.flashinfer import Mapping, MnnvlConfig, MoeAlltoAll, moe_a2a_get_workspace_size_per_rank

Same names, signatures (positional and keyword, as in FlashInfer 0.7.2) and call sequence, checkpoint and restore
included (:meth:`MoeAlltoAll.checkpoint_prepare`, :meth:`MoeAlltoAll.checkpoint_restore`). Where we differ on purpose
(documented in ``docs/integration.md``): int64 ids are accepted; id -1 means "no expert" and is skipped (FlashInfer
sends it to rank 0); combine sums in increasing rank order in fp32 (bitwise reproducible); ``use_low_precision=True``
sends FP8 with one fp32 scale per 128 elements. Arguments we do not support (EPLB statistics, rank masks, quantized
combine output, scale layouts other than linear) raise ``NotImplementedError`` naming the argument. The communicator
is used through ``Get_rank``, ``Get_size``, ``allgather`` and ``Split`` only.

Workspace sizes: :func:`moe_a2a_get_workspace_size_per_rank` returns our size for the given split of dispatch and
combine bytes and remembers the split; the constructor maps a ``workspace_size_per_rank`` back onto a
:class:`flashinfer_a2a.functional.WorkspaceConfig` (see :func:`split_workspace_size`). Workspaces are shared by
every ``MoeAlltoAll`` of the process with the same ``workspace_size_per_rank``, EP rank, EP size, ``max_num_tokens``
and ``backend``, the key of FlashInfer's workspace cache (its ``eplb_stats_num_experts`` is always 0 here): SGLang's
per-layer dispatchers share one, its draft model (size + 128) gets its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import functional as F
from ..moe_alltoall import MoeAlltoAll as _NativeMoeAlltoAll
from . import checkpoint
from .comm_backend import CommBackend, CommBackendCommunicator, Mapping, MnnvlConfig, TorchDistBackend

__all__ = [
    "CommBackend",
    "Mapping",
    "MnnvlConfig",
    "MoeAlltoAll",
    "TorchDistBackend",
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

# Splits asked of moe_a2a_get_workspace_size_per_rank in this process, by the size it returned. Every rank computes
# the same sizes in the same order, so every rank maps a size back alike.
_SPLITS: dict[int, list[_Split]] = {}


def _unsupported(argument: str, value: Any, what: str) -> NotImplementedError:
    return NotImplementedError(f"{argument}={value!r}: {what} is not supported by flashinfer_a2a")


def moe_a2a_get_workspace_size_per_rank(ep_size: int, max_num_tokens: int, total_dispatch_payload_size_per_token: int,
                                        combine_payload_size_per_token: int, eplb_stats_num_experts: int = 0) -> int:
    """Bytes of one rank's workspace for ``max_num_tokens`` tokens per rank whose dispatch payloads add up to
    ``total_dispatch_payload_size_per_token`` bytes and whose combine rows are ``combine_payload_size_per_token``
    bytes (room for up to 32 experts per token). The split is remembered, so that a ``MoeAlltoAll`` built with this
    size (or a size above it, such as SGLang's size + 128) gets room for these rows."""
    if eplb_stats_num_experts:
        raise _unsupported("eplb_stats_num_experts", eplb_stats_num_experts, "the EPLB statistics region")
    split = _Split(ep_size, max_num_tokens, total_dispatch_payload_size_per_token, combine_payload_size_per_token)
    size = F.get_workspace_size(ep_size, max_num_tokens, F.MAX_TOP_K, split.dispatch_bytes_per_token,
                                split.combine_bytes_per_token)
    if split not in _SPLITS.setdefault(size, []):
        _SPLITS[size].append(split)
    return size


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
        eplb_stats_num_experts, enable_rank_mask: not supported (``NotImplementedError`` unless 0 / False).
        backend: FlashInfer's kernel choice, ``"trtllm"`` or ``"cake"``: both run our kernels here, and, as in
            FlashInfer, instances of different backends never share a workspace.
    """

    def __init__(self, mapping: Mapping, max_num_tokens: int, top_k: int, num_experts: int,
                 workspace_size_per_rank: Optional[int] = None, hidden_size: Optional[int] = None,
                 mnnvl_config: Optional[MnnvlConfig] = None, eplb_stats_num_experts: int = 0,
                 enable_rank_mask: bool = False, *, backend: str = "trtllm") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if eplb_stats_num_experts:
            raise _unsupported("eplb_stats_num_experts", eplb_stats_num_experts, "EPLB statistics gathering")
        if enable_rank_mask:
            raise _unsupported("enable_rank_mask", enable_rank_mask, "masking ranks out")
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
        self.eplb_stats_num_experts, self.enable_rank_mask, self.backend = 0, False, backend
        # FlashInfer's cache key (size, EP rank, EP size, max tokens, EPLB experts, backend); rank and size are in
        # the shared workspace's own key.
        namespace = f"flashinfer-compat:{workspace_size_per_rank}:{max_num_tokens}:{backend}"
        if checkpoint.detached_like((comm.workspace_group_key, comm.size, comm.rank, namespace)):
            raise RuntimeError("MoeAlltoAll: the workspace this layer would share was released by "
                               "checkpoint_prepare(); call checkpoint_restore(comm_backend) first")
        self._a2a = _NativeMoeAlltoAll(comm, max_num_tokens=max_num_tokens, top_k=top_k, num_experts=num_experts,
                                       hidden_size=hidden_size, dispatch_bytes_per_token=dispatch_bytes,
                                       combine_bytes_per_token=combine_bytes, namespace=namespace,
                                       transport="nvlink")  # FlashInfer's MoeAlltoAll is the one-sided NVLink one
        for user in (self._a2a, self._a2a._transport):  # both hold the communicator restore replaces
            checkpoint.register(self._a2a._transport.shared, user)

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
                                        extra_payload_bytes_per_token: int = 0, eplb_stats_num_experts: int = 0) -> int:
        """The size for bf16 hidden states, int32 ids, fp32 weights and ``extra_payload_bytes_per_token``."""
        dispatch = hidden_size * 2 + top_k * 4 + top_k * 4 + extra_payload_bytes_per_token
        return moe_a2a_get_workspace_size_per_rank(ep_size, max_num_tokens, dispatch, hidden_size * 2,
                                                   eplb_stats_num_experts)

    @property
    def workspace(self) -> torch.Tensor:
        return self._a2a.workspace

    @property
    def metainfo(self) -> torch.Tensor:
        return self._a2a.metainfo

    @property
    def eplb_gathered_stats(self) -> None:
        return None

    def dispatch(self, token_selected_experts: torch.Tensor, input_payloads: list[torch.Tensor],
                 runtime_max_tokens_per_rank: int, invalid_token_expert_id: Optional[int] = None,
                 expert_id_payload_index: Optional[int] = None, eplb_local_stats: Optional[torch.Tensor] = None,
                 active_rank_mask: Optional[torch.Tensor] = None) -> list[torch.Tensor]:
        """Sends each token's payload rows to the ranks of its experts. Returns one workspace view
        ``[ep_size, runtime_max_tokens_per_rank, ...]`` per payload, valid until the next dispatch. With
        ``invalid_token_expert_id``, the padded rows of payload ``expert_id_payload_index`` (the received ids) are
        set to it. A second dispatch before :meth:`combine` raises and leaves the pending one usable."""
        if eplb_local_stats is not None:
            raise _unsupported("eplb_local_stats", "<tensor>", "EPLB statistics gathering")
        if active_rank_mask is not None:
            raise _unsupported("active_rank_mask", "<tensor>", "masking ranks out")
        if invalid_token_expert_id is not None and expert_id_payload_index is None:
            raise ValueError("expert_id_payload_index is required with invalid_token_expert_id="
                             f"{invalid_token_expert_id}")
        if expert_id_payload_index is not None and not 0 <= expert_id_payload_index < len(input_payloads):
            raise ValueError(f"expert_id_payload_index={expert_id_payload_index} is not an index of the "
                             f"{len(input_payloads)} input_payloads")
        self._check_attached("dispatch")
        recv, counts = self._a2a.dispatch(token_selected_experts, list(input_payloads), runtime_max_tokens_per_rank)
        if invalid_token_expert_id is not None:
            F.sanitize_expert_ids(recv[expert_id_payload_index], counts, int(invalid_token_expert_id))
        return list(recv)

    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank: int, hidden_size: int,
                                                dtype: torch.dtype) -> torch.Tensor:
        """The zero-copy combine payload ``[ep_size, runtime_max_tokens_per_rank, hidden_size]`` of the pending
        dispatch: write the expert outputs here and call :meth:`combine` with ``payload_in_workspace=True``."""
        self._check_attached("get_combine_payload_tensor_in_workspace")
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
        if active_rank_mask is not None:
            raise _unsupported("active_rank_mask", "<tensor>", "masking ranks out")
        self._check_attached("combine")
        self._check_runtime_max(runtime_max_tokens_per_rank, "combine")
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
            num_tokens = self._a2a._transport.shared.pending[0]
            output = torch.empty(num_tokens, payload.shape[-1], dtype=payload.dtype, device=payload.device)
        # A payload already in the combine region is published where it lies (never copied onto itself).
        return self._a2a.combine(None if in_workspace else payload, out=output,
                                 quant_format="fp8_block" if use_low_precision else None)

    def checkpoint_prepare(self) -> None:
        """Releases the memory of this instance's workspace before the process is checkpointed, keeping its
        virtual addresses: waits for this rank's kernels, then every rank unmaps every rank's memory and releases
        its allocation. Collective; a no-op if already released. Raises RuntimeError on every rank, releasing
        nothing, while any rank has a dispatch awaiting its combine on this workspace.

        Covers every ``MoeAlltoAll`` sharing the workspace (call it on any one of them; a process with several
        workspaces, e.g. a draft model's, calls it once per workspace). Until :meth:`checkpoint_restore`,
        ``dispatch``, ``combine`` and the zero-copy payload raise, and neither the workspace tensor nor a view of it
        may be read, nor a CUDA graph holding them replayed."""
        checkpoint.detach(self._live_shared("checkpoint_prepare"))

    def checkpoint_restore(self, comm_backend: CommBackend) -> None:
        """Maps new memory at the workspace's old addresses after the process was restored, over ``comm_backend``
        (a :class:`CommBackend` of the same rank and size as the one the workspace was built with; the workspace
        uses it from now on), and re-initializes it as a fresh workspace. Collective; a no-op unless
        :meth:`checkpoint_prepare` released the memory.

        Every ``MoeAlltoAll`` sharing the workspace is usable again: tensors, receive views, compiled and captured
        CUDA graphs made before keep their addresses, but the rows received before the checkpoint are gone: dispatch
        again. RuntimeError if the communicator's rank or size differ (before any collective), or if a rank could
        not map its memory (then on every rank, and the workspace stays released)."""
        checkpoint.attach(self._live_shared("checkpoint_restore"), CommBackendCommunicator(comm_backend))

    def destroy(self) -> None:
        """Releases the workspace (the last user of a shared one frees it). Collective. Works between
        :meth:`checkpoint_prepare` and :meth:`checkpoint_restore` too."""
        shared = self._a2a._transport.shared
        self._a2a.destroy()
        if shared is not None and shared.allocation is None:
            checkpoint.forget(shared)

    _reset_workspace = destroy

    def _live_shared(self, what: str):
        if self._a2a._transport.shared is None:
            raise RuntimeError(f"MoeAlltoAll.{what}: this MoeAlltoAll was destroyed")
        return self._a2a._transport.shared

    def _check_attached(self, what: str) -> None:
        if self._a2a._transport.shared is not None:
            checkpoint.check_attached(self._a2a._transport.shared, what)

    def _check_runtime_max(self, runtime_max: int, what: str) -> None:
        """The pending dispatch (of this shared workspace) used ``runtime_max``; RuntimeError without one."""
        _, pending_max, _ = self._a2a._transport.require_pending(what)
        if runtime_max != pending_max:
            raise ValueError(f"{what}: runtime_max_tokens_per_rank={runtime_max} differs from the pending "
                             f"dispatch's {pending_max}")
