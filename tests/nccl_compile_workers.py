"""Rank bodies for tests/test_nccl_compile.py (spawned gloo ranks, CPU) and tests/gpu/test_nccl_transport.py (one
NCCL rank): MoeAlltoAll(transport="nccl") steps run eagerly and under torch.compile(fullgraph=True), each result
checked bitwise against the other and against flashinfer_a2a.reference.

Every rank draws every rank's inputs from one seed (tests/nccl_workers.rank_inputs), so each computes the reference
of the whole group and compares its own share.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import quant, reference_combine, reference_dispatch

from . import nccl_workers
from .comm_workers import expect_raises
from .nccl_workers import HIDDEN, NUM_EXPERTS, TOP_K, check_recv, poison, rank_inputs

# A rank compiles while its peers may already wait in the first collective: room for a slow compile on shared cores.
COMPILE_TIMEOUT = timedelta(seconds=300)
GLOBAL_SCALE = 448.0 * 6.0 / 4.0


class Counting:
    """A torch.compile backend that counts the graphs it gets and runs them through ``backend``."""

    def __init__(self, backend: str):
        from torch._dynamo import lookup_backend

        self.inner, self.graphs = lookup_backend(backend), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


def make_step(moe: MoeAlltoAll, runtime_max: int, fmt, swizzled: bool, zero_copy: bool):
    """One MoE step: dispatch, then combine of the given partials (through combine_input when ``zero_copy``)."""
    kw = dict(quant_format=fmt, swizzled_scales=swizzled)
    combine_fmt = "fp8_block" if fmt else None

    def step(ids, payloads, partials, global_scale):
        recv, counts = moe.dispatch(ids, payloads, runtime_max, global_scale=global_scale, **kw)
        if zero_copy:
            moe.combine_input().copy_(partials)
            out = moe.combine(quant_format=combine_fmt)
        else:
            out = moe.combine(partials, quant_format=combine_fmt)
        return recv, counts, out

    return step


def _snapshot(recv, counts, out):
    """CPU copies (an eager call's tensors are reused by the next call)."""
    return [r.cpu().clone() for r in recv], counts.cpu().clone(), out.cpu().clone()


def _unswizzle(recv, fmt, runtime_max):
    cols = -(-HIDDEN // (quant.MXFP8_BLOCK if fmt == "mxfp8" else quant.NVFP4_BLOCK))
    rows = quant.unswizzle_scales_128x4(recv[1], -(-runtime_max // 128) * 128, -(-cols // 4) * 4)
    return [recv[0], rows[:, :runtime_max, :cols], *recv[2:]]


# (quant_format, swizzled_scales, zero-copy combine): bf16 with partials given or written into combine_input, then
# quantizing dispatches with the FP8 combine.
CASES = [(None, False, False), (None, False, True), ("fp8_block", False, True), ("nvfp4", True, False)]


def check_compiled(rank: int, ep_size: int, device, backend: str = "aot_eager", cases=CASES) -> None:
    """Per case of ``cases``: the compiled step on three fresh inputs (one graph for all), each against the eager
    step and the reference."""
    runtime_max = 24
    moe = MoeAlltoAll(None, max_num_tokens=runtime_max, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
                      device=device, transport="nccl")
    for case, (fmt, swizzled, zero_copy) in enumerate(cases):
        step = make_step(moe, runtime_max, fmt, swizzled, zero_copy)
        counting = Counting(backend)
        compiled = torch.compile(step, fullgraph=True, backend=counting, dynamic=False)
        for seed in range(3):
            seed += 1000 * case
            ids, payloads = rank_inputs(ep_size, runtime_max, seed, torch.int64)
            gs = GLOBAL_SCALE if fmt == "nvfp4" else None
            wired = payloads if fmt is None else [[*quant.quantize(p[0], fmt, gs), *p[1:]] for p in payloads]
            ref = reference_dispatch(ids, wired, NUM_EXPERTS, runtime_max)
            gen = torch.Generator().manual_seed(seed + 1)
            partials = [torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).bfloat16() for _ in range(ep_size)]
            combine = reference_combine if fmt is None else quant.reference_combine_fp8
            want = combine(partials, ref)[rank]
            args = (ids[rank].to(device), [p.to(device) for p in payloads[rank]], partials[rank].to(device),
                    None if gs is None else torch.full((1,), gs, device=device))
            held = step(*args)
            eager = _snapshot(*held)
            poison([*held[0], held[1], held[2]])  # the transport's buffers: a traced call must not read them
            got = compiled(*args)
            kept = {t.data_ptr() for t in moe._transport._buffers.values()}
            assert not {t.data_ptr() for t in (*got[0], got[1])} & kept, "a traced result is a kept buffer"
            got = _snapshot(*got)
            for name, (recv, counts, out) in (("compiled", got), ("eager", eager)):
                if swizzled:
                    recv = _unswizzle(recv, fmt, runtime_max)
                check_recv(rank, recv, counts, ref, runtime_max)
                assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), f"case {case}: {name} combine differs"
            assert torch.equal(got[1], eager[1])
            assert torch.equal(got[2].view(torch.uint8), eager[2].view(torch.uint8))
        assert counting.graphs == 1, f"case {case}: {counting.graphs} graphs for 3 calls of one shape"
    moe.destroy()


def check_exact_refuses_compile(rank: int, ep_size: int, device) -> None:
    """exact=True exchanges the counts on the host: traced, it raises naming torch.compile (before any
    collective, alike on every rank)."""
    moe = MoeAlltoAll(None, max_num_tokens=8, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
                      device=device, transport="nccl", exact=True)
    ids = torch.zeros(4, TOP_K, dtype=torch.int64, device=device)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device=device)
    compiled = torch.compile(lambda i, p: moe.dispatch(i, [p], 8), fullgraph=True, backend="eager")
    expect_raises(Exception, "exact=True synchronises with the host", compiled, ids, x)
    _, counts = moe.dispatch(ids, [x], 8)  # still usable eagerly: every rank sends its 4 tokens to expert 0's rank
    assert counts.tolist() == [4 * (rank == 0)] * ep_size, counts
    moe.combine(torch.zeros(ep_size, 8, HIDDEN, dtype=torch.bfloat16, device=device))
    moe.destroy()


CHECKS = {
    "aot_eager": check_compiled,
    "inductor": lambda rank, ep_size, device: check_compiled(rank, ep_size, device, backend="inductor"),
    "exact": check_exact_refuses_compile,
}


def spawn_gloo(checks: list[str], world_size: int, tmp_path: Path, timeout_s: float = 600.0) -> None:
    """Runs the named checks on ``world_size`` spawned gloo ranks (CPU tensors); re-raises a rank's error."""
    nccl_workers.spawn_gloo(checks, world_size, tmp_path, timeout_s, module=__name__,
                            collective_timeout=COMPILE_TIMEOUT)
