"""The compute stages of the overlap study (``--overlap``), run per micro-batch between its dispatch and its combine.

``experts``: each rank's routed experts of DeepSeek-V3's shape on the rows it received, as an engine runs them:

1. route: every (received row, top-k slot) whose expert this rank owns becomes a pair; the pairs are sorted by
   expert (a stable sort of ``[ep_size * runtime_max * top_k]`` one-byte keys, past-count rows and other ranks'
   experts keyed last: one radix pass), each group's end found in the sorted keys (``offs``). An engine routes in
   a kernel or two; a sort of 64-bit keys took some 25 small nodes here, whose launch gaps grew when the
   transfer's stream joined the graph (docs/overlap.md);
2. gather the pairs' rows ``[pairs, hidden]``;
3. gate-up grouped GEMM ``[pairs, hidden] x [experts, hidden, 2 * 2048]``, SiLU(gate) * up;
4. down grouped GEMM ``[pairs, 2048] x [experts, 2048, hidden]``, times each pair's top-k weight;
5. sum each row's pairs into the zero-copy combine input (``index_add_`` into the zeroed ``[ep_size *
   runtime_max, hidden]``).

All on the device with fixed shapes, so it is captured in CUDA graphs: the number of pairs, which sizes steps 2-5, is
read once per case (an untimed host sync; the routing is the same every iteration). The grouped GEMMs are
``torch._grouped_mm`` with device offsets (CUTLASS on Hopper and Blackwell); where it is missing or refuses the
shapes, one ``torch.mm`` per expert over the same rows, cut at the offsets read once (valid for the same reason).

The model's routed experts (256 for DeepSeek-V3) are folded into :data:`STAGE_EXPERTS` groups over all ranks, 8 per
rank at 4 GPUs and 16 at 2: expert ``e`` of rank r's contiguous range ``[lo, hi)`` computes as group
``(e - lo) * local_experts // (hi - lo)``. The FLOPs are the model's (every routed pair is computed once); the groups
set how many weight matrices a rank reads (about 88 MB each in bf16), the part that bounds decode-sized batches.

``dense``: the former single GEMM ``[tokens, hidden] x [hidden, 2048]`` on the micro-batch's own tokens, a far
smaller stage, kept as a second row.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from ..reference import rank_expert_range

#: Routed expert groups over all ranks in the ``experts`` stage (see the module docstring).
STAGE_EXPERTS = 32
#: The stage's sort keys are one byte: expert groups per rank stay below this.
KEY_LIMIT = 255
#: DeepSeek-V3's routed expert: hidden -> 2 x 2048 (gate, up), SiLU(gate) * up, 2048 -> hidden.
INTERMEDIATE = 2048
#: The ``dense`` stage's GEMM width.
DENSE_N = 2048


def local_experts(num_experts: int, ep_size: int) -> int:
    """Expert groups per rank: :data:`STAGE_EXPERTS` over all ranks, at least one per rank and at most the routed
    experts a rank owns."""
    return max(1, min(STAGE_EXPERTS // ep_size, num_experts // ep_size))


@dataclasses.dataclass
class ExpertWeights:
    """One rank's expert weights (shared by micro-batches, and by simulated ranks), in ``nn.Linear``'s layout."""

    gate_up: torch.Tensor  # [local_experts, 2 * INTERMEDIATE, hidden]
    down: torch.Tensor  # [local_experts, hidden, INTERMEDIATE]

    @staticmethod
    def random(experts: int, hidden: int, device: torch.device, seed: int) -> "ExpertWeights":
        gen = torch.Generator(device).manual_seed(seed)

        def linear(rows: int, cols: int) -> torch.Tensor:  # unit-variance outputs for unit-variance inputs
            w = torch.randn(experts, rows, cols, generator=gen, device=device, dtype=torch.bfloat16)
            return w.mul_(cols ** -0.5)

        return ExpertWeights(linear(2 * INTERMEDIATE, hidden), linear(hidden, INTERMEDIATE))


def grouped_mm_works(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs a bf16 2D x 3D product with device offsets here (an empty group
    included), checked against ``torch.mm``."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(24, 64, generator=gen, device=device).to(torch.bfloat16)
    w = torch.randn(3, 32, 64, generator=gen, device=device).to(torch.bfloat16)
    offs = torch.tensor([8, 8, 24], dtype=torch.int32, device=device)
    try:
        got = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    want = torch.cat([a[:8] @ w[0].t(), a[8:] @ w[2].t()])
    return bool(torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2))


class ExpertStage:
    """One rank's ``experts`` stage for one micro-batch: reads the received rows, ids and weights, writes the
    combine input. Call it to queue one step on the current stream.

    Args:
        recv_x, recv_ids, recv_weights: the dispatch's receive views ``[ep_size, runtime_max, hidden]`` bf16,
            ``[ep_size, runtime_max, top_k]`` int32|int64, ``[ep_size, runtime_max, top_k]`` fp32.
        recv_counts: ``[ep_size] int32``.
        combine_input: ``[ep_size, runtime_max, hidden]``, the zero-copy combine input.
        rank, num_experts: which routed experts this rank owns.
        weights: this rank's expert groups.
        grouped: ``torch._grouped_mm`` (else one ``torch.mm`` per group).
    """

    def __init__(self, recv_x: torch.Tensor, recv_ids: torch.Tensor, recv_weights: torch.Tensor,
                 recv_counts: torch.Tensor, combine_input: torch.Tensor, rank: int, num_experts: int,
                 weights: ExpertWeights, grouped: bool) -> None:
        self.ep_size, self.runtime_max, self.top_k = recv_ids.shape
        self.hidden = recv_x.shape[-1]
        self.x = recv_x.reshape(-1, self.hidden)
        self.ids, self.topk_weights, self.counts = recv_ids, recv_weights.reshape(-1), recv_counts
        self.out = combine_input.reshape(-1, self.hidden)
        self.lo, self.hi = rank_expert_range(rank, num_experts, self.ep_size)
        self.weights, self.grouped = weights, grouped
        self.experts = weights.gate_up.shape[0]
        if self.experts >= KEY_LIMIT:
            raise ValueError(f"weights hold {self.experts} expert groups: the stage sorts one-byte keys, expected "
                             f"fewer than {KEY_LIMIT}")
        self.slots = torch.arange(self.runtime_max, device=recv_ids.device)
        self.groups = torch.arange(self.experts, dtype=torch.uint8, device=recv_ids.device)
        # Read once (a host sync, outside any timing): the pairs, and the offsets the per-expert fallback cuts at.
        ends = self._route()[1].tolist()
        self.pairs = ends[-1]
        self.bounds = list(zip([0] + ends[:-1], ends))

    def _keys(self) -> torch.Tensor:
        """``[ep_size * runtime_max * top_k]`` uint8: each pair's expert group, ``experts`` for the others."""
        valid = (self.slots < self.counts[:, None])[..., None]
        ids = self.ids
        mine = valid & (ids >= self.lo) & (ids < self.hi)
        group = (ids - self.lo) * self.experts // max(1, self.hi - self.lo)
        return torch.where(mine, group, self.experts).flatten().to(torch.uint8)

    def _route(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's flat index sorted by group (stable; this rank's pairs first), and ``[experts]`` int32: the
        end of each group's pairs in that order."""
        keys, order = torch.sort(self._keys(), stable=True)
        return order, torch.searchsorted(keys, self.groups, right=True, out_int32=True)

    def _gemm(self, rows: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """``rows [pairs, k] x weight[e].T`` for each group's rows."""
        if self.grouped:
            return torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offs)
        out = torch.empty(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)
        for e, (start, end) in enumerate(self.bounds):
            if end > start:
                torch.mm(rows[start:end], weight[e].t(), out=out[start:end])
        return out

    def __call__(self) -> None:
        if not self.pairs:  # nothing received for this rank's experts (skewed routing)
            self.out.zero_()
            return
        order, offs = self._route()
        order = order[: self.pairs]
        rows = order // self.top_k
        h = self._gemm(self.x.index_select(0, rows), self.weights.gate_up, offs)
        act = torch.nn.functional.silu(h[:, :INTERMEDIATE]) * h[:, INTERMEDIATE:]
        y = self._gemm(act, self.weights.down, offs)
        y.mul_(self.topk_weights.index_select(0, order).to(y.dtype)[:, None])
        self.out.zero_()
        self.out.index_add_(0, rows, y)


def dense_stage(tokens: int, hidden: int, device: torch.device, seed: int,
                weight: Optional[torch.Tensor] = None) -> tuple[Callable[[], None], torch.Tensor]:
    """The ``dense`` stage: ``[tokens, hidden] x [hidden, DENSE_N]`` bf16 on fresh inputs; returns the step and its
    weight (pass it again to share it)."""
    gen = torch.Generator(device).manual_seed(seed)
    if weight is None:
        weight = torch.randn(hidden, DENSE_N, generator=gen, device=device).to(torch.bfloat16)
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    y = torch.empty(tokens, DENSE_N, dtype=torch.bfloat16, device=device)
    return (lambda: torch.matmul(x, weight, out=y)), weight
