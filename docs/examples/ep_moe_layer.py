"""An expert-parallel MoE layer over flashinfer_a2a: router top-k -> dispatch (bf16, FP8 block or NVFP4 on the
wire) -> each rank's SwiGLU experts on the rows it received -> combine. And the same layer computed densely on one
GPU, which it equals bit for bit (tests/gpu/test_ep_moe_layer.py).

Why bitwise: the dispatch moves rows unchanged (or quantizes them exactly as :mod:`flashinfer_a2a.reference.quant`
does); the experts here compute every row the same way whatever the batch (GEMMs on fixed tiles of ``TILE`` rows);
each rank sums its experts' weighted outputs in fp32 in increasing expert order and rounds once to bf16; combine
sums those partials over the ranks in increasing rank order in fp32 — and :func:`dense_moe` does the same
arithmetic. Quantized wires equal the dense layer fed the same quantized-dequantized activations bit for bit, and
the plain bf16 dense layer within the format's error (docs/integration.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as nnf

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import rank_expert_range

TILE = 64  # rows per expert GEMM: the same GEMM shape on every call, so a row's result never depends on the batch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclasses.dataclass
class MoEWeights:
    """Router ``[num_experts, hidden]`` fp32; per expert SwiGLU ``gate_up [2 * inter, hidden]`` and ``down
    [hidden, inter]``, fp32 (every rank may hold all: a rank only reads its own experts')."""

    router: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def random(cls, hidden: int, inter: int, num_experts: int, generator: torch.Generator, device="cuda"):
        def draw(*shape, scale):
            return (torch.randn(*shape, generator=generator) * scale).to(device)

        return cls(draw(num_experts, hidden, scale=hidden ** -0.5),
                   draw(num_experts, 2 * inter, hidden, scale=hidden ** -0.5),
                   draw(num_experts, hidden, inter, scale=inter ** -0.5))

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]


def tiled_matmul(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x @ w_t`` computed ``TILE`` rows at a time (rows padded with zeros): each row's result depends on that row
    only, never on how many rows came with it. fp32 ``[rows, k] @ [k, n]``."""
    rows = x.shape[0]
    tiles = -(-rows // TILE)
    padded = torch.zeros(tiles * TILE, x.shape[1], dtype=torch.float32, device=x.device)
    padded[:rows] = x
    out = torch.stack([padded[i * TILE:(i + 1) * TILE] @ w_t for i in range(tiles)]) if tiles else \
        padded.new_zeros(0, TILE, w_t.shape[1])
    return out.reshape(tiles * TILE, w_t.shape[1])[:rows]


def route(x: torch.Tensor, weights: MoEWeights, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router: ``(topk_ids [tokens, top_k] int64, topk_weights [tokens, top_k] fp32)``."""
    probs = tiled_matmul(x.float(), weights.router.t()).softmax(-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    total = topk_weights[:, :1]
    for j in range(1, top_k):  # term by term: the same additions whatever the batch
        total = total + topk_weights[:, j:j + 1]
    return topk_ids, topk_weights / total


def expert_partials(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights: MoEWeights,
                    first: int, end: int) -> torch.Tensor:
    """For each row, the sum over its experts in ``[first, end)`` of ``weight * SwiGLU_e(x)``: fp32 ``[rows,
    hidden]``, experts added in increasing order. Ids outside the range (other ranks', -1, a padding id) add nothing."""
    x = x.float()
    acc = torch.zeros(x.shape[0], weights.down.shape[1], dtype=torch.float32, device=x.device)
    for e in range(first, end):
        coef = torch.zeros(x.shape[0], 1, dtype=torch.float32, device=x.device)
        for j in range(topk_ids.shape[1]):  # term by term: the same additions whatever the shape
            coef = coef + torch.where(topk_ids[:, j:j + 1] == e, topk_weights[:, j:j + 1].float(), 0.0)
        gate, up = tiled_matmul(x, weights.gate_up[e].t()).chunk(2, dim=-1)
        acc = acc + coef * tiled_matmul(nnf.silu(gate) * up, weights.down[e].t())
    return acc


def e2m1_table(device) -> torch.Tensor:
    """E2M1 magnitudes by code, on ``device`` (made once, outside any CUDA graph capture)."""
    return torch.tensor(E2M1, dtype=torch.float32, device=device)


def dequantize(wire: Optional[str], values: torch.Tensor, scales: torch.Tensor, hidden: int,
               global_scale: Optional[torch.Tensor], table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 rows of received ``(values, scales)`` in ``wire`` (device-side; equals the reference dequantizers).
    NVFP4 needs ``table`` (:func:`e2m1_table`)."""
    rows = values.shape[:-1]
    if wire == "fp8_block":
        blocks = values.float().reshape(*rows, scales.shape[-1], 128)  # hidden % 128 == 0 here
        return (blocks * scales.float().unsqueeze(-1)).reshape(*rows, hidden)
    if wire == "nvfp4":
        codes = torch.stack([values & 0xF, values >> 4], dim=-1).flatten(-2)[..., :hidden].long()
        magnitude = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
        blocks = magnitude.reshape(*rows, scales.shape[-1], 16) * (scales.float() / global_scale).unsqueeze(-1)
        return blocks.reshape(*rows, hidden)
    raise ValueError(f"wire must be None, 'fp8_block' or 'nvfp4', got {wire!r}")


class EPMoELayer(torch.nn.Module):
    """One MoE layer on one rank of an expert-parallel group.

    Args:
        a2a: this rank's :class:`flashinfer_a2a.MoeAlltoAll` (sized with ``dispatch_format=wire``).
        weights: the layer's weights (this rank reads the router and its own experts).
        top_k: experts per token.
        wire: None (bf16 rows), ``"fp8_block"`` or ``"nvfp4"``: how the activations cross NVLink (hidden a
            multiple of 128, resp. 16, for this example's dequantizer).
        global_scale: NVFP4's per-tensor scale, a one-element fp32 device tensor.
    """

    def __init__(self, a2a: MoeAlltoAll, weights: MoEWeights, top_k: int, wire: Optional[str] = None,
                 global_scale: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.a2a, self.weights, self.top_k, self.wire, self.global_scale = a2a, weights, top_k, wire, global_scale
        self.first, self.end = rank_expert_range(a2a.ep_rank, weights.num_experts, a2a.ep_size)
        self.table = e2m1_table(weights.router.device)

    def forward(self, x: torch.Tensor, runtime_max_tokens_per_rank: int) -> torch.Tensor:
        """``x [num_tokens, hidden]`` bf16 -> ``[num_tokens, hidden]`` bf16. ``runtime_max_tokens_per_rank``: the
        most tokens any rank has this step (the same on every rank)."""
        topk_ids, topk_weights = self.route(x)
        recv = self.send(x, topk_ids, topk_weights, runtime_max_tokens_per_rank)
        self.run_experts(recv, x.shape[-1])
        return self.a2a.combine()

    # The steps of forward, also callable one at a time: simulated ranks driven from one thread run each step on
    # every rank before the next (tests/gpu/test_ep_moe_layer.py), as separate processes would overlap them.
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return route(x, self.weights, self.top_k)

    def send(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             runtime_max_tokens_per_rank: int) -> list[torch.Tensor]:
        recv, _ = self.a2a.dispatch(topk_ids, [x, topk_ids, topk_weights], runtime_max_tokens_per_rank,
                                    quant_format=self.wire, global_scale=self.global_scale)
        return recv

    def run_experts(self, recv: list[torch.Tensor], hidden: int) -> None:
        """This rank's experts on every received row, their output written into the combine region (zero copy)."""
        if self.wire is None:
            recv_x, recv_ids, recv_w = recv
            rows = recv_x.reshape(-1, hidden).float()
        else:
            values, scales, recv_ids, recv_w = recv
            rows = dequantize(self.wire, values, scales, hidden, self.global_scale, self.table)
            rows = rows.reshape(-1, hidden)
        # Rows past a source's count hold stale data: whatever the experts make of them is never combined.
        partials = expert_partials(rows, recv_ids.reshape(-1, self.top_k), recv_w.reshape(-1, self.top_k),
                                   self.weights, self.first, self.end)
        combine_input = self.a2a.combine_input()
        combine_input.copy_(partials.reshape(combine_input.shape))


def dense_moe(xs: list[torch.Tensor], weights: MoEWeights, top_k: int, ep_size: int,
              dequantized: Optional[list[torch.Tensor]] = None,
              routing: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None) -> list[torch.Tensor]:
    """The layer computed on one GPU for every rank's tokens ``xs``: per token, each rank's share of its experts
    summed in fp32 and rounded to bf16, the shares summed in increasing rank order in fp32. ``dequantized``: the
    activations the experts see (quantized wires), default ``xs``. ``routing``: each rank's ``(topk_ids,
    topk_weights)`` instead of the router's. Returns the output rows of each rank."""
    sizes = [x.shape[0] for x in xs]
    x_all = torch.cat(xs)
    rows = torch.cat(dequantized) if dequantized is not None else x_all.float()
    if routing is None:
        topk_ids, topk_weights = route(x_all, weights, top_k)
    else:
        topk_ids, topk_weights = torch.cat(routing[0]).long(), torch.cat(routing[1])
    out = torch.zeros(x_all.shape[0], weights.down.shape[1], dtype=torch.float32, device=x_all.device)
    for rank in range(ep_size):
        first, end = rank_expert_range(rank, weights.num_experts, ep_size)
        sent = ((topk_ids >= first) & (topk_ids < end)).any(-1, keepdim=True)
        share = expert_partials(rows, topk_ids, topk_weights, weights, first, end).to(torch.bfloat16).float()
        out = torch.where(sent, out + share, out)  # only the ranks a token went to contribute
    return list(out.to(torch.bfloat16).split(sizes))
