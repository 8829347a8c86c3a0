"""One rank of the hierarchical-transport checks on GPUs, 4 ranks as 2 nodes of 2:

    torchrun --nproc-per-node 4 -m tests.multigpu.hierarchical_worker

``FLASHINFER_A2A_TEST_RANKS_PER_GPU`` (1 or 2) puts 1 rank on each of 4 GPUs, or ranks 0, 1 on GPU 0 and 2, 3 on
GPU 1: each node then shares one GPU (its symmetric memory still works) and the NCCL peer groups {0, 2} and
{1, 3} span the two GPUs. The world group is gloo either way (NCCL refuses two ranks on one GPU). Prints ``CHECK
<name> rank <r> ok`` per passed check; a failure raises.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import quant, reference_combine, reference_dispatch

from ..nccl_workers import HIDDEN, NUM_EXPERTS, TOP_K, check_recv, rank_inputs, run_plain, run_quantized
from .common import shared_seed

NODE_SIZE, MAX_TOKENS = 2, 40
RANKS_PER_GPU = int(os.environ.get("FLASHINFER_A2A_TEST_RANKS_PER_GPU", "1"))


def _layer(transport: str, **kw) -> MoeAlltoAll:
    return MoeAlltoAll(None, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
                       extra_dispatch_bytes_per_token=128, transport=transport, **kw)


def check_reference(rank: int, ep_size: int, seed: int) -> None:
    """Eager rounds against the reference: bf16 (int32 and int64 ids, rank 1 idle, zero-copy or not), each quantized
    format (swizzled scales too) with the FP8-wire combine."""
    moe = _layer("hierarchical", node_size=NODE_SIZE)
    for i in range(4):
        run_plain(moe, rank, ep_size, "cuda", seed + i, (torch.int32, torch.int64)[i % 2], zero_copy=i >= 2)
    for i, (fmt, swizzled) in enumerate([("fp8_block", False), ("mxfp8", True), ("nvfp4", False), ("nvfp4", True)]):
        run_quantized(moe, rank, ep_size, "cuda", seed + 10 + i, fmt, swizzled)
    moe.destroy()


def check_flat_equal(rank: int, ep_size: int, seed: int) -> None:
    """The same calls on the flat nvlink transport and the hierarchical one: the same counts, valid receive rows and
    combine bytes, for bf16 and each quantized dispatch (the FP8-wire combine with it)."""
    layers = {"nvlink": _layer("nvlink"), "hierarchical": _layer("hierarchical", node_size=NODE_SIZE)}
    for i, fmt in enumerate([None, "fp8_block", "mxfp8", "nvfp4"]):
        runtime_max = MAX_TOKENS - 7 * (i % 2)
        ids, payloads = rank_inputs(ep_size, runtime_max, seed + i, torch.int64)
        gs = torch.full((1,), 3.0, device="cuda") if fmt == "nvfp4" else None
        gen = torch.Generator().manual_seed(seed + i)
        partials = torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).bfloat16().cuda()
        results = {}
        for name, moe in layers.items():
            recv, counts = moe.dispatch(ids[rank].cuda(), [p.cuda() for p in payloads[rank]], runtime_max,
                                        quant_format=fmt, global_scale=gs)
            counts = counts.cpu().clone()
            rows = [r[src, : int(counts[src])].cpu().contiguous().view(torch.uint8) for r in recv
                    for src in range(ep_size)]
            out = moe.combine(partials, quant_format="fp8_block" if fmt else None)
            results[name] = (counts, rows, out.cpu())
        (c1, rows1, out1), (c2, rows2, out2) = results.values()
        assert torch.equal(c1, c2), (fmt, c1, c2)
        assert all(torch.equal(a, b) for a, b in zip(rows1, rows2)), f"{fmt}: receive rows differ from nvlink"
        assert torch.equal(out1.view(torch.uint8), out2.view(torch.uint8)), f"{fmt}: combine differs from nvlink"
    for moe in layers.values():
        moe.destroy()


def check_graph(rank: int, ep_size: int, seed: int) -> None:
    """Dispatch and combine captured in one CUDA graph (bf16, then NVFP4 with the FP8-wire combine), replayed with
    fresh ids, payloads and partials: every replay's counts, rows and output bitwise against the reference."""
    for fmt in (None, "nvfp4"):
        moe = _layer("hierarchical", node_size=NODE_SIZE)
        num_tokens = 0 if rank == 1 else MAX_TOKENS - rank
        ids = torch.zeros(num_tokens, TOP_K, dtype=torch.int64, device="cuda")
        x = torch.zeros(num_tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        weights = torch.zeros(num_tokens, TOP_K, device="cuda")
        partials = torch.zeros(ep_size, MAX_TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(num_tokens, HIDDEN, dtype=torch.bfloat16, device="cuda")
        gs = torch.full((1,), 3.0, device="cuda") if fmt else None
        wire = "fp8_block" if fmt else None

        def step():
            recv, counts = moe.dispatch(ids, [x, weights], MAX_TOKENS, quant_format=fmt, global_scale=gs)
            moe.combine_input().copy_(partials)
            moe.combine(out=out, quant_format=wire)
            return recv, counts

        def fill(i):
            all_ids, all_payloads = rank_inputs(ep_size, MAX_TOKENS, seed + 100 * i, torch.int64)
            mine = all_ids[rank][:num_tokens]
            ids.copy_(mine)
            x.copy_(all_payloads[rank][0][:num_tokens])
            weights.copy_(all_payloads[rank][2][:num_tokens])
            gen = torch.Generator().manual_seed(seed + 100 * i + 1)
            every = [torch.randn(ep_size, MAX_TOKENS, HIDDEN, generator=gen).bfloat16() for _ in range(ep_size)]
            partials.copy_(every[rank])
            return every

        fill(0)
        step()  # eager warm-up: buffers, communicators, the node workspace's calls
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            recv, counts = step()
        for i in range(1, 6):
            every = fill(i)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            _check_replay(rank, ep_size, seed + 100 * i, fmt, gs, recv, counts, every, out)
        del graph
        moe.destroy()


def _check_replay(rank, ep_size, seed, fmt, gs, recv, counts, partials, out) -> None:
    all_ids, all_payloads = rank_inputs(ep_size, MAX_TOKENS, seed, torch.int64)
    tokens = [0 if r == 1 else MAX_TOKENS - r for r in range(ep_size)]
    ids = [i[:n] for i, n in zip(all_ids, tokens)]
    payloads = [[p[0][:n], p[2][:n]] for p, n in zip(all_payloads, tokens)]
    if fmt is not None:
        payloads = [[*quant.quantize(x, fmt, float(gs)), w] for x, w in payloads]
    ref = reference_dispatch(ids, payloads, NUM_EXPERTS, MAX_TOKENS)
    check_recv(rank, recv, counts, ref, MAX_TOKENS)
    want = (quant.reference_combine_fp8(partials, ref) if fmt else reference_combine(partials, ref))[rank]
    assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8)), f"{fmt}: replayed combine differs"


def main() -> None:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local // RANKS_PER_GPU)
    dist.init_process_group("gloo")
    from flashinfer_a2a.comm import as_communicator

    comm = as_communicator(None)
    rank, ep_size = dist.get_rank(), dist.get_world_size()
    assert ep_size == 4, f"run 4 ranks (2 nodes of {NODE_SIZE}), got {ep_size}"
    seed = shared_seed(comm)
    for name, check in (("reference", check_reference), ("flat_equal", check_flat_equal), ("graph", check_graph)):
        check(rank, ep_size, seed)
        torch.cuda.synchronize()
        print(f"CHECK {name} rank {rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
