"""What a dispatch and a combine move, counted from the routing: the bytes behind every GB/s column.

A token goes to each distinct rank that owns one of its top-k experts, once. Per rank:

- remote rows: (token, destination) pairs whose destination is another rank. Dispatch stores them over NVLink;
  combine brings their partials back over NVLink. "remote bytes" = remote rows x row bytes.
- logical rows: every (token, destination) pair, the rank's own included; DeepEP's published bandwidths count
  these ("logical bytes"), although the local share never crosses a link.

The bandwidth columns divide the mean over ranks of these bytes by the time (the slowest rank's).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..reference import token_rank_mask


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Rows each rank sends, counted from the routing."""

    remote_rows: tuple[int, ...]  # per rank
    logical_rows: tuple[int, ...]  # per rank, own rank included

    @property
    def ep_size(self) -> int:
        return len(self.remote_rows)

    def mean_bytes(self, row_bytes: int) -> dict[str, float]:
        """Mean over ranks of the remote and logical bytes for rows of ``row_bytes``."""
        return {
            "remote": row_bytes * sum(self.remote_rows) / self.ep_size,
            "logical": row_bytes * sum(self.logical_rows) / self.ep_size,
        }


def count_rows(topk_ids: Sequence[torch.Tensor], num_experts: int) -> Traffic:
    """Rows sent by each rank, from each rank's ``[num_tokens, top_k]`` ids (rank r's list entry is rank r's)."""
    ep_size = len(topk_ids)
    remote, logical = [], []
    for rank, ids in enumerate(topk_ids):
        mask = token_rank_mask(ids, num_experts, ep_size)
        logical.append(int(mask.sum()))
        remote.append(int(mask.sum()) - int(mask[:, rank].sum()))
    return Traffic(tuple(remote), tuple(logical))


def gbps(num_bytes: float, microseconds: float) -> float:
    """GB/s (10^9 bytes per second) of ``num_bytes`` moved in ``microseconds``."""
    return num_bytes / (microseconds * 1e3) if microseconds > 0 else float("nan")
