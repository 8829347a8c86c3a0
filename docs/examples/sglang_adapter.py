"""A token dispatcher shaped as SGLang's FlashInfer dispatcher (``--moe-a2a-backend flashinfer``), over a
FlashInfer-style ``MoeAlltoAll`` (``flashinfer_a2a.compat.flashinfer.MoeAlltoAll``, or FlashInfer's own).
Duck-typed: SGLang is not imported.

dispatch: ``[hidden_states, topk_ids (int32), topk_weights]`` passed positionally, the received ids' padded rows
set to the runner's invalid id (-1, or ``num_experts`` for a CUTLASS runner); with ``payload_in_workspace`` the
experts get the zero-copy combine region as their output buffer. combine: the experts' output back to
``[num_tokens, hidden]``. A rank with no tokens passes empty tensors: no dummy token.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch


class DispatchOutput(NamedTuple):
    hidden_states: torch.Tensor  # [ep_size * runtime_max, hidden]
    topk_ids: torch.Tensor  # [ep_size * runtime_max, top_k] int32, padded rows = the invalid id
    topk_weights: torch.Tensor  # [ep_size * runtime_max, top_k] fp32
    moe_output: Optional[torch.Tensor]  # the experts' output buffer in the workspace, or None


class FlashinferStyleDispatcher:
    """Args:
        moe_a2a: a FlashInfer-style ``MoeAlltoAll`` (SGLang builds one per MoE layer; they share a workspace).
        ep_size, hidden_size, num_experts: the layer's shape.
        invalid_token_expert_id: written into the padded rows of the received ids.
        payload_in_workspace: the experts write into the combine region (zero copy).
    """

    def __init__(self, moe_a2a: Any, ep_size: int, hidden_size: int, num_experts: int,
                 invalid_token_expert_id: int = -1, payload_in_workspace: bool = True) -> None:
        self.moe_a2a, self.ep_size, self.hidden_size = moe_a2a, ep_size, hidden_size
        self.num_experts, self.invalid_token_expert_id = num_experts, invalid_token_expert_id
        self.payload_in_workspace = payload_in_workspace
        self.runtime_max_tokens_per_rank: Optional[int] = None

    def dispatch(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 runtime_max_tokens_per_rank: int) -> DispatchOutput:
        """``runtime_max_tokens_per_rank``: the same on every rank (SGLang: the most tokens of any DP rank)."""
        self.runtime_max_tokens_per_rank = runtime_max_tokens_per_rank
        recv_x, recv_ids, recv_w = self.moe_a2a.dispatch(
            topk_ids.to(torch.int32), [hidden_states, topk_ids.to(torch.int32), topk_weights],
            runtime_max_tokens_per_rank, invalid_token_expert_id=self.invalid_token_expert_id,
            expert_id_payload_index=1)
        moe_output = None
        if self.payload_in_workspace:
            moe_output = self.moe_a2a.get_combine_payload_tensor_in_workspace(
                runtime_max_tokens_per_rank, self.hidden_size, hidden_states.dtype).view(-1, self.hidden_size)
        return DispatchOutput(recv_x.view(-1, recv_x.shape[-1]), recv_ids.view(-1, recv_ids.shape[-1]),
                              recv_w.view(-1, recv_w.shape[-1]), moe_output)

    def combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [ep_size * runtime_max, hidden]``: the experts' output (``moe_output`` when it was
        used). Returns ``[num_tokens, hidden]``."""
        runtime_max = self.runtime_max_tokens_per_rank
        out = self.moe_a2a.combine(hidden_states.view(self.ep_size, runtime_max, hidden_states.shape[-1]),
                                   runtime_max, payload_in_workspace=self.payload_in_workspace)
        self.runtime_max_tokens_per_rank = None
        return out
