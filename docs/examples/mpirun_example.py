"""A minimal MoE layer over flashinfer_a2a, launched by mpirun (mpi4py bootstraps the workspace):

    mpirun -n 2 python docs/examples/mpirun_example.py

No torch.distributed at all: MoeAlltoAll takes the mpi4py communicator directly.
"""

import torch
from mpi4py import MPI

from flashinfer_a2a import MoeAlltoAll, sanitize_expert_ids

HIDDEN = 1024
TOP_K = 4
EXPERTS_PER_RANK = 8
MAX_TOKENS = 256  # most tokens any rank dispatches in one call


def toy_experts(recv_x, recv_ids, recv_w, counts, first, end):
    """Expert e multiplies its input by (e + 1). Each rank returns, for every token it received, the
    weighted sum over the token's experts that this rank owns: [ep_size, runtime_max, hidden]."""
    sanitize_expert_ids(recv_ids, counts)  # rows past recv_counts[src] get -1: the padded shape is safe to use
    mine = (recv_ids >= first) & (recv_ids < end)
    scale = torch.where(mine, recv_w * (recv_ids + 1).float(), 0.0).sum(-1, keepdim=True)
    return recv_x.float() * scale


def main():
    comm = MPI.COMM_WORLD
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()  # rank within this host, any MPI
    torch.cuda.set_device(local_rank % torch.cuda.device_count())  # two ranks may share a GPU
    rank, world = comm.Get_rank(), comm.Get_size()
    num_experts = EXPERTS_PER_RANK * world
    first, end = rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK  # contiguous partition

    # Collective: every rank of the communicator builds it with the same sizes.
    a2a = MoeAlltoAll(comm, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=num_experts,
                      hidden_size=HIDDEN, dtype=torch.bfloat16)
    if rank == 0:
        print(a2a.workspace_breakdown())

    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    for step in range(3):
        num_tokens = int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen, device="cuda"))  # differs per rank
        x = torch.randn(num_tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        logits = torch.randn(num_tokens, num_experts, generator=gen, device="cuda")
        weights, topk_ids = logits.softmax(-1).topk(TOP_K, dim=-1)  # random router: distinct experts per token

        # Dispatch hidden states, ids and weights; receive [ep_size, MAX_TOKENS, ...] views of the workspace.
        (recv_x, recv_ids, recv_w), counts = a2a.dispatch(topk_ids, [x, topk_ids, weights])

        # The experts write their outputs straight into the combine region (zero copy) ...
        a2a.combine_input().copy_(toy_experts(recv_x, recv_ids, recv_w, counts, first, end))
        # ... and combine sums each token's partials over the ranks it went to: [num_tokens, HIDDEN].
        out = a2a.combine()

        want = x.float() * (weights * (topk_ids + 1).float()).sum(-1, keepdim=True)
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
        print(f"rank {rank} step {step}: {num_tokens} tokens ok", flush=True)

    a2a.destroy()  # collective: a barrier, then the workspace is unmapped and freed


if __name__ == "__main__":
    main()
