"""Rank bodies for tests/test_nccl_transport.py: MoeAlltoAll(transport="nccl") on spawned gloo ranks (CPU), or on
NCCL ranks (GPU, tests/gpu and tests/multigpu), checked bitwise against flashinfer_a2a.reference.

Every rank draws every rank's inputs from one seed, so each can compute the reference of the whole group and compare
its own share.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import quant, random_payload, random_topk_ids, reference_combine, reference_dispatch

from .comm_workers import COLLECTIVE_TIMEOUT, expect_raises, launch

# 224 = 7 MXFP8 and 14 NVFP4 scale columns (swizzled scales get padding columns) and a short last FP8 block; 10
# experts split unevenly over 4 ranks (3, 3, 2, 2).
HIDDEN, NUM_EXPERTS, TOP_K = 224, 10, 4


def rank_inputs(ep_size: int, max_tokens: int, seed: int, id_dtype: torch.dtype, hidden: int = HIDDEN):
    """Every rank's (topk_ids, payloads), CPU: rank 1 has no tokens, the others different counts; some -1 ids;
    payloads are bf16 hidden states (finite: they may be quantized), int32 ids, fp32 weights and 3 odd bytes."""
    gen = torch.Generator().manual_seed(seed)
    ids, payloads = [], []
    for rank in range(ep_size):
        n = 0 if rank == 1 else max_tokens - (rank % 3)
        ids.append(random_topk_ids(n, TOP_K, NUM_EXPERTS, dtype=id_dtype, generator=gen, minus_one_frac=0.2))
        x = torch.randn(n, hidden, generator=gen).to(torch.bfloat16)
        payloads.append([x, ids[-1].to(torch.int32), torch.rand(n, TOP_K, generator=gen),
                         random_payload(n, (3,), torch.uint8, generator=gen)])
    return ids, payloads


def poison(tensors) -> None:
    for t in tensors:
        t.view(torch.uint8).fill_(0xFF)


def check_recv(rank, recv, counts, ref, runtime_max) -> None:
    assert torch.equal(counts.cpu(), ref.recv_counts[rank]), (counts, ref.recv_counts[rank])
    for p, (got, want) in enumerate(zip(recv, ref.recv_payloads[rank])):
        assert got.shape == want.shape and got.dtype == want.dtype, (p, got.shape, want.shape, got.dtype)
        for src in range(len(counts)):
            c = int(ref.recv_counts[rank][src])
            a = got[src, :c].cpu().contiguous().view(torch.uint8)
            b = want[src, :c].contiguous().view(torch.uint8)
            assert torch.equal(a, b), f"payload {p} from rank {src}: rows differ"


def unswizzled_scales(grid: torch.Tensor, counts: torch.Tensor, runtime_max: int, cols: int) -> torch.Tensor:
    """``[ep_size, runtime_max, cols]`` scale rows of a swizzled receive grid (CPU), after checking the padding
    columns of each source's valid rows (below ``counts[src]``) are 0. Rows past the counts are unspecified (the
    contract, functional.dispatch): the GPU select kernel writes only the rows it receives, so the rest of a grid
    holds whatever its buffer held."""
    padded_cols = -(-cols // 4) * 4
    rows = quant.unswizzle_scales_128x4(grid, -(-runtime_max // 128) * 128, padded_cols)
    for src, c in enumerate(counts.tolist()):
        assert not rows[src, :c, cols:].view(torch.uint8).any(), f"scale padding columns from rank {src} must be 0"
    return rows[:, :runtime_max, :cols]


def run_plain(moe: MoeAlltoAll, rank: int, ep_size: int, device, seed: int, id_dtype, zero_copy: bool) -> None:
    """One dispatch + combine of bf16 payloads, bitwise against the reference."""
    runtime_max = moe.config.max_num_tokens
    ids, payloads = rank_inputs(ep_size, runtime_max, seed, id_dtype)
    ref = reference_dispatch(ids, payloads, NUM_EXPERTS, runtime_max)
    recv, counts = moe.dispatch(ids[rank].to(device), [p.to(device) for p in payloads[rank]], runtime_max)
    check_recv(rank, recv, counts, ref, runtime_max)
    gen = torch.Generator().manual_seed(seed + 1)
    partials = [torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(ep_size)]
    want = reference_combine(partials, ref)[rank]
    out = torch.empty(want.shape, dtype=torch.bfloat16, device=device)
    poison([out])
    if zero_copy:
        moe.combine_input().copy_(partials[rank])
        got = moe.combine(out=out)
    else:
        got = moe.combine(partials[rank].to(device), out=out)
    assert got is out
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), "combine differs from the reference"
    poison(recv)  # the next dispatch must write every valid row again


def run_quantized(moe: MoeAlltoAll, rank: int, ep_size: int, device, seed: int, fmt: str, swizzled: bool) -> None:
    """Quantizing dispatch against the reference quantizers, then the FP8-wire combine against its reference."""
    runtime_max = moe.config.max_num_tokens
    ids, payloads = rank_inputs(ep_size, runtime_max, seed, torch.int64)
    gs = 448.0 * 6.0 / 4.0 if fmt == "nvfp4" else None
    wired = [[*quant.quantize(p[0], fmt, gs), *p[1:]] for p in payloads]
    ref = reference_dispatch(ids, wired, NUM_EXPERTS, runtime_max)
    global_scale = None if gs is None else torch.full((1,), gs, device=device)
    recv, counts = moe.dispatch(ids[rank].to(device), [p.to(device) for p in payloads[rank]], runtime_max,
                                quant_format=fmt, global_scale=global_scale, swizzled_scales=swizzled)
    if swizzled:
        cols = -(-HIDDEN // (quant.MXFP8_BLOCK if fmt == "mxfp8" else quant.NVFP4_BLOCK))
        rows = unswizzled_scales(recv[1].cpu(), ref.recv_counts[rank], runtime_max, cols)
        recv = [recv[0], rows, *recv[2:]]
    check_recv(rank, recv, counts, ref, runtime_max)
    gen = torch.Generator().manual_seed(seed + 1)
    partials = [torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(ep_size)]
    want = quant.reference_combine_fp8(partials, ref)[rank]
    got = moe.combine(partials[rank].to(device), quant_format="fp8_block")
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8)), "FP8 combine differs"


def check_transport(rank: int, ep_size: int, device, exact: bool = False) -> None:
    """Plain and quantized calls, several rounds each (buffers reused and poisoned between them)."""
    moe = MoeAlltoAll(None, max_num_tokens=40, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
                      device=device, transport="nccl", exact=exact)
    assert moe.transport == "nccl"
    for i in range(4):
        run_plain(moe, rank, ep_size, device, 100 + i, (torch.int32, torch.int64)[i % 2], zero_copy=i >= 2)
    for i, (fmt, swizzled) in enumerate([("fp8_block", False), ("mxfp8", False), ("nvfp4", False),
                                         ("mxfp8", True), ("nvfp4", True)]):
        run_quantized(moe, rank, ep_size, device, 200 + i, fmt, swizzled)
    moe.destroy()
    moe.destroy()
    expect_raises(RuntimeError, "destroyed", moe.dispatch, torch.zeros(1, TOP_K, dtype=torch.int32), [])


def check_errors(rank: int, ep_size: int, device) -> None:
    """The NVLink path's errors, raised alike on every rank before any collective (so no rank hangs)."""
    from flashinfer_a2a.transports.nccl import NcclTransport

    moe = MoeAlltoAll(None, max_num_tokens=8, top_k=2, num_experts=4, hidden_size=16, device=device,
                      transport="nccl")
    ids = torch.zeros(4, 2, dtype=torch.int32, device=device)
    x = torch.zeros(4, 16, dtype=torch.bfloat16, device=device)
    expect_raises(RuntimeError, "without a pending dispatch", moe.combine)
    expect_raises(RuntimeError, "without a pending dispatch", moe.combine_input)
    expect_raises(ValueError, "exceeds max_num_tokens=8", moe.dispatch, ids, [x], 9)
    expect_raises(ValueError, "num_tokens <= runtime_max_tokens_per_rank=2", moe.dispatch, ids, [x], 2)
    expect_raises(TypeError, "int32 or int64", moe.dispatch, ids.to(torch.int16), [x])
    expect_raises(ValueError, "payloads[0] must be [num_tokens=4", moe.dispatch, ids, [x[:3]])
    expect_raises(ValueError, "quant_format must be one of", moe.dispatch, ids, [x], quant_format="fp4")
    expect_raises(ValueError, "global_scale is required", moe.dispatch, ids, [x], quant_format="nvfp4")
    expect_raises(ValueError, "bf16|fp16", moe.dispatch, ids, [x.float()], quant_format="mxfp8")
    moe.dispatch(ids, [x], 4)
    expect_raises(RuntimeError, "dispatch called twice", moe.dispatch, ids, [x], 4)
    expect_raises(ValueError, "partials must be [ep_size", moe.combine,
                  torch.zeros(ep_size, 3, 16, dtype=torch.bfloat16, device=device))
    expect_raises(ValueError, "out must be [num_tokens=4, hidden=16]", moe.combine,
                  out=torch.empty(3, 16, dtype=torch.bfloat16, device=device))
    moe.combine()
    # Ids outside [0, num_experts) reach no rank (and no collective hangs); debug mode names them first.
    recv, counts = moe.dispatch(torch.full((4, 2), 7, dtype=torch.int64, device=device), [x], 4)
    assert int(counts.sum()) == 0, counts
    moe.combine()
    debug = NcclTransport(None, num_experts=4, max_num_tokens=8, device=device, debug=True)
    bad = torch.full((2, 2), 4 if rank == 0 else -2, dtype=torch.int64, device=device)
    expect_raises(ValueError, f"expert id {4 if rank == 0 else -2}", debug.dispatch, bad, [x[:2]], 4)
    if ep_size > 1:  # debug mode: a rank whose runtime_max differs makes every rank raise, naming each one's call
        expect_raises(RuntimeError, "ranks disagree", debug.dispatch, ids, [x], 4 + (rank == ep_size - 1))


CHECKS = {
    "padded": check_transport,
    "exact": lambda rank, ep_size, device: check_transport(rank, ep_size, device, exact=True),
    "errors": check_errors,
}


def spawn_gloo(checks: list[str], world_size: int, tmp_path: Path, timeout_s: float = 240.0, *, module: str = __name__,
               collective_timeout=COLLECTIVE_TIMEOUT) -> None:
    """Runs the named checks of ``module``'s ``CHECKS`` (this module's by default) on ``world_size`` spawned gloo
    ranks (CPU tensors); re-raises a rank's error."""
    launch(_gloo_entry, (world_size, str(tmp_path), checks, module, collective_timeout), world_size, str(checks),
           timeout_s)


def _gloo_entry(rank: int, world_size: int, tmp: str, checks: list[str], module: str, collective_timeout) -> None:
    import importlib

    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{tmp}/filestore", rank=rank, world_size=world_size,
                            timeout=collective_timeout)
    for check in checks:
        importlib.import_module(module).CHECKS[check](rank, world_size, "cpu")
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see tests/comm_workers.py: skip interpreter finalization (gloo aborts there now and then)
