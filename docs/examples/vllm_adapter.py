"""A prepare/finalize pair shaped as vLLM's for its one-sided NVLink all-to-all backend, over a FlashInfer-style
``MoeAlltoAll`` (``flashinfer_a2a.compat.flashinfer.MoeAlltoAll``, or FlashInfer's own). Duck-typed: vLLM is not
imported; the method names and arguments are those vLLM's modular MoE kernel calls.

prepare: dispatch ``[a1, (a1_scale), topk_ids, topk_weights]`` by keyword, with the received ids' padded rows set to
-1, and hand the experts flat ``[ep_size * runtime_max, ...]`` views. finalize: combine the experts' output
``[ep_size * runtime_max, hidden]`` straight into vLLM's ``output`` when ``combine`` takes one (it does here), else
copy. A rank with no tokens passes empty tensors: no dummy token.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch


class OneSidedPrepareAndFinalize:
    """Args:
        moe_alltoall: a FlashInfer-style ``MoeAlltoAll`` built for this EP group.
        runtime_max_tokens_per_rank: returns this step's most tokens on any rank (vLLM reads it from its DP
            metadata); the same on every rank.
    """

    def __init__(self, moe_alltoall: Any, runtime_max_tokens_per_rank: Callable[[], int]) -> None:
        self.a2a = moe_alltoall
        self.runtime_max = runtime_max_tokens_per_rank
        # vLLM looks for `output` in combine's signature and copies when it is missing.
        self.combine_takes_output = "output" in inspect.signature(moe_alltoall.combine).parameters
        self._runtime_max: Optional[int] = None

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: Optional[torch.Tensor] = None, apply_router_weight_on_input: bool = False,
                quant_config: Any = None, a1_scale: Optional[torch.Tensor] = None):
        """Returns ``(a1q, a1q_scale, expert_tokens_meta, topk_ids, topk_weights)`` of the rows this rank received,
        flattened to ``[ep_size * runtime_max, ...]``; ids of padded rows are -1."""
        if expert_map is not None or apply_router_weight_on_input:
            raise NotImplementedError("expert_map and apply_router_weight_on_input are not part of this example")
        payloads = [a1] + ([a1_scale] if a1_scale is not None else []) + [topk_ids, topk_weights]
        self._runtime_max = self.runtime_max()
        recv = self.a2a.dispatch(token_selected_experts=topk_ids, input_payloads=payloads,
                                 runtime_max_tokens_per_rank=self._runtime_max, invalid_token_expert_id=-1,
                                 expert_id_payload_index=len(payloads) - 2)
        flat = [t.view(-1, t.shape[-1]) for t in recv]
        a1q_scale = flat[1] if a1_scale is not None else None
        return flat[0], a1q_scale, None, flat[-2], flat[-1]

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool = False,
                 weight_and_reduce_impl: Any = None) -> None:
        """Writes, into ``output [num_tokens, hidden]``, each token's expert outputs summed over the ranks it went to
        (``fused_expert_output`` rows hold the experts' weighted sums per received row)."""
        hidden = fused_expert_output.shape[-1]
        payload = fused_expert_output.view(-1, self._runtime_max, hidden)
        if self.combine_takes_output:
            self.a2a.combine(payload=payload, runtime_max_tokens_per_rank=self._runtime_max, output=output)
        else:
            output.copy_(self.a2a.combine(payload=payload, runtime_max_tokens_per_rank=self._runtime_max))
