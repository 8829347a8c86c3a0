"""Two expert-parallel groups in one job, launched by torchrun (processes may share a GPU):

    torchrun --nproc-per-node 4 docs/examples/ep_subgroups.py

Ranks {0, 1} and {2, 3} each run their own MoeAlltoAll; a step of identity experts comes back bit for bit, then each
rank reads its device error record.
"""

import os

import torch

from flashinfer_a2a.reference import token_rank_mask

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
# begin sub-groups
import torch.distributed as dist
from flashinfer_a2a import MoeAlltoAll

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
EP = 2  # ranks per EP group: 4 ranks -> EP groups {0, 1} and {2, 3}

# new_group is collective over the whole job: every rank creates every group, in the same order,
# then keeps its own.
groups = [dist.new_group(list(range(start, start + EP))) for start in range(0, world, EP)]
ep_group = groups[rank // EP]

a2a = MoeAlltoAll(ep_group, max_num_tokens=4096, top_k=8, num_experts=256, hidden_size=7168)
assert a2a.ep_size == EP and a2a.ep_rank == rank % EP
# end sub-groups

# One step within the group: identity experts return each token once per rank of the group it went to, summed in
# fp32 (exact for a bf16 value times 1 or 2).
x = torch.randn(64 + 7 * rank, 7168, device="cuda").to(torch.bfloat16)
weights, ids = torch.randn(x.shape[0], 256, device="cuda").softmax(-1).topk(8)
(recv_x, recv_ids, recv_w), counts = a2a.dispatch(ids, [x, ids, weights])
out = a2a.combine(recv_x)
want = (x.float() * token_rank_mask(ids, 256, EP).sum(-1, keepdim=True)).to(torch.bfloat16)
assert torch.equal(out, want), f"rank {rank}: combine within the EP group differs"

# begin check-error
import flashinfer_a2a as fa

try:
    fa.check_error(a2a.workspace, a2a.ep_rank)
except fa.A2AError as exc:
    # exc.peer: the rank waited for; exc.phase: "dispatch" or "combine"; exc.epoch: which call
    print(f"rank {a2a.ep_rank}: {exc}")
    raise
# end check-error

print(f"rank {rank}: EP group {rank // EP} rank {a2a.ep_rank}, received {counts.tolist()}; sub-group ok", flush=True)
a2a.destroy()
dist.destroy_process_group()
