"""One rank of the nccl-transport checks on several GPUs: ``torchrun --nproc-per-node 2 -m
tests.multigpu.nccl_worker [check ...]`` (every check by default). Prints ``CHECK <name> rank <r> ok`` per passed
check; a failure raises."""

from __future__ import annotations

import os
import sys
from unittest import mock

import torch
import torch.distributed as dist

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.transports import nccl as nccl_transport

from ..nccl_compile_workers import _unswizzle, check_compiled
from ..nccl_workers import HIDDEN, NUM_EXPERTS, TOP_K, check_errors, check_transport, poison, rank_inputs
from .randomized import check_nccl_gpus

# (quant_format, swizzled_scales) of the graph comparison: plain, then each format (fused dispatch, FP8 combine).
GRAPH_FORMATS = [(None, False), ("fp8_block", False), ("mxfp8", True), ("nvfp4", False), ("nvfp4", True)]


def compare_transports(rank: int, ep_size: int, group) -> None:
    """nccl and nvlink, the same calls on every rank: the same counts, valid receive rows and combine bytes."""
    runtime_max = 40
    kw = dict(max_num_tokens=runtime_max, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
              extra_dispatch_bytes_per_token=128, device=rank)
    for seed, fmt in enumerate([None, "fp8_block", "mxfp8", "nvfp4"]):
        results = {}
        for transport in ("nvlink", "nccl"):
            moe = MoeAlltoAll(group, transport=transport, **kw)
            ids, payloads = rank_inputs(ep_size, runtime_max, 50 + seed, torch.int64)
            gs = torch.full((1,), 3.0, device="cuda") if fmt == "nvfp4" else None
            recv, counts = moe.dispatch(ids[rank].cuda(), [p.cuda() for p in payloads[rank]], runtime_max,
                                        quant_format=fmt, global_scale=gs)
            got_counts = counts.cpu().clone()
            rows = [r[src, : int(got_counts[src])].cpu().contiguous().view(torch.uint8)
                    for r in recv for src in range(ep_size)]
            gen = torch.Generator().manual_seed(seed)
            partials = [torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).bfloat16() for _ in range(ep_size)]
            out = moe.combine(partials[rank].cuda(), quant_format="fp8_block" if fmt else None)
            results[transport] = (got_counts, rows, out.cpu())
            moe.destroy()
        (c1, rows1, out1), (c2, rows2, out2) = results["nvlink"], results["nccl"]
        assert torch.equal(c1, c2), (fmt, c1, c2)
        assert all(torch.equal(a, b) for a, b in zip(rows1, rows2)), f"{fmt}: receive rows differ"
        assert torch.equal(out1.view(torch.uint8), out2.view(torch.uint8)), f"{fmt}: combine differs"


def graphed_rounds(moe: MoeAlltoAll, rank: int, ep_size: int, fmt, swizzled: bool, seeds) -> list:
    """Dispatch + combine captured in one CUDA graph, replayed once per seed on fresh inputs copied in: per replay
    (counts, valid receive rows, combine output) on the CPU."""
    runtime_max = moe.config.max_num_tokens
    ids, payloads = rank_inputs(ep_size, runtime_max, seeds[0], torch.int64)
    static_ids, static = ids[rank].cuda(), [p.cuda() for p in payloads[rank]]
    static_partials = torch.zeros(ep_size, runtime_max, HIDDEN, dtype=torch.bfloat16, device="cuda")
    gs = torch.full((1,), 3.0, device="cuda") if fmt == "nvfp4" else None

    def step():
        recv_, counts_ = moe.dispatch(static_ids, static, runtime_max, quant_format=fmt, global_scale=gs,
                                      swizzled_scales=swizzled)
        return recv_, counts_, moe.combine(static_partials, quant_format="fp8_block" if fmt else None)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # eager first: buffers, communicators and kernels exist before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        recv, counts, out = step()
    rounds = []
    for seed in seeds:
        ids, payloads = rank_inputs(ep_size, runtime_max, seed, torch.int64)
        static_ids.copy_(ids[rank])
        for dst, src in zip(static, payloads[rank]):
            dst.copy_(src)
        gen = torch.Generator().manual_seed(seed)
        static_partials.copy_(torch.randn(ep_size, ep_size, runtime_max, HIDDEN, generator=gen)[rank].bfloat16())
        poison([*recv, counts, out])
        torch.cuda.synchronize()
        dist.barrier()  # every rank poisoned before any replays
        graph.replay()
        torch.cuda.synchronize()
        got = [r.cpu() for r in recv]
        if swizzled:
            got = _unswizzle(got, fmt, runtime_max)
        c = counts.cpu().clone()
        rows = [g[src, : int(c[src])].contiguous().view(torch.uint8) for g in got for src in range(ep_size)]
        rounds.append((c, rows, out.cpu().clone()))
    del graph
    return rounds


def compare_graphs(rank: int, ep_size: int, group) -> None:
    """nccl and nvlink, each captured in a CUDA graph and replayed on the same fresh inputs: the same counts, valid
    receive rows (quantized by the fused dispatch) and combine bytes (over the FP8 wire too)."""
    kw = dict(max_num_tokens=40, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
              extra_dispatch_bytes_per_token=256, device=rank)
    for fmt, swizzled in GRAPH_FORMATS:
        results = {}
        for transport in ("nvlink", "nccl"):
            moe = MoeAlltoAll(group, transport=transport, **kw)
            results[transport] = graphed_rounds(moe, rank, ep_size, fmt, swizzled, (70, 71, 72))
            moe.destroy()
        for replay, ((c1, rows1, out1), (c2, rows2, out2)) in enumerate(zip(results["nvlink"], results["nccl"])):
            where = f"{fmt} swizzled={swizzled} replay {replay}"
            assert torch.equal(c1, c2), (where, c1, c2)
            assert all(torch.equal(a, b) for a, b in zip(rows1, rows2)), f"{where}: receive rows differ"
            assert torch.equal(out1.view(torch.uint8), out2.view(torch.uint8)), f"{where}: combine differs"


def compare_with_peer_exchange(rank: int, ep_size: int, group) -> None:
    """The transports compared, eagerly and replayed from graphs, with the nccl transport gathering and exchanging
    its blocks with the peers at every runtime_max (as from PEER_EXCHANGE_MIN_TOKENS on)."""
    with mock.patch.object(nccl_transport, "PEER_EXCHANGE_MIN_TOKENS", 0):
        check_exchange_memory(rank, ep_size, group)
        compare_transports(rank, ep_size, group)
        compare_graphs(rank, ep_size, group)


def check_exchange_memory(rank: int, ep_size: int, group) -> None:
    """The peer exchange's own buffers (the gathered blocks, the FP8 combine wire and the rows it returns) lie in
    NCCL's allocator's pool; the plain combine's returned rows, sent from the caller's partials, do not."""
    runtime_max = 24
    moe = MoeAlltoAll(group, transport="nccl", max_num_tokens=runtime_max, top_k=TOP_K, num_experts=NUM_EXPERTS,
                      hidden_size=HIDDEN, extra_dispatch_bytes_per_token=128, device=rank)
    ids, payloads = rank_inputs(ep_size, runtime_max, 90, torch.int64)
    partials = torch.randn(ep_size, runtime_max, HIDDEN, device="cuda").bfloat16()
    for fmt in ("fp8_block", None):
        moe.dispatch(ids[rank].cuda(), [p.cuda() for p in payloads[rank]], runtime_max, quant_format=fmt)
        moe.combine(partials, quant_format=fmt)
    transport = moe._transport
    assert transport._nccl_pool is not None, "no pool on NCCL's allocator"
    snapshot = transport._nccl_pool.snapshot()
    snapshot = snapshot["segments"] if isinstance(snapshot, dict) else snapshot
    segments = [(s["address"], s["address"] + s["total_size"]) for s in snapshot]

    def in_pool(t: torch.Tensor) -> bool:
        return any(lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= hi for lo, hi in segments)

    kept = {(name, t.shape[-1]): in_pool(t) for (name, _, _, _), t in transport._buffers.items()}
    wire_row = nccl_transport.fp8_wire_row_bytes(HIDDEN)
    for name, row in [("combine wire", wire_row), ("returned", wire_row)]:
        assert kept[(name, row)], f"{name} is not in NCCL's pool"
    assert all(v for (name, _), v in kept.items() if name == "gathered"), "gathered is not in NCCL's pool"
    assert not kept[("returned", HIDDEN * 2)], "the plain rows returned are in NCCL's pool"
    moe.destroy()


def main(names: list[str]) -> None:
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    ep_size = dist.get_world_size()
    checks = {
        "padded": lambda: check_transport(rank, ep_size, "cuda"),
        "exact": lambda: check_transport(rank, ep_size, "cuda", exact=True),
        "errors": lambda: check_errors(rank, ep_size, "cuda"),
        "nvlink_equal": lambda: compare_transports(rank, ep_size, dist.group.WORLD),
        "graph_equal": lambda: compare_graphs(rank, ep_size, dist.group.WORLD),
        "peer_exchange": lambda: compare_with_peer_exchange(rank, ep_size, dist.group.WORLD),
        # The padded mode traced whole over NCCL's functional collectives; the kernels are ops, so inductor
        # compiles no quantizer: every case under both backends.
        "compiled": lambda: [check_compiled(rank, ep_size, "cuda", backend) for backend in ("aot_eager", "inductor")],
        "randomized": lambda: check_nccl_gpus(dist.group.WORLD),
    }
    for name in names or list(checks):
        checks[name]()
        torch.cuda.synchronize()
        print(f"CHECK {name} rank {rank} ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
