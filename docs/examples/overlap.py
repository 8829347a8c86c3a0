"""Two micro-batches overlapped with split-phase calls, launched by torchrun (processes may share a GPU):

    torchrun --nproc-per-node 2 docs/examples/overlap.py

Each micro-batch has a MoeAlltoAll (a workspace) of its own. The send halves queue their transfers on a
communication stream the package owns (``comm_stream=True``), the receive halves make the current stream wait for
them, and each micro-batch's experts run while the other's rows move. The result equals, bit for bit, running the
two micro-batches one after the other with whole calls.
"""

import os

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group("gloo")
rank, ep_size = dist.get_rank(), dist.get_world_size()
hidden, top_k, per_rank = 1024, 4, 4
num_experts = per_rank * ep_size
gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
x = [torch.randn(50 + 7 * i + rank, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) for i in range(2)]
weights, ids = zip(*(torch.rand(t.shape[0], num_experts, device="cuda", generator=gen).softmax(-1).topk(top_k)
                     for t in x))


def experts(recv_x, recv_ids, recv_w, counts, out):
    """This rank's experts: expert e multiplies its input by e + 1; the weighted sum lands in ``out``."""
    mine = (recv_ids >= rank * per_rank) & (recv_ids < (rank + 1) * per_rank)
    scale = torch.where(mine, recv_w * (recv_ids + 1), 0.0).sum(-1, keepdim=True)
    out.copy_(recv_x * scale)


# begin overlap
# One workspace per micro-batch: layers of one namespace share theirs, so each micro-batch gets a namespace. The
# transfers run on the package's communication stream, on at most 16 multiprocessors.
a2a = [MoeAlltoAll(None, max_num_tokens=256, top_k=top_k, num_experts=num_experts, hidden_size=hidden,
                   namespace=f"micro-batch {i}", comm_stream=True, num_sms=16) for i in range(2)]

a2a[0].dispatch_send(ids[0], [x[0], ids[0], weights[0]])  # queued on the communication stream; returns at once
a2a[1].dispatch_send(ids[1], [x[1], ids[1], weights[1]])
(recv_x, recv_ids, recv_w), counts = a2a[0].dispatch_recv()  # the current stream waits for micro-batch 0's rows
experts(recv_x, recv_ids, recv_w, counts, out=a2a[0].combine_input())  # micro-batch 1's tokens travel meanwhile
a2a[0].combine_send()  # both combine kernels queued on the communication stream; they write the output
(recv_x, recv_ids, recv_w), counts = a2a[1].dispatch_recv()
experts(recv_x, recv_ids, recv_w, counts, out=a2a[1].combine_input())  # micro-batch 0's partials travel meanwhile
a2a[1].combine_send()
y0 = a2a[0].combine_recv()
y1 = a2a[1].combine_recv()
# end overlap

for i, y in enumerate((y0, y1)):  # the same micro-batch with whole calls, one after the other
    (recv_x, recv_ids, recv_w), counts = a2a[i].dispatch(ids[i], [x[i], ids[i], weights[i]])
    experts(recv_x, recv_ids, recv_w, counts, out=a2a[i].combine_input())
    assert torch.equal(a2a[i].combine().view(torch.int16), y.view(torch.int16)), f"micro-batch {i} differs"
print(f"rank {rank}: two micro-batches overlapped, {y0.shape[0]} + {y1.shape[0]} tokens, bitwise ok")
for a in a2a:
    a.destroy()
dist.destroy_process_group()
