"""One rank of the multi-GPU checks, launched by torchrun or mpirun:

    torchrun --nproc-per-node 2 -m tests.multigpu.worker [check ...]
    mpirun -n 2 python -m tests.multigpu.worker [check ...]

Every rank draws every rank's inputs from one shared seed, so each can compute the reference for itself. Prints
``CHECK <name> rank <r> ok`` per passed check; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.moe_alltoall import MoeAlltoAll

from .common import bootstrap, combine_partials, expect_timeout, make_inputs, shared_seed
from .overlap_checks import check_comm_stream  # noqa: F401 (by name)
from .push_checks import check_default_push, check_pull_without_room, check_push, check_push_missing_rank  # noqa: F401
from .push_checks import pushed_at_every_size
from .randomized import check_randomized  # noqa: F401 (by name)


def round_trip(a2a: MoeAlltoAll, comm, tokens, top_k, hidden, num_experts, seed, *, zero_copy=False, skew=None,
               id_dtype=torch.int64):
    """One dispatch -> partials -> combine on this rank, checked against the reference for all ranks."""
    rank, n = comm.rank, comm.size
    ids, xs, ws = make_inputs(n, tokens, top_k, hidden, num_experts, seed, skew, id_dtype)
    runtime_max = max(max(tokens), 1)
    (recv_x, recv_ids, recv_w), counts = a2a.dispatch(ids[rank].cuda(), [xs[rank].cuda(), ids[rank].cuda(),
                                                                        ws[rank].cuda()], runtime_max)
    want = ref.reference_dispatch(ids, [[x, i, w] for x, i, w in zip(xs, ids, ws)], num_experts, runtime_max)
    torch.cuda.synchronize()
    fa.check_error(a2a.workspace, rank)
    assert torch.equal(counts.cpu(), want.recv_counts[rank]), f"recv_counts {counts.cpu()} != {want.recv_counts[rank]}"
    valid = ref.valid_row_mask(want.recv_counts[rank], runtime_max)
    for got, expected in zip((recv_x, recv_ids, recv_w), want.recv_payloads[rank]):
        assert ref.bitwise_equal(got.cpu()[valid], expected[valid])
    gen = torch.Generator().manual_seed(seed + 1)
    partials = [torch.randn(n, runtime_max, hidden, generator=gen).to(torch.bfloat16) for _ in range(n)]
    expected_out = ref.reference_combine(partials, want)[rank]
    mine = partials[rank].clone()
    mine[~valid] = float("nan")  # rows past the counts must never be read
    if zero_copy:
        a2a.combine_input().copy_(mine.cuda())
        out = a2a.combine()
    else:
        out = a2a.combine(mine.cuda())
    torch.cuda.synchronize()
    fa.check_error(a2a.workspace, rank)
    assert ref.bitwise_equal(out.cpu(), expected_out), "combine differs from the reference"


def check_correctness(group, comm):
    n = comm.size
    seed = shared_seed(comm)
    for top_k, hidden, num_experts in ((1, 128, n), (2, 2880, 8 * n + 1), (8, 7168, 32 * n), (9, 4096, 24 * n + 3),
                                       (16, 7169, 64 * n)):
        a2a = MoeAlltoAll(group, max_num_tokens=256, top_k=top_k, num_experts=num_experts, hidden_size=hidden)
        for i, tokens in enumerate(([256] * n, [0] + [200] * (n - 1), [(37 * r + 5) % 256 for r in range(n)])):
            round_trip(a2a, comm, tokens, top_k, hidden, num_experts, seed + 7 * i, zero_copy=i % 2 == 1,
                       id_dtype=torch.int32 if i == 2 else torch.int64)
        round_trip(a2a, comm, [128] * n, top_k, hidden, num_experts, seed + 99, skew=float("inf"))  # all to one
        a2a.destroy()
    # Thousands of tokens: chunks late in the grid count several tiles of tokens before them.
    a2a = MoeAlltoAll(group, max_num_tokens=3000, top_k=8, num_experts=32 * n, hidden_size=256)
    for i, tokens in enumerate(([3000] * n, [(1025 + 977 * r) % 3001 for r in range(n)])):
        round_trip(a2a, comm, tokens, 8, 256, 32 * n, seed + 50 + i, zero_copy=i == 1)
    a2a.destroy()


def check_quantized(group, comm):
    """Fused quantizing dispatch (each format, both scale layouts) and the FP8-wire combine across processes."""
    seed = shared_seed(comm)
    for i, (fmt, swizzled) in enumerate((("fp8_block", False), ("mxfp8", True), ("nvfp4", False), ("nvfp4", True))):
        with pushed_at_every_size(i < 2):  # the FP8 wire pushed (at these sizes too), then pulled
            _check_quantized_format(group, comm, seed, i, fmt, swizzled)


def _check_quantized_format(group, comm, seed, i, fmt, swizzled):
    from flashinfer_a2a.reference import quant as q
    from flashinfer_a2a.library.wire_formats import wire_format

    rank, n = comm.rank, comm.size
    top_k, hidden, num_experts, max_tokens = 8, 7168, 32 * n, 160
    a2a = MoeAlltoAll(group, max_num_tokens=max_tokens, top_k=top_k, num_experts=num_experts, hidden_size=hidden,
                      dispatch_format=fmt, swizzled_scales=swizzled,
                      combine_format="fp8_block" if i < 2 else None)
    tokens = [(53 * r + 29 * i) % (max_tokens + 1) for r in range(n)]
    ids, _, _ = make_inputs(n, tokens, top_k, hidden, num_experts, seed + i)
    gen = torch.Generator().manual_seed(seed + 20 + i)  # |x| <= 8: the nvfp4 global scale above
    xs = [(torch.randn(t, hidden, generator=gen) * 2).clamp(-8, 8).to(torch.bfloat16) for t in tokens]
    gs = torch.tensor([448.0 * 6.0 / 8.0], device="cuda") if fmt == "nvfp4" else None
    (values, scales, recv_ids), counts = a2a.dispatch(ids[rank].cuda(), [xs[rank].cuda(), ids[rank].cuda()],
                                                      max_tokens, quant_format=fmt, global_scale=gs,
                                                      swizzled_scales=swizzled)
    want = ref.reference_dispatch(ids, [[x, i] for x, i in zip(xs, ids)], num_experts, max_tokens)
    torch.cuda.synchronize()
    fa.check_error(a2a.workspace, rank)
    assert torch.equal(counts.cpu(), want.recv_counts[rank])
    cols = wire_format(fmt).scale_cols(hidden)
    for src in range(n):
        m = int(want.recv_counts[rank][src])
        want_values, want_scales = q.quantize(want.recv_payloads[rank][0][src, :m], fmt,
                                              448.0 * 6.0 / 8.0 if fmt == "nvfp4" else None)
        assert torch.equal(values[src, :m].cpu().view(torch.uint8), want_values.view(torch.uint8)), fmt
        got_scales = (q.unswizzle_scales_128x4(scales[src].cpu(), 256, -(-cols // 4) * 4)[:m, :cols]
                      if swizzled else scales[src, :m].cpu())
        assert torch.equal(got_scales.view(torch.uint8), want_scales.view(torch.uint8)), f"{fmt} scales"
        assert torch.equal(recv_ids[src, :m].cpu(), want.recv_payloads[rank][1][src, :m])
    combine_partials(a2a, comm, want, max_tokens, hidden, torch.bfloat16, seed + 50 + i, zero_copy=i % 2 == 1,
                     quant_format="fp8_block")
    a2a.destroy()


def _layer(a2a, ids, x):
    (recv_x,), counts = a2a.dispatch(ids, [x])
    a2a.combine_input().copy_((recv_x.float() * 1.5).to(torch.bfloat16))
    return a2a.combine()


def check_graph(group, comm):
    seed = shared_seed(comm)
    a2a = MoeAlltoAll(group, max_num_tokens=64, top_k=4, num_experts=16 * comm.size, hidden_size=2048)
    ids, xs, _ = make_inputs(comm.size, [64] * comm.size, 4, 2048, 16 * comm.size, seed)
    static_ids, static_x = ids[comm.rank].cuda(), xs[comm.rank].cuda()
    _layer(a2a, static_ids, static_x)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        static_out = _layer(a2a, static_ids, static_x)
    for i in range(20):
        ids, xs, _ = make_inputs(comm.size, [64] * comm.size, 4, 2048, 16 * comm.size, seed + i + 1)
        static_ids.copy_(ids[comm.rank])
        static_x.copy_(xs[comm.rank])
        eager = _layer(a2a, static_ids, static_x).clone()
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert ref.bitwise_equal(static_out.cpu(), eager.cpu())
    fa.check_error(a2a.workspace, comm.rank)
    a2a.destroy()


#: check_back_to_back's combines: (name, combine wire, zero copy, pushed). Each signals its peers with a relaxed store
#: once its rows are performed in its own memory at GPU scope (PublishCombineEpoch): written by earlier kernels (zero
#: copy), or copied or quantized by the combine itself (a partials tensor, the FP8 wire). Pushed: where every rank has
#: a GPU of its own, the partials are pushed at these sizes (pulled otherwise).
BACK_TO_BACK = [("zero copy", None, True, False), ("partials tensor", None, False, False),
                ("fp8 wire", "fp8_block", False, False), ("fp8 wire, zero copy", "fp8_block", True, False),
                ("pushed zero copy", None, True, True), ("pushed fp8 wire", "fp8_block", False, True)]


def check_back_to_back(group, comm):
    """Steps one after another in one CUDA graph, with no host synchronization between them: each step's expert
    kernel writes the partials (its received rows times the step number) just before the combine, for each of
    BACK_TO_BACK's combines. Each step's output must be that step's reference: a peer that read the partials before
    they landed would sum another step's."""
    seed = shared_seed(comm)
    for i, (name, wire, zero_copy, pushed) in enumerate(BACK_TO_BACK):
        with pushed_at_every_size(pushed):
            _check_back_to_back(group, comm, seed + 100 * i, name, wire, zero_copy, pushed)


def _check_back_to_back(group, comm, seed, name, wire, zero_copy, pushed):
    from flashinfer_a2a.reference import quant as q

    rank, n = comm.rank, comm.size
    steps, tokens, top_k, hidden, experts = 6, 24, 4, 1024, 8 * n
    a2a = MoeAlltoAll(group, max_num_tokens=tokens, top_k=top_k, num_experts=experts, hidden_size=hidden,
                      combine_format=wire, push_combine=pushed or None, namespace=f"back to back {name}")
    gen = torch.Generator().manual_seed(seed)
    # Finite rows (make_inputs' include NaNs, whose bits a product on the GPU need not keep as the CPU does).
    inputs = [(make_inputs(n, [tokens] * n, top_k, hidden, experts, seed + s)[0],
               [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(n)]) for s in range(steps)]
    ids = [all_ids[rank].cuda() for all_ids, _ in inputs]
    xs = [all_xs[rank].cuda() for _, all_xs in inputs]

    def step(s):
        (recv_x,), _ = a2a.dispatch(ids[s], [xs[s]])
        partials = (recv_x.float() * (s + 1)).to(torch.bfloat16)
        if zero_copy:
            a2a.combine_input().copy_(partials)
            return a2a.combine(quant_format=wire).clone()
        return a2a.combine(partials, quant_format=wire).clone()

    step(0)  # loads the kernels before the capture
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [step(s) for s in range(steps)]
    expected = []
    for s, (all_ids, all_xs) in enumerate(inputs):
        want = ref.reference_dispatch(all_ids, [[x] for x in all_xs], experts, tokens)
        partials = [(want.recv_payloads[r][0].float() * (s + 1)).to(torch.bfloat16) for r in range(n)]
        combined = ref.reference_combine(partials, want) if wire is None else q.reference_combine_fp8(partials, want)
        expected.append(combined[rank])
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        fa.check_error(a2a.workspace, rank)
        for s, (out, want_out) in enumerate(zip(outs, expected)):
            assert ref.bitwise_equal(out.cpu(), want_out), f"{name}: step {s} differs from its reference"
    a2a.destroy()


def check_compile(group, comm):
    seed = shared_seed(comm)
    a2a = MoeAlltoAll(group, max_num_tokens=48, top_k=4, num_experts=8 * comm.size, hidden_size=1024)

    def layer(ids, x):
        (recv_x,), counts = fa.dispatch(a2a.workspace, a2a.ep_rank, a2a.config, ids, [x], 48, a2a.num_experts)
        partial = (recv_x.float() * 0.5).to(torch.bfloat16)
        return fa.combine(a2a.workspace, a2a.ep_rank, a2a.config, counts, ids.shape[0], 48, partial)

    compiled = torch.compile(layer, fullgraph=True)
    for i in range(3):
        ids, xs, _ = make_inputs(comm.size, [48] * comm.size, 4, 1024, 8 * comm.size, seed + i)
        eager = layer(ids[comm.rank].cuda(), xs[comm.rank].cuda()).clone()
        got = compiled(ids[comm.rank].cuda(), xs[comm.rank].cuda())
        torch.cuda.synchronize()
        assert ref.bitwise_equal(got.cpu(), eager.cpu())
    fa.check_error(a2a.workspace, comm.rank)
    a2a.destroy()
    # MoeAlltoAll's zero-copy combine compiled: the experts write combine_input() inside the graph.
    a2a = MoeAlltoAll(group, max_num_tokens=64, top_k=4, num_experts=16 * comm.size, hidden_size=2048,
                      namespace="compiled zero copy")
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids, x: _layer(a2a, ids, x), fullgraph=True)
    for i in range(3):
        ids, xs, _ = make_inputs(comm.size, [64] * comm.size, 4, 2048, 16 * comm.size, seed + 10 + i)
        eager = _layer(a2a, ids[comm.rank].cuda(), xs[comm.rank].cuda()).clone()
        got = compiled(ids[comm.rank].cuda(), xs[comm.rank].cuda())
        torch.cuda.synchronize()
        assert ref.bitwise_equal(got.cpu(), eager.cpu()), "compiled zero-copy combine != eager"
    fa.check_error(a2a.workspace, comm.rank)
    a2a.destroy()


def check_interleaved(group, comm):
    seed = shared_seed(comm)
    n = comm.size
    first = MoeAlltoAll(group, max_num_tokens=100, top_k=4, num_experts=8 * n, hidden_size=512)
    # interleaved dispatches need workspaces of their own: one dispatch may be pending per shared workspace
    second = MoeAlltoAll(group, max_num_tokens=50, top_k=2, num_experts=4 * n, hidden_size=256, namespace="second")
    gen = torch.Generator().manual_seed(seed)
    for i in range(3):
        # finite activations: the identity expert's sums are then exact (random bytes would include NaNs)
        ids1, _, _ = make_inputs(n, [100] * n, 4, 512, 8 * n, seed + i)
        ids2, _, _ = make_inputs(n, [50] * n, 2, 256, 4 * n, seed + 50 + i)
        xs1 = [torch.randn(100, 512, generator=gen).to(torch.bfloat16) for _ in range(n)]
        xs2 = [torch.randn(50, 256, generator=gen).to(torch.bfloat16) for _ in range(n)]
        (r1,), _ = first.dispatch(ids1[comm.rank].cuda(), [xs1[comm.rank].cuda()])
        (r2,), _ = second.dispatch(ids2[comm.rank].cuda(), [xs2[comm.rank].cuda()])
        out2 = second.combine(r2.clone())
        out1 = first.combine(r1.clone())
        torch.cuda.synchronize()
        for out, ids, xs, e in ((out1, ids1, xs1, 8 * n), (out2, ids2, xs2, 4 * n)):
            # identity experts: each token comes back times the number of distinct ranks it went to
            ranks = ref.token_rank_mask(ids[comm.rank], e, n).sum(1, keepdim=True).float()
            want = (xs[comm.rank].float() * ranks + 0.0).to(torch.bfloat16)  # + 0.0: a token sent nowhere is +0
            assert ref.bitwise_equal(out.cpu(), want)
    first.destroy()
    second.destroy()


def check_lifecycle(group, comm):
    def snapshot():
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0], len(os.listdir("/proc/self/fd"))

    a2a = MoeAlltoAll(group, max_num_tokens=128, top_k=8, num_experts=8 * comm.size, hidden_size=4096)
    a2a.destroy()  # first use loads the module and sets up allocator pools
    before = snapshot()
    seed = shared_seed(comm)
    for i in range(20):
        a2a = MoeAlltoAll(group, max_num_tokens=128, top_k=8, num_experts=8 * comm.size, hidden_size=4096)
        round_trip(a2a, comm, [128] * comm.size, 8, 4096, 8 * comm.size, seed + i)
        a2a.destroy()
    after = snapshot()
    assert after[1] == before[1], f"open descriptors {before[1]} -> {after[1]}"
    assert after[0] >= before[0] - (64 << 20), f"free GPU memory {before[0]} -> {after[0]}"


def check_misuse(group, comm):
    a2a = MoeAlltoAll(group, max_num_tokens=16, top_k=2, num_experts=2 * comm.size, hidden_size=64)
    ids = torch.zeros(16, 2, dtype=torch.int64, device="cuda")
    x = torch.zeros(16, 64, dtype=torch.bfloat16, device="cuda")
    for call, pattern in ((lambda: a2a.combine(), "without a pending dispatch"),
                          (lambda: a2a.dispatch(ids, [x], 17), "exceeds max_num_tokens"),
                          (lambda: a2a.dispatch(torch.zeros(17, 2, dtype=torch.int64, device="cuda"), [x]),
                           "topk_ids must be")):
        try:
            call()
        except (RuntimeError, ValueError) as exc:
            assert pattern in str(exc), exc
        else:
            raise AssertionError(f"no error for {pattern}")
    a2a.dispatch(ids, [x])
    try:
        a2a.dispatch(ids, [x])
    except RuntimeError as exc:
        assert "called twice" in str(exc)
    else:
        raise AssertionError("second dispatch accepted")
    a2a.combine(torch.zeros(comm.size, 16, 64, dtype=torch.bfloat16, device="cuda"))
    a2a.destroy()


def check_missing_rank(group, comm):
    """The last rank never calls dispatch: the others get the timeout naming it, not a hang."""
    last = comm.size - 1
    a2a = MoeAlltoAll(group, max_num_tokens=32, top_k=2, num_experts=2 * comm.size, hidden_size=256)
    if comm.rank != last:
        ids = torch.zeros(32, 2, dtype=torch.int64, device="cuda")
        x = torch.zeros(32, 256, dtype=torch.bfloat16, device="cuda")
        expect_timeout(a2a, comm, last, lambda: a2a.dispatch(ids, [x], timeout_s=1.0))
    a2a.destroy()


def check_killed_rank(group, comm):
    """The last rank dies before dispatching: the survivors get the timeout naming it. torchrun only."""
    last = comm.size - 1
    a2a = MoeAlltoAll(group, max_num_tokens=32, top_k=2, num_experts=2 * comm.size, hidden_size=256)
    if comm.rank == last:
        print(f"CHECK killed_rank rank {comm.rank} ok (exiting on purpose)", flush=True)
        os._exit(0)
    ids = torch.zeros(32, 2, dtype=torch.int64, device="cuda")
    a2a.dispatch(ids, [torch.zeros(32, 256, dtype=torch.bfloat16, device="cuda")], timeout_s=1.0)
    torch.cuda.synchronize()
    try:
        fa.check_error(a2a.workspace, comm.rank)
    except fa.A2AError as exc:
        assert exc.peer == last, exc
    else:
        raise AssertionError("no timeout recorded")
    print(f"CHECK killed_rank rank {comm.rank} ok", flush=True)
    os._exit(0)  # no collective teardown: a peer is gone


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


def main(argv: list[str]) -> None:
    group, comm, launcher = bootstrap()
    names = argv or [n for n in CHECKS if n != "killed_rank"]
    for name in names:
        CHECKS[name](group, comm)
        print(f"CHECK {name} rank {comm.rank} ok ({launcher})", flush=True)
    comm.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
