"""FlashInfer's ``MoeAlltoAll`` API (``flashinfer.comm``, 0.7.x) over flashinfer_a2a: an engine changes its import
line and nothing else::

    from flashinfer_a2a.compat.flashinfer import Mapping, MnnvlConfig, MoeAlltoAll, moe_a2a_get_workspace_size_per_rank

Same names, signatures (positional and keyword) and call sequence. Where we differ on purpose (documented in
``docs/integration.md``): int64 ids are accepted; id -1 means "no expert" and is skipped (FlashInfer sends it to rank
0); combine sums in increasing rank order in fp32 (bitwise reproducible); ``use_low_precision=True`` sends FP8 with
one fp32 scale per 128 elements. Arguments we do not support (EPLB statistics, rank masks, quantized combine
output, scale layouts) raise ``NotImplementedError`` naming the argument. The communicator is used through
``Get_rank``, ``Get_size``, ``allgather`` and ``Split`` only.

Workspace sizes: :func:`moe_a2a_get_workspace_size_per_rank` returns our size for the given split of dispatch and
combine bytes and remembers the split; the constructor maps a ``workspace_size_per_rank`` back onto a
:class:`flashinfer_a2a.functional.WorkspaceConfig` (see :func:`split_workspace_size`). Workspaces are shared by
every ``MoeAlltoAll`` of the process with the same EP rank, EP size and ``workspace_size_per_rank``, as FlashInfer
caches them: SGLang's per-layer dispatchers share one, its draft model (size + 128) gets its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from .. import functional as F
from ..moe_alltoall import MoeAlltoAll as _NativeMoeAlltoAll
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
    """

    def __init__(self, mapping: Mapping, max_num_tokens: int, top_k: int, num_experts: int,
                 workspace_size_per_rank: Optional[int] = None, hidden_size: Optional[int] = None,
                 mnnvl_config: Optional[MnnvlConfig] = None, eplb_stats_num_experts: int = 0,
                 enable_rank_mask: bool = False) -> None:
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
        self.eplb_stats_num_experts, self.enable_rank_mask = 0, False
        self._a2a = _NativeMoeAlltoAll(comm, max_num_tokens=max_num_tokens, top_k=top_k, num_experts=num_experts,
                                       hidden_size=hidden_size, dispatch_bytes_per_token=dispatch_bytes,
                                       combine_bytes_per_token=combine_bytes,
                                       namespace=f"flashinfer-compat:{workspace_size_per_rank}",
                                       transport="nvlink")  # FlashInfer's MoeAlltoAll is the one-sided NVLink one

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
        recv, counts = self._a2a.dispatch(token_selected_experts, list(input_payloads), runtime_max_tokens_per_rank)
        if invalid_token_expert_id is not None:
            F.sanitize_expert_ids(recv[expert_id_payload_index], counts, int(invalid_token_expert_id))
        return list(recv)

    def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank: int, hidden_size: int,
                                                dtype: torch.dtype) -> torch.Tensor:
        """The zero-copy combine payload ``[ep_size, runtime_max_tokens_per_rank, hidden_size]`` of the pending
        dispatch: write the expert outputs here and call :meth:`combine` with ``payload_in_workspace=True``."""
        self._check_runtime_max(runtime_max_tokens_per_rank, "get_combine_payload_tensor_in_workspace")
        return self._a2a.combine_input(hidden_size, dtype)

    def combine(self, payload: torch.Tensor, runtime_max_tokens_per_rank: int, payload_in_workspace: bool = False,
                output: Optional[torch.Tensor] = None, use_low_precision: bool = False, *,
                output_dtype: Optional[torch.dtype] = None, output_scales: Optional[torch.Tensor] = None,
                output_scalar_scale: float = 1.0, sf_layout: Any = None,
                active_rank_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Returns ``[local_num_tokens, hidden]``: each token's rows of ``payload`` ``[ep_size,
        runtime_max_tokens_per_rank, hidden]`` summed over the ranks it went to (increasing rank order, fp32), into
        ``output`` if given. ``use_low_precision``: the partials cross NVLink as FP8 with fp32 block scales."""
        if output_dtype is not None and output_dtype != payload.dtype:
            raise _unsupported("output_dtype", output_dtype, "a combine output dtype other than the payload's")
        if output_scales is not None:
            raise _unsupported("output_scales", "<tensor>", "a quantized combine output")
        if output_scalar_scale != 1.0:
            raise _unsupported("output_scalar_scale", output_scalar_scale, "a quantized combine output")
        if sf_layout is not None:
            raise _unsupported("sf_layout", sf_layout, "a scale-factor layout for the combine output")
        if active_rank_mask is not None:
            raise _unsupported("active_rank_mask", "<tensor>", "masking ranks out")
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
            num_tokens = self._a2a._shared.pending[0]
            output = torch.empty(num_tokens, payload.shape[-1], dtype=payload.dtype, device=payload.device)
        # A payload already in the combine region is published where it lies (never copied onto itself).
        return self._a2a.combine(None if in_workspace else payload, out=output,
                                 quant_format="fp8_block" if use_low_precision else None)

    def destroy(self) -> None:
        """Releases the workspace (the last user of a shared one frees it). Collective."""
        self._a2a.destroy()

    _reset_workspace = destroy

    def _check_runtime_max(self, runtime_max: int, what: str) -> None:
        """The pending dispatch (of this shared workspace) used ``runtime_max``; RuntimeError without one."""
        _, pending_max, _ = self._a2a._require_pending(what)
        if runtime_max != pending_max:
            raise ValueError(f"{what}: runtime_max_tokens_per_rank={runtime_max} differs from the pending "
                             f"dispatch's {pending_max}")
