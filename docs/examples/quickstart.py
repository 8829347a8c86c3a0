# torchrun --nproc-per-node 2 quickstart.py   (one process per GPU; two may share one GPU)
import os

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll

if not torch.cuda.is_available():  # one line, and no error for torchrun to answer with a page of traceback
    if os.environ.get("RANK", "0") == "0":
        print("quickstart.py needs NVIDIA GPUs (Hopper or Blackwell); docs/examples/transports.py runs on CPU")
    raise SystemExit(0)
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("gloo")  # only bootstraps the workspace: the tokens travel over NVLink
rank, ep_size = dist.get_rank(), dist.get_world_size()
hidden, top_k, per_rank = 1024, 2, 4  # 4 experts per rank, rank r owns experts 4r .. 4r+3
a2a = MoeAlltoAll(None, max_num_tokens=128, top_k=top_k, num_experts=per_rank * ep_size, hidden_size=hidden)

x = torch.randn(100 + rank, hidden, device="cuda", dtype=torch.bfloat16)  # token counts may differ per rank
weights, ids = torch.randn(x.shape[0], per_rank * ep_size, device="cuda").softmax(-1).topk(top_k)
(recv_x, recv_ids, recv_w), counts = a2a.dispatch(ids, [x, ids, weights])  # views [ep_size, 128, ...]
mine = (recv_ids >= rank * per_rank) & (recv_ids < (rank + 1) * per_rank)
scale = torch.where(mine, recv_w * (recv_ids + 1), 0.0).sum(-1, keepdim=True)  # expert e multiplies by e + 1
a2a.combine_input().copy_(recv_x * scale)  # the experts' output, written into the workspace (zero copy)
out = a2a.combine()  # [num_tokens, hidden]: each token's expert outputs summed over the ranks it went to

want = x.float() * (weights * (ids + 1)).sum(-1, keepdim=True)
torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
print(f"rank {rank}: received {counts.tolist()} tokens from ranks 0..{ep_size - 1}; combine ok")
a2a.destroy()
dist.destroy_process_group()
