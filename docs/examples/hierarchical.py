"""MoeAlltoAll over the two-level transport, 4 ranks as 2 nodes of 2, launched by torchrun:

    torchrun --nproc-per-node 4 docs/examples/hierarchical.py

With GPUs each process takes the GPU of its LOCAL_RANK and the world group runs NCCL; the transport makes its own
sub-groups (NCCL between the nodes, gloo to set up each node's symmetric memory). Without a GPU every group runs
gloo on the CPU, and each node's stage is the nccl transport over gloo: that is how the test suite runs this file.
"""

# begin hierarchical
import os

import torch
import torch.distributed as dist
from flashinfer_a2a import MoeAlltoAll

if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=device)
else:  # CPU: gloo for both stages
    device = torch.device("cpu")
    dist.init_process_group("gloo")
rank = dist.get_rank()

# Contiguous ranks form a node: node_size=2 makes ranks 0, 1 one node and 2, 3 the other (node_size=8 on HGX hosts).
a2a = MoeAlltoAll(dist.group.WORLD, max_num_tokens=128, top_k=8, num_experts=64, hidden_size=1024, device=device,
                  transport="hierarchical", node_size=2)
hidden_states = torch.randn(100 + rank, 1024, device=device).to(torch.bfloat16)
topk_weights, topk_ids = torch.randn(100 + rank, 64, device=device).softmax(-1).topk(8)
(recv_x, recv_ids, recv_w), recv_counts = a2a.dispatch(topk_ids, [hidden_states, topk_ids, topk_weights])
a2a.combine_input()[...] = recv_x  # identity experts' outputs (or a2a.combine(partials))
out = a2a.combine()                # hidden_states[t] times the number of ranks t went to
# end hierarchical

# The flat nccl transport on the same inputs: the same receive counts and, bit for bit, the same output.
flat = MoeAlltoAll(dist.group.WORLD, max_num_tokens=128, top_k=8, num_experts=64, hidden_size=1024, device=device,
                   transport="nccl")
(flat_x, _, _), flat_counts = flat.dispatch(topk_ids, [hidden_states, topk_ids, topk_weights])
flat.combine_input()[...] = flat_x
assert torch.equal(flat_counts, recv_counts) and torch.equal(flat.combine(), out), "differs from the flat transport"
print(f"rank {rank}: MoeAlltoAll over the {a2a.transport} transport ok, received {recv_counts.tolist()}", flush=True)
for layer in (a2a, flat):
    layer.destroy()
dist.destroy_process_group()
