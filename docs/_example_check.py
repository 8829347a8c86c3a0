import torch

import flashinfer_a2a
from flashinfer_a2a import WorkspaceConfig
from flashinfer_a2a.reference import bitwise_equal, rank_expert_range, reference_combine
from flashinfer_a2a.simulate import SimulatedRanks

ep_size, num_experts, top_k, hidden, max_tokens = 4, 16, 2, 1024, 128
dtype = torch.bfloat16
config = WorkspaceConfig(
    ep_size=ep_size,
    max_num_tokens=max_tokens,
    # every payload of one dispatch: activations + top-k ids (int32) + top-k weights (fp32)
    dispatch_bytes_per_token=hidden * dtype.itemsize + top_k * 4 + top_k * 4,
    combine_bytes_per_token=hidden * dtype.itemsize,
    top_k=top_k,
)
ranks = SimulatedRanks(config, "cuda")  # one workspace, initialized on every rank

num_tokens = [100, 0, 37, 128]  # per rank; a rank may have none
runtime_max = max(num_tokens)   # the same value on every rank
topk_ids = [torch.randint(0, num_experts, (n, top_k), dtype=torch.int32, device="cuda") for n in num_tokens]
weights = [torch.rand(n, top_k, device="cuda") for n in num_tokens]
x = [torch.randn(n, hidden, dtype=dtype, device="cuda") for n in num_tokens]

# Dispatch: per rank, ([recv_x, recv_ids, recv_weights], recv_counts); each recv tensor is
# [ep_size, runtime_max, ...], a zero-copy view of that rank's workspace.
received = ranks.dispatch(topk_ids, [[x[r], topk_ids[r], weights[r]] for r in range(ep_size)],
                          runtime_max, num_experts)

# Expert side: a toy expert e scales its input by (e + 1). Each rank writes its weighted partials straight
# into its combine input (zero copy).
for r, ((rx, rids, rw), counts) in enumerate(received):
    flashinfer_a2a.sanitize_expert_ids(rids, counts)  # rows past counts[src] now hold -1
    first, end = rank_expert_range(r, num_experts, ep_size)
    mine = (rids >= first) & (rids < end)
    scale = torch.where(mine, rw * (rids + 1), 0.0).sum(-1, keepdim=True)  # [ep_size, runtime_max, 1]
    ranks.combine_input(r, runtime_max, hidden, dtype).copy_((rx.float() * scale).to(dtype))

# Combine: out[r] is [num_tokens[r], hidden], summed over ranks in increasing order, in fp32.
out = ranks.combine([counts for _, counts in received], num_tokens, runtime_max, hidden=hidden, dtype=dtype)

# Bitwise equal to the pure-torch reference of the contract.
partials = [ranks.combine_input(r, runtime_max, hidden, dtype) for r in range(ep_size)]
expected = reference_combine(partials, topk_ids, num_experts)
assert all(bitwise_equal(o, e) for o, e in zip(out, expected))
