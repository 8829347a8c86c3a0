"""Checks of the pushed combine across processes (run by worker.py): plain rows and the FP8 wire landed in their
owners' workspaces, summed as they land, under CUDA-graph replay, and with a rank that never combines; a workspace
sized for the pull, or with room nobody asked to push into, never pushes; a default one pushes where that is the
faster combine."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.moe_alltoall import MoeAlltoAll
from flashinfer_a2a.reference import quant as q
from flashinfer_a2a.library import combine_mode as combine_mode_rules
from flashinfer_a2a.library.wire_formats import push_combine_bytes_per_token

from .common import SHARED_GPU, combine_partials, expect_timeout, make_inputs, shared_seed

# (dtype, hidden, combine wire): 16-byte rows; 4-byte rows (1026 fp16, 515 fp32); the FP8 wire in both dtypes.
PUSH_CASES = ((torch.bfloat16, 2048, None), (torch.float16, 1026, None), (torch.float32, 515, None),
              (torch.float16, 2048, "fp8_block"), (torch.bfloat16, 2048, "fp8_block"))


@contextlib.contextmanager
def pushed_at_every_size(enabled: bool = True) -> Iterator[None]:
    """Partials are pushed from push_min_tokens(ep_size, wire) tokens per rank only (below, pulling is faster):
    inside this, a workspace that pushes does so at every size, so that small cases check the pushed path."""
    kept = combine_mode_rules.PUSH_MIN_TOKENS
    if enabled:
        combine_mode_rules.PUSH_MIN_TOKENS = {wire: (0, 0) for wire in kept}
    try:
        yield
    finally:
        combine_mode_rules.PUSH_MIN_TOKENS = kept


def _pushing(group, comm, dtype, hidden, wire, top_k, max_tokens, *, sized=True) -> MoeAlltoAll:
    """A workspace sized for the pushed combine over `wire` (or, not `sized`, for the pulled one); its callers run
    inside pushed_at_every_size."""
    a2a = MoeAlltoAll(group, max_num_tokens=max_tokens, top_k=top_k, num_experts=16 * comm.size, hidden_size=hidden,
                      dtype=dtype, combine_format=wire if sized else None, push_combine=sized and wire is None)
    if SHARED_GPU:
        a2a._transport.allocation.one_gpu_per_rank = True  # the pushed combine needs it (see SHARED_GPU)
    return a2a


def _push_flags(a2a: MoeAlltoAll, rank: int) -> torch.Tensor:
    """This rank's push flags, [ep_size (source), max_num_tokens], as they are now (on the host)."""
    at = int(a2a.metainfo[fa.get_metainfo_index_pairs()["push_flags_offset"]])
    n, max_tokens = a2a.ep_size, a2a.config.max_num_tokens
    return a2a.workspace[rank, at:at + n * max_tokens * 4].view(torch.int32).view(n, max_tokens).cpu()


def check_push(group, comm):
    """Pushed combines over several calls on one workspace per case (partials tensor, zero copy, partials off a
    16-byte boundary, runtime_max changing, a rank with no tokens), then under CUDA-graph replay: each output bitwise
    equal to the reference, and every landed row equal to the peer's partial (plain) or to the reference FP8 wire of
    it; the landing blocks are poisoned before each dispatch, so a pull would leave them so."""
    seed = shared_seed(comm)
    top_k, max_tokens = 6, 96
    for c, (dtype, hidden, wire) in enumerate(PUSH_CASES):
        with pushed_at_every_size():
            _check_push_case(comm, _pushing(group, comm, dtype, hidden, wire, top_k, max_tokens), c, dtype, hidden,
                             wire, seed)


def _check_push_case(comm, a2a, c, dtype, hidden, wire, seed):
    """check_push's calls on one workspace (case c of PUSH_CASES)."""
    rank, n = comm.rank, comm.size
    top_k, max_tokens = a2a.config.top_k, a2a.config.max_num_tokens
    assert a2a.combine_mode(wire) == "push"
    combine_offset = int(a2a.metainfo[fa.get_metainfo_index_pairs()["combine_offset"]])
    landing_row = push_combine_bytes_per_token(hidden, dtype, wire) - hidden * dtype.itemsize
    for i in range(4):
        s = seed + 100 * c + 11 * i
        tokens = [(31 * r + 17 * i) % (max_tokens + 1) if (r + i) % 3 else 0 for r in range(n)]
        runtime_max = max(max(tokens), 1) if i % 2 else max_tokens
        ids, xs, _ = make_inputs(n, tokens, top_k, hidden, 16 * n, s)
        xs = [x.to(dtype) for x in xs]
        # Poisoned before the dispatch: once a peer has this rank's dispatch signal, it may push here.
        landing_at = combine_offset + n * runtime_max * hidden * dtype.itemsize
        landing = a2a.workspace[rank, landing_at:landing_at + n * runtime_max * landing_row]
        landing.fill_(0x5A)
        a2a.dispatch(ids[rank].cuda(), [xs[rank].cuda()], runtime_max)
        want = ref.reference_dispatch(ids, [[x] for x in xs], 16 * n, runtime_max)
        partials = combine_partials(a2a, comm, want, runtime_max, hidden, dtype, s + 1, zero_copy=i % 2 == 1,
                                    quant_format=wire, misaligned=i == 2 and wire is None)
        rows = landing.view(n, runtime_max, landing_row).cpu()
        flags = _push_flags(a2a, rank)
        for src in range(n):
            m = int(want.recv_counts[src][rank])  # rows src computed for this rank's tokens
            if src == rank or m == 0:
                continue
            assert flags[src].any(), f"no push flag from {src}"
            if wire is None:
                sent = partials[src][rank, :m].contiguous().view(torch.uint8).reshape(m, -1)
                assert torch.equal(rows[src, :m], sent), f"landed rows from {src} ({dtype})"
                continue
            values, scales = q.quantize(partials[src][rank, :m], wire)
            assert torch.equal(rows[src, :m, :hidden], values.view(torch.uint8)), f"landed values from {src}"
            got_scales = rows[src, :m, hidden:hidden + scales.shape[1] * 4].contiguous().view(torch.float32)
            assert torch.equal(got_scales, scales), f"landed scales from {src}"
    if hidden == 2048:
        _replay_push(a2a, comm, top_k, hidden, dtype, wire, seed + 100 * c + 99)
    a2a.destroy()


def _replay_push(a2a, comm, top_k, hidden, dtype, wire, seed):
    """A dispatch + pushed combine captured in a CUDA graph, replayed on fresh inputs: the epochs, the claim counters
    and the push flags advance on the device, so every replay must match the reference."""
    rank, n, tokens = comm.rank, comm.size, a2a.config.max_num_tokens
    static_ids = torch.zeros(tokens, top_k, dtype=torch.int64, device="cuda")
    static_x = torch.zeros(tokens, hidden, dtype=dtype, device="cuda")
    static_partials = torch.zeros(n, tokens, hidden, dtype=dtype, device="cuda")

    def layer():
        a2a.dispatch(static_ids, [static_x], tokens)
        return a2a.combine(static_partials, quant_format=wire)

    layer()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=stream):
        static_out = layer()
    for j in range(3):
        ids, xs, _ = make_inputs(n, [tokens] * n, top_k, hidden, 16 * n, seed + j)
        xs = [x.to(dtype) for x in xs]
        want = ref.reference_dispatch(ids, [[x] for x in xs], 16 * n, tokens)
        gen = torch.Generator().manual_seed(seed + 50 + j)
        partials = [torch.randn(n, tokens, hidden, generator=gen).to(dtype) for _ in range(n)]
        static_ids.copy_(ids[rank])
        static_x.copy_(xs[rank])
        static_partials.copy_(partials[rank])
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        fa.check_error(a2a.workspace, rank)
        expected = (ref.reference_combine(partials, want) if wire is None
                    else q.reference_combine_fp8(partials, want))[rank]
        assert ref.bitwise_equal(static_out.cpu(), expected), f"replayed pushed combine differs ({dtype}, {j})"


def check_pull_without_room(group, comm):
    """A workspace sized for the pulled combine pulls even a call whose landing rows would fit in the room it keeps
    for larger calls (runtime_max a quarter of max_num_tokens), and so does one whose explicit
    combine_bytes_per_token has room for a push nobody asked for (the mode is never inferred from sizes): each
    output equal to the reference, and no push flag set, plain partials (tensor and zero copy) or the FP8 wire
    alike."""
    top_k, hidden, max_tokens = 4, 512, 64
    _check_pulls(comm, _pushing(group, comm, torch.bfloat16, hidden, None, top_k, max_tokens, sized=False), hidden)
    roomy = MoeAlltoAll(group, max_num_tokens=max_tokens, top_k=top_k, num_experts=16 * comm.size,
                        hidden_size=hidden, combine_bytes_per_token=4 * hidden * 2)
    if SHARED_GPU:
        roomy._transport.allocation.one_gpu_per_rank = True  # as _pushing: only the mode may keep this combine from pushing
    assert roomy.combine_mode() == "pull" and roomy.combine_mode("fp8_block") == "pull"
    _check_pulls(comm, roomy, hidden)


def _check_pulls(comm, a2a, hidden):
    rank, n = comm.rank, comm.size
    seed = shared_seed(comm)
    max_tokens = a2a.config.max_num_tokens
    for i, (wire, zero_copy) in enumerate(((None, False), (None, True), ("fp8_block", False))):
        tokens = [max_tokens // 4 - r for r in range(n)]
        ids, xs, _ = make_inputs(n, tokens, a2a.config.top_k, hidden, 16 * n, seed + 10 * i)
        xs = [x.to(torch.bfloat16) for x in xs]
        a2a.dispatch(ids[rank].cuda(), [xs[rank].cuda()], tokens[0])
        want = ref.reference_dispatch(ids, [[x] for x in xs], 16 * n, tokens[0])
        combine_partials(a2a, comm, want, tokens[0], hidden, torch.bfloat16, seed + 10 * i + 1, zero_copy=zero_copy,
                         quant_format=wire)
        assert not _push_flags(a2a, rank).any(), f"a pulled workspace's combine pushed ({wire}, zero copy {zero_copy})"
    a2a.destroy()


def check_default_push(group, comm):
    """MoeAlltoAll's default: a layer of push_min_tokens(ep_size) tokens per rank gets room for the pushed combine and
    pushes a combine of that runtime_max (the landed rows flagged, the output bitwise the reference), pulls one
    below it, and push_combine=False keeps the pull-sized workspace."""
    rank, n = comm.rank, comm.size
    top_k, hidden, max_tokens = 4, 256, combine_mode_rules.push_min_tokens(n)
    row = hidden * 2
    a2a = MoeAlltoAll(group, max_num_tokens=max_tokens, top_k=top_k, num_experts=16 * n, hidden_size=hidden)
    pulled = MoeAlltoAll(group, max_num_tokens=max_tokens, top_k=top_k, num_experts=16 * n, hidden_size=hidden,
                         push_combine=False, namespace="pulled")
    if SHARED_GPU:
        a2a._transport.allocation.one_gpu_per_rank = True  # as _pushing: only the construction may choose the mode
        pulled._transport.allocation.one_gpu_per_rank = True
    assert a2a.requested.combine_bytes_per_token == 2 * row and pulled.requested.combine_bytes_per_token == row
    assert a2a.combine_mode(None, max_tokens) == "push" and a2a.combine_mode(None, max_tokens - 1) == "pull"
    assert pulled.combine_mode(None, max_tokens) == "pull"
    seed = shared_seed(comm)
    for i, (layer, runtime_max, mode) in enumerate(((a2a, max_tokens, "push"), (a2a, 64, "pull"),
                                                    (pulled, max_tokens, "pull"))):
        tokens = [48 + 5 * r for r in range(n)]
        ids, xs, _ = make_inputs(n, tokens, top_k, hidden, 16 * n, seed + 10 * i)
        xs = [x.to(torch.bfloat16) for x in xs]
        before = _push_flags(layer, rank)  # before the dispatch: once a peer has it, that peer may push here
        layer.dispatch(ids[rank].cuda(), [xs[rank].cuda()], runtime_max)
        want = ref.reference_dispatch(ids, [[x] for x in xs], 16 * n, runtime_max)
        combine_partials(layer, comm, want, runtime_max, hidden, torch.bfloat16, seed + 10 * i + 1,
                         zero_copy=i == 0)
        flagged = not torch.equal(_push_flags(layer, rank), before)
        if any(int(want.recv_counts[src][rank]) for src in range(n) if src != rank):
            assert flagged == (mode == "push"), f"combine {i} should {mode}"
    pulled.destroy()
    a2a.destroy()


def check_push_missing_rank(group, comm):
    """The last rank dispatches but never combines: the others' pushed combines end with the timeout naming it
    (their reducers wait for its rows), not a hang."""
    last, top_k, tokens = comm.size - 1, 4, 32
    with pushed_at_every_size():
        a2a = _pushing(group, comm, torch.bfloat16, 512, None, top_k, tokens)
        ids = torch.zeros(tokens, top_k, dtype=torch.int64, device="cuda")
        ids[:, 0] = a2a.num_experts - 1  # every token goes to the last rank (its experts are the last ones)
        a2a.dispatch(ids, [torch.ones(tokens, 512, dtype=torch.bfloat16, device="cuda")])
        torch.cuda.synchronize()
        if comm.rank != last:
            out = torch.full((tokens, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
            partials = torch.ones(comm.size, tokens, 512, dtype=torch.bfloat16, device="cuda")
            expect_timeout(a2a, comm, last, lambda: a2a.combine(partials, out=out, timeout_s=1.0))
            # Every token waited for a row that never landed: the sums are dropped (zeros), not read from the poison.
            assert torch.equal(out.cpu(), torch.zeros(tokens, 512, dtype=torch.bfloat16))
        a2a.destroy()
