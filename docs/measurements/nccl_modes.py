"""The nccl transport's modes side by side, and its kernels alone: one process per GPU over NCCL, DeepSeek-V3 rows
(hidden 7168 bf16, top-8 of 256 experts, uniform routing; int32 ids and fp32 weights dispatched with them).

    torchrun --nproc-per-node 2 docs/measurements/nccl_modes.py --tokens 1 128 1024 8192

Per tokens/rank and dispatch wire (bf16, nvfp4 fused with the FP8 combine, fp8_block likewise), the median over
``--iters`` of the dispatch + combine pair in us, the slowest rank's per iteration: the padded mode replayed from a
CUDA graph and eagerly, the exact mode (eager only: it synchronises with the host); then the four kernels of the
padded mode alone (nccl_pack, nccl_select, nccl_combine_wire, nccl_combine_sum on this rank's buffers, each the
mean of a graph of 20 launches), which with the collectives make the pair. The bench (python -m flashinfer_a2a.bench
--transport nccl) times the padded mode beside NCCL's own all-to-all.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.library import ops
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS, fp8_wire_row_bytes
from flashinfer_a2a.reference import random_topk_ids

HIDDEN, TOP_K, EXPERTS = 7168, 8, 256
WIRES = {"bf16": (None, None), "nvfp4": ("nvfp4", "fp8_block"), "fp8_block": ("fp8_block", "fp8_block")}


def slowest(times_us: list[float]) -> float:
    """Median over iterations of the slowest rank's time."""
    t = torch.tensor(times_us, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.tolist())


def timed(fn, iters: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def graphed(fn, launches: int = 1) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return graph


def measure(rank: int, ep_size: int, tokens: int, wire: str, iters: int) -> dict:
    dispatch_fmt, combine_fmt = WIRES[wire]
    gen = torch.Generator().manual_seed(rank)
    ids = random_topk_ids(tokens, TOP_K, EXPERTS, generator=gen).cuda()
    x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16().cuda()
    payloads = [x, ids, torch.rand(tokens, TOP_K, generator=gen).cuda()]
    gs = torch.full((1,), 448.0 * 6.0 / float(x.abs().max().clamp_min(1e-6)), device="cuda") \
        if dispatch_fmt == "nvfp4" else None
    partials = torch.randn(ep_size, tokens, HIDDEN, generator=gen).bfloat16().cuda()
    row = {}
    for exact in (False, True):
        moe = MoeAlltoAll(dist.group.WORLD, max_num_tokens=tokens, top_k=TOP_K, num_experts=EXPERTS,
                          hidden_size=HIDDEN, extra_dispatch_bytes_per_token=64, transport="nccl", exact=exact)

        def pair():
            moe.dispatch(ids, payloads, tokens, quant_format=dispatch_fmt, global_scale=gs)
            moe.combine(partials, quant_format=combine_fmt)

        for _ in range(3):
            pair()
        name = "exact" if exact else "padded"
        row[f"{name} eager"] = slowest(timed(pair, iters))
        if not exact:
            graph = graphed(pair)
            row["padded graph"] = slowest(timed(graph.replay, iters))
            row.update(kernels(moe, ids, payloads, dispatch_fmt, gs, partials, combine_fmt, tokens))
            del graph
        moe.destroy()
    return row


def kernels(moe, ids, payloads, fmt_name, gs, partials, combine_fmt, tokens) -> dict:
    """The four kernels of one padded step on this rank's buffers, each alone (us, mean of 20 in a graph)."""
    t = moe._transport
    moe.dispatch(ids, payloads, tokens, quant_format=fmt_name, global_scale=gs)
    pending = t._pending
    send, counts = pending.send, pending.recv_counts
    code = WIRE_FORMATS[fmt_name].code if fmt_name else 0
    gathered = torch.stack([send] * t.ep_size)
    recv_like = t._recv_like(payloads, WIRE_FORMATS.get(fmt_name or ""), HIDDEN, False, tokens)
    recv = [torch.empty(shape, dtype=dtype, device="cuda") for dtype, shape in recv_like]
    fp8 = combine_fmt is not None
    combine_wire = torch.empty(t.ep_size * tokens, fp8_wire_row_bytes(HIDDEN), dtype=torch.uint8, device="cuda")
    returned = torch.empty_like(combine_wire) if fp8 else partials.view(-1, HIDDEN).view(torch.uint8)
    out = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
    steps = {
        "pack": lambda: ops.nccl_pack(send, ids, payloads, t.ep_size, tokens, EXPERTS, code, gs, False),
        "select": lambda: ops.nccl_select(gathered, recv, counts, t.ep_rank, tokens, code, HIDDEN if code else 0,
                                          False),
        "sum": lambda: ops.nccl_combine_sum(out, returned, send, partials, t.ep_rank, fp8),
    }
    if fp8:
        steps["combine_wire"] = lambda: ops.nccl_combine_wire(combine_wire, partials, counts, t.ep_rank)
    result = {}
    for name, fn in steps.items():
        graph = graphed(fn, 20)
        result[f"kernel {name}"] = slowest(timed(graph.replay, 20)) / 20
        del graph
    moe.combine(partials, quant_format=combine_fmt)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 1024, 8192])
    parser.add_argument("--wires", nargs="+", default=list(WIRES), choices=list(WIRES))
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    ops.load()
    for tokens in args.tokens:
        for wire in args.wires:
            row = measure(rank, ep_size, tokens, wire, args.iters)
            if rank == 0:
                cells = "  ".join(f"{k} {v:8.1f}" for k, v in row.items())
                print(f"{ep_size} ranks {torch.cuda.get_device_name()}  tokens {tokens:5d}  {wire:9s}  {cells}",
                      flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
