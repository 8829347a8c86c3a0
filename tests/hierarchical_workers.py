"""Rank bodies for tests/test_hierarchical_transport.py: MoeAlltoAll(transport="hierarchical") on spawned gloo ranks
(CPU), checked bitwise against flashinfer_a2a.reference and against the flat nccl transport on the same inputs.

With 4 ranks and 10 experts (3, 3, 2, 2 per rank), nodes of 2 hold experts 0-5 and 6-9. Every rank draws every
rank's inputs from one seed, so each can compute the reference of the whole group and compare its own share.
"""

from __future__ import annotations

import torch

from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.reference import quant, random_topk_ids, reference_combine, reference_dispatch

from .comm_workers import expect_raises
from .nccl_workers import HIDDEN, NUM_EXPERTS, TOP_K, check_recv, rank_inputs, run_plain, run_quantized

MAX_TOKENS = 24


def _layer(transport: str, node_size=None, **kw) -> MoeAlltoAll:
    """A layer with combine room for fp32 partials."""
    return MoeAlltoAll(None, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
                       combine_bytes_per_token=HIDDEN * 4, device="cpu", transport=transport, node_size=node_size,
                       **kw)


def node_routing(ep_size: int, node_size: int, seed: int) -> list[torch.Tensor]:
    """Every rank's int64 ids, token by token reaching no node (all -1), one node (each node in turn) or two nodes;
    rank 1 has no tokens. Experts are picked inside each node's expert range."""
    gen = torch.Generator().manual_seed(seed)
    per_rank = [NUM_EXPERTS // ep_size + (r < NUM_EXPERTS % ep_size) for r in range(ep_size)]
    starts = [sum(per_rank[:r]) for r in range(ep_size + 1)]
    nodes = ep_size // node_size
    node_experts = [(starts[n * node_size], starts[(n + 1) * node_size]) for n in range(nodes)]
    ids = []
    for rank in range(ep_size):
        rows = []
        for t in range(0 if rank == 1 else MAX_TOKENS - rank):
            row = torch.full((TOP_K,), -1, dtype=torch.int64)
            kind = t % 4  # no node, node t % nodes, two nodes, anything
            if kind == 1:
                low, high = node_experts[(t // 4) % nodes]
                row = torch.randint(low, high, (TOP_K,), generator=gen)
            elif kind == 2 and nodes > 1:
                for k, n in enumerate(((t // 4) % nodes, (t // 4 + 1) % nodes)):
                    low, high = node_experts[n]
                    row[k * 2 : k * 2 + 2] = torch.randint(low, high, (2,), generator=gen)
            elif kind == 3:
                row = random_topk_ids(1, TOP_K, NUM_EXPERTS, generator=gen, minus_one_frac=0.2)[0]
            rows.append(row)
        ids.append(torch.stack(rows) if rows else torch.empty(0, TOP_K, dtype=torch.int64))
    return ids


def run_routing(moe: MoeAlltoAll, rank: int, ep_size: int, node_size: int, seed: int) -> None:
    """Tokens reaching 0, 1 and 2 nodes: receive rows, counts and combine against the reference."""
    ids = node_routing(ep_size, node_size, seed)
    gen = torch.Generator().manual_seed(seed)
    payloads = [[torch.randn(len(i), HIDDEN, generator=gen).bfloat16(), i.to(torch.int32)] for i in ids]
    ref = reference_dispatch(ids, payloads, NUM_EXPERTS, MAX_TOKENS)
    recv, counts = moe.dispatch(ids[rank], payloads[rank], MAX_TOKENS)
    check_recv(rank, recv, counts, ref, MAX_TOKENS)
    partials = [torch.randn(ep_size, MAX_TOKENS, HIDDEN, generator=gen).bfloat16() for _ in range(ep_size)]
    got = moe.combine(partials[rank])
    want = reference_combine(partials, ref)[rank]
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "combine differs from the reference"


def run_against_flat(hier: MoeAlltoAll, flat: MoeAlltoAll, rank: int, ep_size: int, seed: int) -> None:
    """The same calls on both transports: the same counts, valid rows and combine bytes (plain and FP8 wire, fp32
    and fp16 partials, a runtime_max below the maximum)."""
    for i, (fmt, dtype, runtime_max) in enumerate([(None, torch.bfloat16, MAX_TOKENS), ("nvfp4", torch.bfloat16, 20),
                                                   (None, torch.float32, 9), ("fp8_block", torch.float16, 20)]):
        ids, payloads = rank_inputs(ep_size, runtime_max, seed + i, (torch.int32, torch.int64)[i % 2])
        gs = torch.full((1,), 5.0) if fmt == "nvfp4" else None
        got = []
        for moe in (hier, flat):
            recv, counts = moe.dispatch(ids[rank], payloads[rank], runtime_max, quant_format=fmt, global_scale=gs)
            rows = [r[src, : int(counts[src])].contiguous().view(torch.uint8) for r in recv for src in range(ep_size)]
            gen = torch.Generator().manual_seed(seed + i)
            partials = torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).to(dtype)
            out = moe.combine(partials, quant_format="fp8_block" if dtype == torch.float16 else None)
            got.append((counts.clone(), rows, out))
        (c1, rows1, out1), (c2, rows2, out2) = got
        assert torch.equal(c1, c2), (fmt, c1, c2)
        assert all(torch.equal(a, b) for a, b in zip(rows1, rows2)), f"{fmt}: receive rows differ from flat nccl"
        assert torch.equal(out1.view(torch.uint8), out2.view(torch.uint8)), f"{fmt} {dtype}: combine differs"


def check_node_sizes(rank: int, ep_size: int, device) -> None:
    """Nodes of 2 (and of 1 and of ep_size): plain and quantized rounds against the reference, node-crafted routing,
    and the flat nccl transport on the same inputs."""
    flat = _layer("nccl")
    for node_size in (2, 1, ep_size):
        moe = _layer("hierarchical", node_size)
        assert moe.transport == "hierarchical" and moe.combine_mode() == "pull"
        for i in range(4):
            run_plain(moe, rank, ep_size, device, 300 + i, (torch.int32, torch.int64)[i % 2], zero_copy=i >= 2)
        if node_size == 2:
            for i, (fmt, swizzled) in enumerate([("fp8_block", False), ("mxfp8", True), ("nvfp4", True)]):
                run_quantized(moe, rank, ep_size, device, 400 + i, fmt, swizzled)
        run_routing(moe, rank, ep_size, node_size, 500 + node_size)
        run_against_flat(moe, flat, rank, ep_size, 600 + node_size)
        moe.destroy()
        moe.destroy()
        expect_raises(RuntimeError, "destroyed", moe.dispatch, torch.zeros(1, TOP_K, dtype=torch.int32), [])
    flat.destroy()


def check_idle_step(rank: int, ep_size: int, device) -> None:
    """runtime_max 0 (every rank without tokens), then a step where only rank 0 has tokens."""
    moe = _layer("hierarchical", 2)
    ids = torch.empty(0, TOP_K, dtype=torch.int64)
    recv, counts = moe.dispatch(ids, [torch.empty(0, HIDDEN, dtype=torch.bfloat16)], 0)
    assert recv[0].shape == (ep_size, 0, HIDDEN) and int(counts.sum()) == 0
    assert moe.combine(torch.empty(ep_size, 0, HIDDEN, dtype=torch.bfloat16)).shape == (0, HIDDEN)
    gen = torch.Generator().manual_seed(7)
    ids = [random_topk_ids(5 if r == 0 else 0, TOP_K, NUM_EXPERTS, generator=gen) for r in range(ep_size)]
    xs = [[torch.randn(len(i), HIDDEN, generator=gen).bfloat16()] for i in ids]
    ref = reference_dispatch(ids, xs, NUM_EXPERTS, 5)
    recv, counts = moe.dispatch(ids[rank], xs[rank], 5)
    check_recv(rank, recv, counts, ref, 5)
    partials = [torch.randn(ep_size, 5, HIDDEN, generator=gen).bfloat16() for _ in range(ep_size)]
    want = quant.reference_combine_fp8(partials, ref)[rank]
    assert torch.equal(moe.combine(partials[rank], quant_format="fp8_block").view(torch.uint8), want.view(torch.uint8))
    moe.destroy()


def check_errors(rank: int, ep_size: int, device) -> None:
    """Bad arguments raise alike on every rank, naming the argument, before any collective (no rank hangs)."""
    expect_raises(ValueError, "node_size must be a positive divisor of ep_size=4", _layer, "hierarchical", 3)
    expect_raises(ValueError, "node_size must be a positive divisor", _layer, "hierarchical", 0)
    expect_raises(TypeError, "node_size must be an int, got str", _layer, "hierarchical", "2")
    expect_raises(ValueError, "needs node_size", _layer, "hierarchical")
    expect_raises(ValueError, "node_size is used by transport='hierarchical' only", _layer, "nccl", 2)
    expect_raises(ValueError, "exact=True needs transport='nccl', got transport='hierarchical'", _layer,
                  "hierarchical", 2, exact=True)
    expect_raises(ValueError, "transport must be one of auto, nvlink, nccl, hierarchical", _layer, "rdma")
    differing = 2 if rank else 4  # every rank raises, naming the field
    expect_raises(ValueError, "node_size (rank 0: 4, rank 1: 2", _layer, "hierarchical", differing)
    moe = _layer("hierarchical", 2)
    ids = torch.zeros(4, TOP_K, dtype=torch.int32)
    x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16)
    expect_raises(RuntimeError, "without a pending dispatch", moe.combine)
    expect_raises(RuntimeError, "without a pending dispatch", moe.combine_input)
    expect_raises(ValueError, f"exceeds max_num_tokens={MAX_TOKENS}", moe.dispatch, ids, [x], MAX_TOKENS + 1)
    expect_raises(ValueError, "num_tokens <= runtime_max_tokens_per_rank=2", moe.dispatch, ids, [x], 2)
    expect_raises(TypeError, "int32 or int64", moe.dispatch, ids.to(torch.int16), [x])
    expect_raises(ValueError, "payloads[0] must be [num_tokens=4", moe.dispatch, ids, [x[:3]])
    expect_raises(ValueError, "this MoeAlltoAll was built for top_k <= 4", moe.dispatch,
                  torch.zeros(4, TOP_K + 1, dtype=torch.int32), [x])
    expect_raises(ValueError, "dispatch_bytes_per_token=", moe.dispatch, ids, [torch.zeros(4, 4 * HIDDEN)])
    expect_raises(ValueError, "global_scale is required", moe.dispatch, ids, [x], quant_format="nvfp4")
    expect_raises(NotImplementedError, "needs transport='nvlink'", moe.dispatch_send, ids, [x])
    expect_raises(NotImplementedError, "needs transport='nvlink'", moe.bind_stream)
    moe.dispatch(ids, [x], 4)
    expect_raises(RuntimeError, "dispatch called twice", moe.dispatch, ids, [x], 4)
    expect_raises(ValueError, "partials must be [ep_size", moe.combine, torch.zeros(ep_size, 3, HIDDEN).bfloat16())
    expect_raises(ValueError, f"out must be [num_tokens=4, hidden={HIDDEN}]", moe.combine,
                  out=torch.empty(3, HIDDEN, dtype=torch.bfloat16))
    expect_raises(ValueError, "needs bf16|fp16 partials", moe.combine, torch.zeros(ep_size, 4, HIDDEN),
                  quant_format="fp8_block")
    moe.combine()
    # Ids outside [0, num_experts) reach no rank (and no collective hangs).
    recv, counts = moe.dispatch(torch.full((4, TOP_K), NUM_EXPERTS, dtype=torch.int64), [x], 4)
    assert int(counts.sum()) == 0, counts
    assert torch.equal(moe.combine(), torch.zeros(4, HIDDEN, dtype=torch.bfloat16))
    moe.destroy()


def check_layers(rank: int, ep_size: int, device) -> None:
    """Layers of one namespace share their buffers and take turns (one pending dispatch per namespace); another
    namespace's layer interleaves; a larger layer built later grows the shared buffers."""
    first, second = _layer("hierarchical", 2), _layer("hierarchical", 2)
    other = _layer("hierarchical", 2, namespace="other")
    ids = torch.zeros(4, TOP_K, dtype=torch.int32)
    x = torch.ones(4, HIDDEN, dtype=torch.bfloat16)
    first.dispatch(ids, [x], 4)
    expect_raises(RuntimeError, "dispatch called twice", second.dispatch, ids, [x], 4)
    expect_raises(RuntimeError, "another layer's", second.combine)
    (received,), _ = other.dispatch(ids, [x], 4)
    assert torch.equal(other.combine(received), x)  # expert 0: every token went to rank 0 alone
    first.combine()
    run_plain(second, rank, ep_size, device, 700, torch.int64, zero_copy=True)
    larger = MoeAlltoAll(None, max_num_tokens=2 * MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS,
                         hidden_size=HIDDEN, device="cpu", transport="hierarchical", node_size=2)
    run_plain(larger, rank, ep_size, device, 701, torch.int32, zero_copy=False)
    run_plain(first, rank, ep_size, device, 702, torch.int32, zero_copy=True)
    for moe in (first, second, other, larger):
        moe.destroy()


def check_subgroups(rank: int, world_size: int, device) -> None:
    """Two expert-parallel groups of 2 in a world of 4, ranks [0, 1] and [2, 3], each as 2 nodes of 1: their
    sub-groups are created by their own ranks only, at the same time."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    moe = MoeAlltoAll(group, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=NUM_EXPERTS, hidden_size=HIDDEN,
                      device="cpu", transport="hierarchical", node_size=1)
    for i in range(2):
        run_plain(moe, rank % 2, 2, device, 800 + 10 * (rank // 2) + i, torch.int64, zero_copy=i == 1)
    moe.destroy()


CHECKS = {"node_sizes": check_node_sizes, "idle": check_idle_step, "errors": check_errors, "layers": check_layers,
          "subgroups": check_subgroups}
