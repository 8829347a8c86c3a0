"""CUDA graphs of MoE layers over flashinfer_a2a, captured the way inference engines capture decode steps, launched
by torchrun (two processes may share one GPU):

    torchrun --nproc-per-node 2 docs/examples/cuda_graphs.py

1. Build every MoE layer first. They share one workspace, grown to the largest layer's needs; a layer built after a
   capture could grow it, which moves it away from the graphs already captured.
2. Warm up: one eager step of the whole model per batch size on the default stream. Every kernel is loaded then (a
   kernel loaded while a peer's kernel waits for this rank could wait on it) and torch's allocator has its blocks.
3. Capture one graph per batch size with ``torch.cuda.graph``, on static input tensors. A graph fixes every shape:
   its batch size is the ``runtime_max_tokens_per_rank`` of each of its dispatches, the same on every rank.
4. Replay in any order, the same order on every rank, after refilling the static inputs in place. Eager steps may
   run between replays: here each replay is checked against an eager step on the same inputs, bit for bit.
"""

import os

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll, sanitize_expert_ids

HIDDEN = 1024
TOP_K = 4
EXPERTS_PER_RANK = 8
NUM_LAYERS = 3
BATCH_SIZES = (1, 8, 32)  # the decode batch sizes an engine captures (it pads a batch to the next one)
REPLAY_ORDER = (32, 1, 8, 8, 32, 1, 1, 8)  # any order, the same on every rank


def route(x: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A toy router: the first ``num_experts`` features are the logits. Returns ``(weights, topk_ids)``, each
    ``[num_tokens, TOP_K]``."""
    return x[:, :num_experts].float().softmax(-1).topk(TOP_K, dim=-1)


def toy_experts(recv_x: torch.Tensor, recv_ids: torch.Tensor, recv_w: torch.Tensor, first: int,
                end: int) -> torch.Tensor:
    """Expert e multiplies its input by (e + 1): for every received row, the weighted sum over the row's experts
    this rank owns (``[first, end)``). Rows past the received counts carry -1 ids (sanitized), so they sum to 0."""
    mine = (recv_ids >= first) & (recv_ids < end)
    scale = torch.where(mine, recv_w * (recv_ids + 1).float(), 0.0).sum(-1, keepdim=True)
    return recv_x.float() * scale


class MoELayer:
    def __init__(self, num_experts: int, first: int, end: int) -> None:
        # Collective. Every layer of the default group and namespace shares one workspace.
        self.a2a = MoeAlltoAll(None, max_num_tokens=max(BATCH_SIZES), top_k=TOP_K, num_experts=num_experts,
                               hidden_size=HIDDEN, dtype=torch.bfloat16)
        self.num_experts, self.first, self.end = num_experts, first, end

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, topk_ids = route(x, self.num_experts)
        runtime_max = x.shape[0]  # the graph's batch size: the same on every rank
        (recv_x, recv_ids, recv_w), counts = self.a2a.dispatch(topk_ids, [x, topk_ids, weights], runtime_max)
        sanitize_expert_ids(recv_ids, counts)
        self.a2a.combine_input().copy_(toy_experts(recv_x, recv_ids, recv_w, self.first, self.end))
        return self.a2a.combine()  # [num_tokens, HIDDEN] bf16


def model(layers: list[MoELayer], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


def main() -> None:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    dist.init_process_group("gloo")  # bootstrap only: the tokens travel through symmetric memory
    rank, world = dist.get_rank(), dist.get_world_size()
    num_experts = EXPERTS_PER_RANK * world
    first, end = rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK

    # 1. Every layer, before any capture.
    layers = [MoELayer(num_experts, first, end) for _ in range(NUM_LAYERS)]
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    static_x = {b: torch.empty(b, HIDDEN, dtype=torch.bfloat16, device="cuda") for b in BATCH_SIZES}

    def refill(b: int) -> None:
        static_x[b].copy_(torch.randn(b, HIDDEN, generator=gen, device="cuda"))

    # 2. Eager warm-up on the default stream, every batch size.
    for b in BATCH_SIZES:
        refill(b)
        model(layers, static_x[b])
    torch.cuda.synchronize()

    # 3. One graph per batch size. torch.cuda.graph captures on a stream of its own and synchronizes first.
    graphs, static_out = {}, {}
    for b in BATCH_SIZES:
        graphs[b] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[b]):
            static_out[b] = model(layers, static_x[b])

    # 4. Replays in any order; each checked against an eager step of the same inputs.
    for b in REPLAY_ORDER:
        refill(b)
        graphs[b].replay()
        eager = model(layers, static_x[b])
        assert torch.equal(static_out[b], eager), f"rank {rank}: the graph of batch size {b} differs from eager"
    print(f"rank {rank}: {len(REPLAY_ORDER)} replays of {len(graphs)} graphs equal the eager steps", flush=True)

    del graphs
    for layer in layers:
        layer.a2a.destroy()  # collective
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
