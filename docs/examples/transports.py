"""MoeAlltoAll over a chosen transport, then NcclTransport on its own, launched by torchrun:

    torchrun --nproc-per-node 2 docs/examples/transports.py

With GPUs each process takes the GPU of its LOCAL_RANK and the group runs NCCL (one process per GPU: NCCL refuses two
ranks on one GPU). Without a GPU the group runs gloo on the CPU, where "auto" picks the nccl transport: that is how
the test suite runs this file. (On CPU, torch 2.13's gloo backend now and then aborts a process at exit, after the
program has finished: "terminate called without an active exception", pytorch/pytorch#190489.)
"""

from flashinfer_a2a.reference import token_rank_mask

# begin choose-transport
import os

import torch
import torch.distributed as dist
from flashinfer_a2a import MoeAlltoAll

if torch.cuda.is_available():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=device)
else:  # CPU: gloo, and the nccl transport over it
    device = torch.device("cpu")
    dist.init_process_group("gloo")
rank, ep_size = dist.get_rank(), dist.get_world_size()

a2a = MoeAlltoAll(dist.group.WORLD, max_num_tokens=256, top_k=8, num_experts=256, hidden_size=7168,
                  device=device, transport="auto")  # "nvlink", "nccl" or "auto" (the default)
hidden_states = torch.randn(200 + rank, 7168, device=device).to(torch.bfloat16)
topk_weights, topk_ids = torch.randn(200 + rank, 256, device=device).softmax(-1).topk(8)
(recv_x, recv_ids, recv_w), recv_counts = a2a.dispatch(topk_ids, [hidden_states, topk_ids, topk_weights])
a2a.combine_input()[...] = recv_x  # identity experts' outputs (or a2a.combine(partials))
out = a2a.combine()                # hidden_states[t] times the number of ranks t went to
# end choose-transport

# Exact: a bf16 value times a small count, summed in fp32, is representable again.
went_to = token_rank_mask(topk_ids, 256, ep_size).sum(-1, keepdim=True)
assert torch.equal(out, (hidden_states.float() * went_to).to(torch.bfloat16)), "MoeAlltoAll combine differs"
print(f"rank {rank}: MoeAlltoAll over the {a2a.transport} transport ok", flush=True)
a2a.destroy()

group = dist.group.WORLD
x, topk_ids = hidden_states[:100], topk_ids[:100]
# begin nccl-transport
from flashinfer_a2a.transports.nccl import NcclTransport

t = NcclTransport(group, num_experts=256, max_num_tokens=128, device=device)   # exact=False: padded mode
(recv_x, recv_ids), recv_counts = t.dispatch(topk_ids, [x, topk_ids], runtime_max=128)
partials = recv_x   # identity experts: [ep_size, 128, hidden] (or None after writing t.combine_input(hidden, dtype))
out = t.combine(partials, hidden=x.shape[1], dtype=x.dtype)   # x[t] times the number of ranks t went to
# end nccl-transport

went_to = went_to[:100]
assert torch.equal(out, (x.float() * went_to).to(x.dtype)), "NcclTransport combine differs"
print(f"rank {rank}: NcclTransport ok, received {recv_counts.tolist()} tokens", flush=True)
t.destroy()

topk_weights = topk_weights[:100]


def experts(recv_x, recv_w, counts):  # identity experts
    return recv_x


# begin compile
a2a = MoeAlltoAll(group, max_num_tokens=256, top_k=8, num_experts=256, hidden_size=7168, device=device,
                  transport="nccl")


@torch.compile(fullgraph=True)
def moe_step(topk_ids, x, topk_weights):
    (recv_x, recv_w), counts = a2a.dispatch(topk_ids, [x, topk_weights])
    a2a.combine_input().copy_(experts(recv_x, recv_w, counts))  # or: return a2a.combine(partials)
    return a2a.combine()
# end compile


out = moe_step(topk_ids, x, topk_weights)
assert torch.equal(out, (x.float() * went_to).to(x.dtype)), "compiled MoeAlltoAll step differs"
print(f"rank {rank}: compiled step over the nccl transport ok", flush=True)
a2a.destroy()
dist.destroy_process_group()
