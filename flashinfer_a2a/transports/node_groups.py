"""How the ``hierarchical`` transport splits an expert-parallel group into nodes, and the sub-groups it talks over.

Contiguous ranks form a node: with ``node_size`` ranks per node, rank ``r`` is local rank ``r % node_size`` of node
``r // node_size``. Two kinds of sub-group follow:

- the **node group** of each node (its ``node_size`` ranks, gloo): the bootstrap of the node's symmetric workspace on
  GPUs, the data path on CPU;
- the **peer group** of each local index (the ``num_nodes`` ranks with that local index, one per node; NCCL on GPUs,
  gloo on CPU): the only traffic between nodes.

The groups are made once per process for each (group, ``node_size``, device type) and kept: an engine builds a
``MoeAlltoAll`` per MoE layer, and every layer talks over the same groups.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

_GROUPS: dict[tuple, tuple[Any, Any]] = {}


def check_node_size(node_size: Any, ep_size: int) -> None:
    """TypeError or ValueError naming ``node_size`` unless it is an int >= 1 that divides ``ep_size``."""
    if node_size is None:
        raise ValueError("transport='hierarchical' needs node_size: the ranks of one node (contiguous ranks form a "
                         "node, e.g. node_size=8 on HGX hosts of 8 GPUs)")
    if not isinstance(node_size, int) or isinstance(node_size, bool):
        raise TypeError(f"node_size must be an int, got {type(node_size).__name__}")
    if node_size < 1 or ep_size % node_size:
        raise ValueError(f"node_size must be a positive divisor of ep_size={ep_size} (contiguous ranks form a "
                         f"node), got node_size={node_size}")


@dataclasses.dataclass(frozen=True)
class NodeSplit:
    """Where rank ``rank`` of ``ep_size`` ranks sits when ``node_size`` contiguous ranks form a node."""

    ep_size: int
    node_size: int
    rank: int

    @property
    def num_nodes(self) -> int:
        return self.ep_size // self.node_size

    @property
    def node(self) -> int:
        return self.rank // self.node_size

    @property
    def local(self) -> int:
        return self.rank % self.node_size


def node_groups(group: Any, split: NodeSplit, device: torch.device) -> tuple[Any, Any]:
    """``(peer_group, node_group)`` of this rank: the ranks of its local index, one per node (NCCL, or gloo for a
    CPU ``device``), and the ranks of its node (gloo). Collective over ``group`` the first time: every rank creates
    every sub-group, in the same order (node groups by node, then peer groups by local index)."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)  # global ranks, by rank in the group
    peer_backend = "gloo" if device.type == "cpu" else "nccl"
    key = (tuple(ranks), split.node_size, peer_backend)
    if key not in _GROUPS:
        # A group smaller than the world is created by its members only (hashed names): the other ranks of the world
        # may be running anything. The world itself uses the usual counted names, created by every rank.
        local_sync = len(ranks) != dist.get_world_size()
        if local_sync and peer_backend == "nccl" and getattr(dist.group.WORLD, "bound_device_id", None) is not None:
            # torch would split the default group's communicator, which every rank of the world must join.
            raise ValueError("transport='hierarchical' over a group smaller than the world needs a default group "
                             "bound to no device (torch makes NCCL sub-groups of a device-bound one by splitting its "
                             "communicator, with every rank of the world): call init_process_group without device_id, "
                             "or build the layer over the world")
        size, nodes = split.node_size, split.num_nodes
        made = [dist.new_group(ranks[n * size:(n + 1) * size], backend="gloo", use_local_synchronization=local_sync)
                for n in range(nodes)]
        made += [dist.new_group(ranks[i::size], backend=peer_backend, use_local_synchronization=local_sync)
                 for i in range(size)]
        peer, node = made[nodes + split.local], made[split.node]
        if dist.get_rank(peer) != split.node or dist.get_rank(node) != split.local:
            raise ValueError("transport='hierarchical' needs a group whose ranks are in increasing global rank order "
                             f"(torch.distributed.new_group makes such groups), got global ranks {ranks}")
        _GROUPS[key] = (peer, node)
    return _GROUPS[key]
