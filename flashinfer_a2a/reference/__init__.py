"""Pure-torch reference of the expert-parallel all-to-all contract (DESIGN.md §2).

This module is the executable definition of what ``dispatch``, ``combine`` and ``sanitize`` compute. All
``ep_size`` ranks are simulated in one process: every per-rank argument is a list indexed by rank, and all tensors
of one call live on one device (CPU or GPU). It imports nothing from the rest of the package, so it works before the
extension is built.

Dimensions used throughout:

- ``ep_size``: number of ranks, 1..72; rank ``r`` is the list index.
- ``num_tokens``: tokens owned by one rank (may differ per rank, may be 0).
- ``top_k``: experts per token, 1..32.
- ``num_experts``: experts across all ranks, partitioned contiguously (see :func:`expert_to_rank`).
- ``runtime_max``: ``runtime_max_tokens_per_rank``, the row capacity of each receive block.
- ``hidden``: width of a combine row.

The quantized wire formats (FP8 block scales, MXFP8, NVFP4, the 128x4 scale layout) are defined in
:mod:`flashinfer_a2a.reference.quant`.

Kernels are compared against this module bitwise: received payload rows byte for byte, combine outputs bit for
bit. Receive rows past ``recv_counts[d][src]`` are unspecified by the contract; here they hold
:data:`POISON_BYTE` in every byte, and tests compare only the valid rows (:func:`valid_row_mask`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

__all__ = [
    "MAX_EP_SIZE",
    "MAX_PAYLOADS",
    "MAX_TOP_K",
    "POISON_BYTE",
    "DispatchResult",
    "bitwise_equal",
    "expert_to_rank",
    "random_payload",
    "random_topk_ids",
    "rank_expert_range",
    "reference_combine",
    "reference_dispatch",
    "reference_sanitize",
    "row_bytes",
    "send_slots",
    "token_rank_mask",
    "valid_row_mask",
]

MAX_EP_SIZE = 72  # one GB200 NVL72 NVLink domain
MAX_TOP_K = 32
MAX_PAYLOADS = 8

# Fill byte for receive rows that no token wrote. 0xFF reads as NaN in bf16/fp16/fp32/float8_e4m3fn, -1 in
# signed ints and 255 in uint8, so a consumer that reads past the valid rows shows up instead of summing zeros.
POISON_BYTE = 0xFF

_ID_DTYPES = (torch.int32, torch.int64)
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# Expert -> rank partition
# ----------------------------------------------------------------------------------------------------------------


def _check_ep_size(ep_size: int) -> None:
    if not 1 <= ep_size <= MAX_EP_SIZE:
        raise ValueError(f"ep_size must be in 1..{MAX_EP_SIZE}, got {ep_size}")


def _check_num_experts(num_experts: int) -> None:
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")


def _check_topk_ids(topk_ids: torch.Tensor, num_experts: int, name: str) -> None:
    """Check dtype, shape ``[num_tokens, top_k]`` and that every id is -1 or in ``[0, num_experts)``."""
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2:
        raise ValueError(f"{name} must have shape [num_tokens, top_k], got {tuple(topk_ids.shape)}")
    top_k = topk_ids.shape[1]
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"{name}: top_k must be in 1..{MAX_TOP_K}, got {top_k}")
    if topk_ids.numel() == 0:
        return
    low = int(topk_ids.min())
    high = int(topk_ids.max())
    bad = low if low < -1 else high if high >= num_experts else None
    if bad is not None:
        raise ValueError(
            f"{name} contains expert id {bad}; valid ids are -1 (no expert) and 0..{num_experts - 1} "
            f"(num_experts={num_experts})"
        )


def rank_expert_range(rank: int, num_experts: int, ep_size: int) -> tuple[int, int]:
    """Experts ``[first, end)`` owned by ``rank``.

    The first ``num_experts % ep_size`` ranks own ``num_experts // ep_size + 1`` experts, the others own
    ``num_experts // ep_size`` (which is 0 on the trailing ranks when ``num_experts < ep_size``).
    """
    _check_ep_size(ep_size)
    _check_num_experts(num_experts)
    if not 0 <= rank < ep_size:
        raise ValueError(f"rank must be in 0..{ep_size - 1}, got {rank}")
    base, rem = divmod(num_experts, ep_size)
    first = rank * base + min(rank, rem)
    return first, first + base + (1 if rank < rem else 0)


def expert_to_rank(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """Rank owning each expert id.

    Args:
        topk_ids: ``[num_tokens, top_k] int32|int64`` expert ids; -1 means "no expert".
        num_experts: total experts, >= 1.
        ep_size: number of ranks, 1..72.

    Returns:
        ``[num_tokens, top_k] int64``: owning rank of each id (:func:`rank_expert_range`), -1 where the id is -1.

    Raises:
        ValueError: an id below -1 or at least ``num_experts`` (naming the value and the valid range), or a bad
            shape, ``top_k`` or ``ep_size``.
    """
    _check_ep_size(ep_size)
    _check_num_experts(num_experts)
    _check_topk_ids(topk_ids, num_experts, "topk_ids")
    ids = topk_ids.to(torch.int64)
    base, rem = divmod(num_experts, ep_size)
    # Experts below `split` live on the `rem` ranks that own base + 1 each; the rest on ranks that own base each.
    split = rem * (base + 1)
    big_rank = ids // (base + 1)
    small_rank = rem + (ids - split) // max(base, 1)  # base == 0 implies split == num_experts: never selected
    ranks = torch.where(ids < split, big_rank, small_rank)
    return torch.where(ids < 0, torch.full_like(ranks, -1), ranks)


def token_rank_mask(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """Which ranks each token is sent to: once per distinct owning rank of its top-k experts.

    Args:
        topk_ids: ``[num_tokens, top_k] int32|int64``; -1 entries are skipped.

    Returns:
        ``[num_tokens, ep_size] bool``: ``mask[t, d]`` is true iff some expert of token ``t`` lives on rank ``d``.
    """
    ranks = expert_to_rank(topk_ids, num_experts, ep_size)
    return _rank_mask_from_ranks(ranks, ep_size)


def _rank_mask_from_ranks(ranks: torch.Tensor, ep_size: int) -> torch.Tensor:
    """``[num_tokens, top_k] int64`` ranks (-1 = none) -> ``[num_tokens, ep_size] bool``."""
    num_tokens = ranks.shape[0]
    # One spare column absorbs the -1 entries so scatter needs no masking.
    mask = torch.zeros(num_tokens, ep_size + 1, dtype=torch.bool, device=ranks.device)
    column = torch.where(ranks < 0, torch.full_like(ranks, ep_size), ranks)
    mask.scatter_(1, column, True)
    return mask[:, :ep_size]


def send_slots(topk_ids: torch.Tensor, num_experts: int, ep_size: int) -> torch.Tensor:
    """Row of each token in each destination rank's receive block from this rank.

    Within block ``[d][src]`` tokens of ``src`` appear in increasing local token index, so the slot of token
    ``t`` on rank ``d`` is the number of earlier tokens of ``src`` that also go to ``d``.

    Args:
        topk_ids: ``[num_tokens, top_k] int32|int64`` of one source rank.

    Returns:
        ``[num_tokens, ep_size] int64``: the slot, or -1 where the token is not sent to that rank.
    """
    mask = token_rank_mask(topk_ids, num_experts, ep_size)
    return _slots_from_mask(mask)


def _slots_from_mask(mask: torch.Tensor) -> torch.Tensor:
    slots = torch.cumsum(mask.to(torch.int64), dim=0) - 1
    return torch.where(mask, slots, torch.full_like(slots, -1))


# ----------------------------------------------------------------------------------------------------------------
# Byte views
# ----------------------------------------------------------------------------------------------------------------


def row_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """View ``[num_rows, *trailing]`` of any dtype as ``[num_rows, row_bytes] uint8`` (a copy only if strided).

    Copies and comparisons through this view are bitwise whatever the dtype (NaN payloads, float8, packed fp4).
    """
    if tensor.dim() == 0:
        raise ValueError("row_bytes needs a tensor with a leading row dimension, got a 0-d tensor")
    num_rows = tensor.shape[0]
    row_elems = math.prod(tensor.shape[1:])
    return tensor.contiguous().reshape(num_rows, row_elems).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True iff ``a`` and ``b`` have the same dtype, shape and bytes (so NaN equals the same NaN).

    ``b`` may live on another device than ``a`` (a GPU result against a CPU reference); it is moved to ``a``'s.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(row_bytes(a.reshape(1, -1)), row_bytes(b.reshape(1, -1)).to(a.device))


def valid_row_mask(recv_counts: torch.Tensor, runtime_max: int) -> torch.Tensor:
    """Rows of a receive buffer that hold data.

    Args:
        recv_counts: ``[ep_size] int32|int64``, rows received from each source rank.
        runtime_max: rows per source block.

    Returns:
        ``[ep_size, runtime_max] bool``: ``mask[src, slot]`` iff ``slot < recv_counts[src]``.
    """
    rows = torch.arange(runtime_max, device=recv_counts.device)
    return rows.unsqueeze(0) < recv_counts.to(torch.int64).unsqueeze(1)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class DispatchResult:
    """What every rank holds after dispatch, plus the routing combine needs.

    Attributes:
        recv_payloads: ``recv_payloads[d][p]`` is ``[ep_size, runtime_max, *trailing_p]`` of payload ``p``'s dtype
            on receiving rank ``d``; block ``[src]`` holds the rows sent by rank ``src``. Rows at or past
            ``recv_counts[d][src]`` hold :data:`POISON_BYTE` bytes (unspecified by the contract).
        recv_counts: ``recv_counts[d]`` is ``[ep_size] int32``, rows received by ``d`` from each source rank.
        send_slots: ``send_slots[r]`` is ``[num_tokens_r, ep_size] int64``, the row of token ``t`` of rank ``r``
            in block ``[d][r]``, or -1 when it was not sent to ``d``.
        num_experts: total experts.
        runtime_max: ``runtime_max_tokens_per_rank`` of the call.
    """

    recv_payloads: list[list[torch.Tensor]]
    recv_counts: list[torch.Tensor]
    send_slots: list[torch.Tensor]
    num_experts: int
    runtime_max: int

    @property
    def ep_size(self) -> int:
        return len(self.recv_counts)


def _check_rank_lists(topk_ids: Sequence[torch.Tensor], num_experts: int, runtime_max: int) -> None:
    ep_size = len(topk_ids)
    _check_ep_size(ep_size)
    _check_num_experts(num_experts)
    if runtime_max < 0:
        raise ValueError(f"runtime_max_tokens_per_rank must be >= 0, got {runtime_max}")
    for rank, ids in enumerate(topk_ids):
        _check_topk_ids(ids, num_experts, f"topk_ids[{rank}]")
        if ids.shape[0] > runtime_max:
            raise ValueError(
                f"rank {rank} has num_tokens={ids.shape[0]} > runtime_max_tokens_per_rank={runtime_max}"
            )
    top_ks = {ids.shape[1] for ids in topk_ids}
    if len(top_ks) != 1:
        raise ValueError(f"topk_ids must have the same top_k on every rank, got {sorted(top_ks)}")


def _check_payloads(payloads: Sequence[Sequence[torch.Tensor]], topk_ids: Sequence[torch.Tensor]) -> None:
    ep_size = len(topk_ids)
    if len(payloads) != ep_size:
        raise ValueError(f"payloads must have one list per rank ({ep_size}), got {len(payloads)}")
    num_payloads = len(payloads[0])
    if not 1 <= num_payloads <= MAX_PAYLOADS:
        raise ValueError(f"payloads[0] must hold 1..{MAX_PAYLOADS} tensors, got {num_payloads}")
    for rank, rank_payloads in enumerate(payloads):
        if len(rank_payloads) != num_payloads:
            raise ValueError(
                f"payloads[{rank}] holds {len(rank_payloads)} tensors, payloads[0] holds {num_payloads}"
            )
        for p, payload in enumerate(rank_payloads):
            first = payloads[0][p]
            if payload.dim() == 0 or payload.shape[0] != topk_ids[rank].shape[0]:
                raise ValueError(
                    f"payloads[{rank}][{p}] must have shape [num_tokens={topk_ids[rank].shape[0]}, ...], "
                    f"got {tuple(payload.shape)}"
                )
            if payload.dtype != first.dtype or payload.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"payloads[{rank}][{p}] is {payload.dtype} {tuple(payload.shape[1:])} per row, "
                    f"payloads[0][{p}] is {first.dtype} {tuple(first.shape[1:])}"
                )


def _receive_buffer(like: torch.Tensor, ep_size: int, runtime_max: int) -> torch.Tensor:
    """``[ep_size, runtime_max, row_bytes] uint8`` filled with :data:`POISON_BYTE`, for rows shaped like ``like``."""
    num_bytes = math.prod(like.shape[1:]) * like.dtype.itemsize
    return torch.full((ep_size, runtime_max, num_bytes), POISON_BYTE, dtype=torch.uint8, device=like.device)


def _as_payload(buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[ep_size, runtime_max, row_bytes] uint8`` -> ``[ep_size, runtime_max, *trailing]`` of ``like.dtype``."""
    return buffer.view(like.dtype).reshape(buffer.shape[0], buffer.shape[1], *like.shape[1:])


def reference_dispatch(
    topk_ids: Sequence[torch.Tensor],
    payloads: Sequence[Sequence[torch.Tensor]],
    num_experts: int,
    runtime_max_tokens_per_rank: int,
    *,
    active_ranks: Sequence[int] | None = None,
) -> DispatchResult:
    """Send each token's payload rows once to every distinct rank that owns one of its top-k experts.

    Args:
        topk_ids: per rank ``r``, ``[num_tokens_r, top_k] int32|int64``; -1 means "no expert". ``ep_size`` is
            ``len(topk_ids)``; ``top_k`` must agree across ranks.
        payloads: ``payloads[r][p]`` is ``[num_tokens_r, *trailing_p]`` of any dtype; 1..8 payloads, each with
            the same trailing shape and dtype on every rank.
        num_experts: total experts, partitioned as in :func:`expert_to_rank`.
        runtime_max_tokens_per_rank: rows per receive block; every ``num_tokens_r`` must be at most this.
        active_ranks: the ranks taking part (None: all). A token is not sent to a rank outside them (its experts
            there are dropped), and a rank outside them sends nothing (its ids and payloads are ignored).

    Returns:
        :class:`DispatchResult`. In block ``[d][src]`` the rows are the tokens of ``src`` that go to ``d`` in
        increasing local token index, each copied byte for byte; rows past the count are poison.

    Raises:
        ValueError: invalid ids, ``num_tokens_r > runtime_max_tokens_per_rank`` (naming the rank), or
            inconsistent shapes. TypeError: ids neither int32 nor int64.
    """
    runtime_max = runtime_max_tokens_per_rank
    _check_rank_lists(topk_ids, num_experts, runtime_max)
    _check_payloads(payloads, topk_ids)
    ep_size = len(topk_ids)

    masks = _active_masks([token_rank_mask(ids, num_experts, ep_size) for ids in topk_ids], active_ranks)
    slots = [_slots_from_mask(mask) for mask in masks]
    sent = torch.stack([mask.sum(dim=0) for mask in masks])  # [src, dst] rows sent
    recv_counts = [sent[:, d].to(torch.int32).contiguous() for d in range(ep_size)]
    recv_payloads = [_dispatch_one_rank(d, masks, payloads, runtime_max) for d in range(ep_size)]
    return DispatchResult(recv_payloads, recv_counts, slots, num_experts, runtime_max)


def _active_masks(masks: list[torch.Tensor], active_ranks: Sequence[int] | None) -> list[torch.Tensor]:
    """Each rank's send mask with the ranks outside ``active_ranks`` cleared, as destinations and sources."""
    if active_ranks is None:
        return masks
    if any(not 0 <= r < len(masks) for r in active_ranks):
        raise ValueError(f"active_ranks={list(active_ranks)} must be ranks in [0, {len(masks)})")
    active = torch.zeros(len(masks), dtype=torch.bool)
    active[list(active_ranks)] = True
    return [m & active.to(m.device) if active[r] else torch.zeros_like(m) for r, m in enumerate(masks)]


def _dispatch_one_rank(
    dst: int,
    masks: Sequence[torch.Tensor],
    payloads: Sequence[Sequence[torch.Tensor]],
    runtime_max: int,
) -> list[torch.Tensor]:
    """Receive buffers of rank ``dst``: one ``[ep_size, runtime_max, *trailing_p]`` tensor per payload ``p``."""
    received = []
    for p in range(len(payloads[0])):
        per_rank = [rank_payloads[p] for rank_payloads in payloads]
        buffer = _receive_buffer(per_rank[0], len(per_rank), runtime_max)
        for src, payload in enumerate(per_rank):
            rows = row_bytes(payload)[masks[src][:, dst]]
            buffer[src, : rows.shape[0]] = rows
        received.append(_as_payload(buffer, per_rank[0]))
    return received


# ----------------------------------------------------------------------------------------------------------------
# Combine
# ----------------------------------------------------------------------------------------------------------------


def _routing_slots(
    routing: DispatchResult | Sequence[torch.Tensor], num_experts: int | None, runtime_max: int,
    active_ranks: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    if isinstance(routing, DispatchResult):
        if routing.runtime_max != runtime_max:
            raise ValueError(
                f"partials have runtime_max={runtime_max} rows per block, the dispatch used {routing.runtime_max}"
            )
        return list(routing.send_slots)
    if num_experts is None:
        raise ValueError("num_experts is required when routing is a list of topk_ids")
    _check_rank_lists(routing, num_experts, runtime_max)
    masks = _active_masks([token_rank_mask(ids, num_experts, len(routing)) for ids in routing], active_ranks)
    return [_slots_from_mask(mask) for mask in masks]


def _check_partials(partials: Sequence[torch.Tensor], ep_size: int) -> None:
    if len(partials) != ep_size:
        raise ValueError(f"partials must have one tensor per rank ({ep_size}), got {len(partials)}")
    first = partials[0]
    for d, partial in enumerate(partials):
        if partial.dtype not in _COMBINE_DTYPES:
            raise TypeError(f"partials[{d}] must be bf16, fp16 or fp32, got {partial.dtype}")
        if partial.dim() != 3 or partial.shape[0] != ep_size:
            raise ValueError(
                f"partials[{d}] must have shape [ep_size={ep_size}, runtime_max, hidden], got {tuple(partial.shape)}"
            )
        if partial.dtype != first.dtype or partial.shape != first.shape:
            raise ValueError(
                f"partials[{d}] is {partial.dtype} {tuple(partial.shape)}, partials[0] is {first.dtype} "
                f"{tuple(first.shape)}"
            )


def reference_combine(
    partials: Sequence[torch.Tensor],
    routing: DispatchResult | Sequence[torch.Tensor],
    num_experts: int | None = None,
    *,
    out_dtype: torch.dtype | None = None,
    active_ranks: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Sum each token's partial results from the ranks it was sent to, in increasing rank order, in fp32.

    ``out[r][t] = cast(((+0.0 + p_{d0}) + p_{d1}) + ...)`` over the distinct ranks ``d0 < d1 < ...`` token ``t``
    of rank ``r`` was sent to, where ``p_d = float32(partials[d][r, slot(t, d)])``. Each step is one IEEE fp32
    round-to-nearest-even addition (subnormals kept, no FMA); the cast to ``out_dtype`` rounds to nearest even.
    A token sent nowhere gets +0.0. Rows of ``partials`` that no token was sent to are never read.

    Args:
        partials: per rank ``d``, ``[ep_size, runtime_max, hidden] bf16|fp16|fp32``; row ``[src, slot]`` is the
            partial result, computed on ``d``, of the token received in that row from ``src``.
        routing: the :class:`DispatchResult` of the matching dispatch, or per rank ``r`` its
            ``[num_tokens_r, top_k] int32|int64`` topk_ids (then ``num_experts`` is required).
        num_experts: total experts; only used with topk_ids routing.
        out_dtype: bf16|fp16|fp32 output dtype; defaults to the partials' dtype.
        active_ranks: with topk_ids routing, the ranks taking part (as :func:`reference_dispatch`'s; a
            :class:`DispatchResult` carries its own): a rank outside them adds nothing, and its own output is zeros.

    Returns:
        per rank ``r``, ``[num_tokens_r, hidden]`` of ``out_dtype``.
    """
    ep_size = len(routing.send_slots) if isinstance(routing, DispatchResult) else len(routing)
    _check_partials(partials, ep_size)
    runtime_max, hidden = partials[0].shape[1], partials[0].shape[2]
    out_dtype = partials[0].dtype if out_dtype is None else out_dtype
    if out_dtype not in _COMBINE_DTYPES:
        raise TypeError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    if active_ranks is not None and isinstance(routing, DispatchResult):
        raise ValueError("active_ranks goes with topk_ids routing: a DispatchResult carries its dispatch's set")
    slots = _routing_slots(routing, num_experts, runtime_max, active_ranks)
    return [_combine_one_rank(r, slots[r], partials, hidden, out_dtype) for r in range(ep_size)]


def _combine_one_rank(
    owner: int, slots: torch.Tensor, partials: Sequence[torch.Tensor], hidden: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """``[num_tokens, hidden]`` output of rank ``owner`` from its ``[num_tokens, ep_size]`` send slots."""
    acc = torch.zeros(slots.shape[0], hidden, dtype=torch.float32, device=slots.device)
    for d, partial in enumerate(partials):
        sent = slots[:, d] >= 0
        rows = partial[owner][slots[sent, d]]
        acc[sent] = acc[sent] + rows.to(torch.float32)
    return acc.to(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# Sanitize
# ----------------------------------------------------------------------------------------------------------------


def reference_sanitize(recv_topk_ids: torch.Tensor, recv_counts: torch.Tensor, invalid_id: int) -> torch.Tensor:
    """Copy of the received top-k ids with every row past its block's count set entirely to ``invalid_id``.

    Args:
        recv_topk_ids: ``[ep_size, runtime_max, top_k] int32|int64`` on one receiving rank.
        recv_counts: ``[ep_size] int32|int64``, valid rows per source block.
        invalid_id: value written into the invalid rows; must fit the ids' dtype.

    Returns:
        ``[ep_size, runtime_max, top_k]``, same dtype; valid rows unchanged.
    """
    if recv_topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"recv_topk_ids must be int32 or int64, got {recv_topk_ids.dtype}")
    if recv_topk_ids.dim() != 3:
        raise ValueError(
            f"recv_topk_ids must have shape [ep_size, runtime_max, top_k], got {tuple(recv_topk_ids.shape)}"
        )
    ep_size, runtime_max = recv_topk_ids.shape[0], recv_topk_ids.shape[1]
    if recv_counts.shape != (ep_size,):
        raise ValueError(f"recv_counts must have shape [ep_size={ep_size}], got {tuple(recv_counts.shape)}")
    info = torch.iinfo(recv_topk_ids.dtype)
    if not info.min <= invalid_id <= info.max:
        raise ValueError(f"invalid_id={invalid_id} does not fit {recv_topk_ids.dtype}")
    valid = valid_row_mask(recv_counts, runtime_max)
    out = recv_topk_ids.clone()
    out[~valid] = invalid_id
    return out


# ----------------------------------------------------------------------------------------------------------------
# Random test inputs
# ----------------------------------------------------------------------------------------------------------------


def random_topk_ids(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    *,
    dtype: torch.dtype = torch.int32,
    generator: torch.Generator | None = None,
    distinct: bool = True,
    minus_one_frac: float = 0.0,
    skew: float | None = None,
) -> torch.Tensor:
    """Random routing ``[num_tokens, top_k] int32|int64`` on CPU.

    Args:
        distinct: each token's experts are distinct (what a router's top-k produces); if False they are drawn
            with replacement, so a token may name one expert several times.
        minus_one_frac: probability that each entry is replaced by -1 ("no expert").
        skew: None for uniform expert choice. A float ``s >= 0`` weights expert ``e`` by ``(e + 1) ** -s``
            (Zipf: low ids, hence low ranks, run hot). ``math.inf`` sends every token to experts
            ``0..top_k-1`` (or all to expert 0 when not ``distinct``).
        generator: a CPU generator for reproducible draws.
    """
    if dtype not in _ID_DTYPES:
        raise TypeError(f"dtype must be int32 or int64, got {dtype}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top_k must be in 1..{MAX_TOP_K}, got {top_k}")
    _check_num_experts(num_experts)
    if distinct and top_k > num_experts:
        raise ValueError(f"distinct top_k={top_k} needs num_experts >= top_k, got {num_experts}")
    if not 0.0 <= minus_one_frac <= 1.0:
        raise ValueError(f"minus_one_frac must be in [0, 1], got {minus_one_frac}")
    if skew is not None and skew < 0:
        raise ValueError(f"skew must be None or >= 0, got {skew}")

    ids = _draw_experts(num_tokens, top_k, num_experts, generator, distinct, skew)
    if minus_one_frac > 0.0:
        drop = torch.rand(num_tokens, top_k, generator=generator) < minus_one_frac
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    return ids.to(dtype)


def _draw_experts(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    generator: torch.Generator | None,
    distinct: bool,
    skew: float | None,
) -> torch.Tensor:
    """``[num_tokens, top_k] int64`` expert ids in ``[0, num_experts)``."""
    if skew == math.inf:
        hot = torch.arange(top_k) if distinct else torch.zeros(top_k, dtype=torch.int64)
        return hot.expand(num_tokens, top_k).clone()
    if num_tokens == 0:
        return torch.empty(0, top_k, dtype=torch.int64)
    weights = torch.ones(num_experts, dtype=torch.float64)
    if skew is not None:
        weights = torch.arange(1, num_experts + 1, dtype=torch.float64).pow(-skew)
        # Keep every weight positive so sampling without replacement always has top_k candidates.
        weights = weights.clamp_min(torch.finfo(torch.float64).tiny)
    rows = weights.expand(num_tokens, num_experts)
    return torch.multinomial(rows, top_k, replacement=not distinct, generator=generator)


def random_payload(
    num_tokens: int,
    trailing: Sequence[int],
    dtype: torch.dtype,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[num_tokens, *trailing]`` of ``dtype`` with uniformly random bytes, on CPU.

    Any bit pattern can appear (NaN, inf, subnormals for float dtypes), which is what a bitwise copy test wants;
    compare with :func:`bitwise_equal`. Bool payloads get 0/1, the only valid bool bytes.
    """
    shape = (num_tokens, *trailing)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).to(torch.bool)
    num_bytes = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)
