"""CPU tests of flashinfer_a2a.reference against slow, independent per-token loops.

Inputs are fresh random draws each run; the seed is printed, so pytest shows it for a failing test.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from flashinfer_a2a import reference as ref

PAYLOAD_DTYPES = [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32, torch.uint8]
COMBINE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def gen() -> torch.Generator:
    seed = random.SystemRandom().randrange(2**63)
    print(f"generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------------------------------------------
# Independent slow model of the contract: explicit owner table, Python sets, per-token loops.
# ----------------------------------------------------------------------------------------------------------------


def loop_owner_table(num_experts: int, ep_size: int) -> list[int]:
    """owner[e] for every expert, built by handing out experts one rank at a time."""
    owners: list[int] = []
    for rank in range(ep_size):
        count = num_experts // ep_size + (1 if rank < num_experts % ep_size else 0)
        owners += [rank] * count
    assert len(owners) == num_experts
    return owners


def loop_token_ranks(ids: torch.Tensor, num_experts: int, ep_size: int) -> list[list[int]]:
    """Sorted distinct destination ranks of each token."""
    owners = loop_owner_table(num_experts, ep_size)
    return [sorted({owners[e] for e in row if e != -1}) for row in ids.tolist()]


def loop_routing(topk_ids: list[torch.Tensor], num_experts: int) -> list[list[dict[int, int]]]:
    """route[src][t] maps destination rank -> slot of token t of src in that rank's block from src."""
    ep_size = len(topk_ids)
    routes = []
    for ids in topk_ids:
        next_slot = [0] * ep_size
        per_token = []
        for ranks in loop_token_ranks(ids, num_experts, ep_size):
            slots = {}
            for d in ranks:
                slots[d] = next_slot[d]
                next_slot[d] += 1
            per_token.append(slots)
        routes.append(per_token)
    return routes


def loop_dispatch_rows(topk_ids, payloads, num_experts):
    """rows[d][p][src]: list of source token indices' byte rows received by d from src, in order."""
    ep_size = len(topk_ids)
    routes = loop_routing(topk_ids, num_experts)
    rows = [[[[] for _ in range(ep_size)] for _ in payloads[0]] for _ in range(ep_size)]
    for src in range(ep_size):
        for t, slots in enumerate(routes[src]):
            for d in slots:
                for p, payload in enumerate(payloads[src]):
                    rows[d][p][src].append(payload[t].contiguous().reshape(-1).view(torch.uint8))
    return rows


def loop_combine(partials, topk_ids, num_experts, out_dtype):
    ep_size = len(topk_ids)
    routes = loop_routing(topk_ids, num_experts)
    hidden = partials[0].shape[2]
    outs = []
    for r in range(ep_size):
        out = torch.empty(len(routes[r]), hidden, dtype=out_dtype)
        for t, slots in enumerate(routes[r]):
            acc = torch.zeros(hidden, dtype=torch.float32)
            for d in sorted(slots):
                acc = acc + partials[d][r, slots[d]].float()
            out[t] = acc.to(out_dtype)
        outs.append(out)
    return outs


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def make_case(gen, ep_size, num_experts, top_k, max_tokens, *, dtype=torch.int32, zero_ranks=(), **routing):
    """Random per-rank topk_ids; ranks in zero_ranks get no tokens."""
    topk_ids = []
    for rank in range(ep_size):
        n = 0 if rank in zero_ranks else int(torch.randint(0, max_tokens + 1, (), generator=gen))
        topk_ids.append(ref.random_topk_ids(n, top_k, num_experts, dtype=dtype, generator=gen, **routing))
    return topk_ids


def make_payloads(gen, topk_ids, specs):
    """specs: list of (trailing shape, dtype); random bytes per row."""
    return [
        [ref.random_payload(ids.shape[0], shape, dtype, generator=gen) for shape, dtype in specs] for ids in topk_ids
    ]


def assert_dispatch_matches_loop(result, topk_ids, payloads, num_experts, runtime_max):
    ep_size = len(topk_ids)
    expected = loop_dispatch_rows(topk_ids, payloads, num_experts)
    for d in range(ep_size):
        counts = [len(expected[d][0][src]) for src in range(ep_size)]
        assert result.recv_counts[d].dtype == torch.int32
        assert result.recv_counts[d].tolist() == counts, f"rank {d}"
        for p, recv in enumerate(result.recv_payloads[d]):
            assert recv.dtype == payloads[0][p].dtype
            assert recv.shape == (ep_size, runtime_max, *payloads[0][p].shape[1:])
            recv_bytes = recv.contiguous().reshape(ep_size, runtime_max, -1).view(torch.uint8)
            for src in range(ep_size):
                for slot, row in enumerate(expected[d][p][src]):
                    assert torch.equal(recv_bytes[src, slot], row), f"dst {d} payload {p} src {src} slot {slot}"
                assert bool((recv_bytes[src, counts[src]:] == ref.POISON_BYTE).all()), "poison rows"


# ----------------------------------------------------------------------------------------------------------------
# Expert -> rank
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_experts,ep_size", [(10, 4), (3, 8), (8, 1), (7, 7), (256, 8), (256, 72), (512, 72), (5, 72), (128, 3)]
)
def test_expert_to_rank_matches_owner_table(num_experts, ep_size):
    owners = loop_owner_table(num_experts, ep_size)
    for dtype in (torch.int32, torch.int64):
        ids = torch.tensor([[e] for e in [-1, *range(num_experts)]], dtype=dtype)
        ranks = ref.expert_to_rank(ids, num_experts, ep_size)
        assert ranks.dtype == torch.int64 and ranks.shape == ids.shape
        assert ranks[:, 0].tolist() == [-1, *owners]
    for rank in range(ep_size):
        first, end = ref.rank_expert_range(rank, num_experts, ep_size)
        assert list(range(first, end)) == [e for e, o in enumerate(owners) if o == rank]


def test_non_divisible_partition_explicit():
    ids = torch.arange(10).reshape(1, 10)
    assert ref.expert_to_rank(ids, 10, 4).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, 3, 3]]
    assert [ref.rank_expert_range(r, 10, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    # Fewer experts than ranks: ranks 3..7 own nothing.
    assert ref.expert_to_rank(torch.tensor([[0, 1, 2]]), 3, 8).tolist() == [[0, 1, 2]]
    assert [ref.rank_expert_range(r, 3, 8) for r in range(3, 8)] == [(3, 3)] * 5


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("bad", [-2, 10, 11, -(2**31), 2**31 - 1])
def test_invalid_ids_raise(dtype, bad):
    ids = torch.tensor([[0, 1], [2, bad], [-1, 9]], dtype=dtype)
    with pytest.raises(ValueError, match=rf"topk_ids contains expert id {bad}\b.*0\.\.9"):
        ref.expert_to_rank(ids, 10, 4)
    with pytest.raises(ValueError, match=rf"topk_ids\[1\] contains expert id {bad}\b"):
        ref.reference_dispatch([ids[:1], ids], [[torch.zeros(1, 4)], [torch.zeros(3, 4)]], 10, 8)


def test_bad_arguments_raise():
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="int32 or int64"):
        ref.expert_to_rank(ids.to(torch.int16), 8, 2)
    with pytest.raises(ValueError, match="top_k"):
        ref.expert_to_rank(torch.zeros(2, 33, dtype=torch.int32), 8, 2)
    with pytest.raises(ValueError, match="ep_size"):
        ref.expert_to_rank(ids, 8, 73)
    with pytest.raises(ValueError, match="ep_size"):
        ref.expert_to_rank(ids, 8, 0)
    with pytest.raises(ValueError, match="rank"):
        ref.rank_expert_range(4, 8, 4)


# ----------------------------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ep_size,num_experts,top_k,distinct,minus_one_frac",
    [
        (1, 8, 2, True, 0.0),
        (2, 8, 2, True, 0.0),
        (4, 10, 3, True, 0.2),
        (4, 10, 6, False, 0.1),
        (8, 3, 2, False, 0.3),
        (8, 256, 8, True, 0.0),
        (5, 64, 32, True, 0.1),
        (72, 256, 8, True, 0.05),
    ],
)
def test_dispatch_matches_loop(gen, ep_size, num_experts, top_k, distinct, minus_one_frac):
    max_tokens = 4 if ep_size > 8 else 24
    runtime_max = max_tokens + 3
    topk_ids = make_case(
        gen, ep_size, num_experts, top_k, max_tokens, zero_ranks={ep_size - 1}, distinct=distinct,
        minus_one_frac=minus_one_frac,
    )
    specs = [((16,), torch.bfloat16), ((top_k,), torch.int32), ((top_k,), torch.float32), ((), torch.uint8)]
    payloads = make_payloads(gen, topk_ids, specs)
    result = ref.reference_dispatch(topk_ids, payloads, num_experts, runtime_max)
    assert_dispatch_matches_loop(result, topk_ids, payloads, num_experts, runtime_max)


@pytest.mark.parametrize("dtype", PAYLOAD_DTYPES)
@pytest.mark.parametrize("trailing", [(), (7,), (3, 5), (128,)])
def test_payload_dtypes_copied_bitwise(gen, dtype, trailing):
    topk_ids = make_case(gen, 4, 16, 4, 12, minus_one_frac=0.1)
    payloads = make_payloads(gen, topk_ids, [(trailing, dtype)])
    result = ref.reference_dispatch(topk_ids, payloads, 16, 12)
    assert_dispatch_matches_loop(result, topk_ids, payloads, 16, 12)


def test_packed_fp4_payload_copied_bitwise(gen):
    fp4 = getattr(torch, "float4_e2m1fn_x2", None)
    if fp4 is None:
        pytest.skip("torch has no float4_e2m1fn_x2")
    topk_ids = make_case(gen, 3, 9, 2, 10)
    payloads = [
        [torch.randint(0, 256, (ids.shape[0], 32), dtype=torch.uint8, generator=gen).view(fp4)] for ids in topk_ids
    ]
    result = ref.reference_dispatch(topk_ids, payloads, 9, 10)
    assert result.recv_payloads[0][0].dtype == fp4
    assert_dispatch_matches_loop(result, topk_ids, payloads, 9, 10)


def test_dispatch_dedup_and_skip_explicit():
    # 8 experts on 2 ranks: rank 0 owns 0..3, rank 1 owns 4..7.
    ids0 = torch.tensor([[0, 1], [-1, -1], [5, 2], [7, 6], [3, -1]])
    ids1 = torch.tensor([[4, 4], [1, 3]])
    hidden0 = torch.arange(5, dtype=torch.float32).unsqueeze(1) + 10
    hidden1 = torch.arange(2, dtype=torch.float32).unsqueeze(1) + 20
    result = ref.reference_dispatch([ids0, ids1], [[hidden0], [hidden1]], 8, 6)
    assert result.recv_counts[0].tolist() == [3, 1]  # tokens 0, 2, 4 of rank 0 (token 0 once); token 1 of rank 1
    assert result.recv_counts[1].tolist() == [2, 1]  # tokens 2, 3 of rank 0; token 0 of rank 1 (once)
    assert result.recv_payloads[0][0][0, :3, 0].tolist() == [10, 12, 14]
    assert result.recv_payloads[0][0][1, :1, 0].tolist() == [21]
    assert result.recv_payloads[1][0][0, :2, 0].tolist() == [12, 13]
    assert result.recv_payloads[1][0][1, :1, 0].tolist() == [20]
    assert result.send_slots[0].tolist() == [[0, -1], [-1, -1], [1, 0], [-1, 1], [2, -1]]
    assert result.send_slots[1].tolist() == [[-1, 0], [0, -1]]
    assert torch.isnan(result.recv_payloads[0][0][0, 3:]).all()  # poison is NaN for float payloads


def test_dispatch_zero_tokens(gen):
    topk_ids = make_case(gen, 4, 16, 4, 10, zero_ranks={0, 2})
    payloads = make_payloads(gen, topk_ids, [((8,), torch.bfloat16)])
    result = ref.reference_dispatch(topk_ids, payloads, 16, 10)
    for d in range(4):
        assert result.recv_counts[d][0] == 0 and result.recv_counts[d][2] == 0
    assert_dispatch_matches_loop(result, topk_ids, payloads, 16, 10)

    empty = [torch.empty(0, 2, dtype=torch.int64)] * 3
    result = ref.reference_dispatch(empty, [[torch.empty(0, 4)]] * 3, 6, 0)
    assert all(counts.tolist() == [0, 0, 0] for counts in result.recv_counts)
    assert result.recv_payloads[1][0].shape == (3, 0, 4)


def test_int32_and_int64_ids_identical(gen):
    ids64 = make_case(gen, 4, 10, 4, 16, dtype=torch.int64, minus_one_frac=0.2, distinct=False)
    ids32 = [ids.to(torch.int32) for ids in ids64]
    payloads = make_payloads(gen, ids64, [((6,), torch.bfloat16), ((), torch.int32)])
    a = ref.reference_dispatch(ids64, payloads, 10, 16)
    b = ref.reference_dispatch(ids32, payloads, 10, 16)
    for d in range(4):
        assert torch.equal(a.recv_counts[d], b.recv_counts[d])
        assert torch.equal(a.send_slots[d], b.send_slots[d])
        for pa, pb in zip(a.recv_payloads[d], b.recv_payloads[d]):
            assert ref.bitwise_equal(pa, pb)
    partials = random_partials(gen, 4, 16, 8, torch.bfloat16)
    for x, y in zip(ref.reference_combine(partials, ids64, 10), ref.reference_combine(partials, ids32, 10)):
        assert ref.bitwise_equal(x, y)


def test_runtime_max_exceeded_raises():
    ids = [torch.zeros(3, 1, dtype=torch.int32), torch.zeros(5, 1, dtype=torch.int32)]
    payloads = [[torch.zeros(3, 2)], [torch.zeros(5, 2)]]
    with pytest.raises(ValueError, match=r"rank 1 has num_tokens=5 > runtime_max_tokens_per_rank=4"):
        ref.reference_dispatch(ids, payloads, 4, 4)
    ref.reference_dispatch(ids, payloads, 4, 5)
    with pytest.raises(ValueError, match=r"rank 1 has num_tokens=5 > runtime_max_tokens_per_rank=4"):
        ref.reference_combine([torch.zeros(2, 4, 3)] * 2, ids, 4)


def test_dispatch_inconsistent_payloads_raise():
    ids = [torch.zeros(2, 1, dtype=torch.int32)] * 2
    with pytest.raises(ValueError, match=r"payloads\[1\]\[0\]"):
        ref.reference_dispatch(ids, [[torch.zeros(2, 4)], [torch.zeros(2, 5)]], 4, 2)
    with pytest.raises(ValueError, match=r"payloads\[1\]\[0\]"):
        ref.reference_dispatch(ids, [[torch.zeros(2, 4)], [torch.zeros(3, 4)]], 4, 2)
    with pytest.raises(ValueError, match="1..8"):
        ref.reference_dispatch(ids, [[torch.zeros(2)] * 9] * 2, 4, 2)


# ----------------------------------------------------------------------------------------------------------------
# Combine
# ----------------------------------------------------------------------------------------------------------------


def random_partials(gen, ep_size, runtime_max, hidden, dtype):
    return [(torch.randn(ep_size, runtime_max, hidden, generator=gen) * 100).to(dtype) for _ in range(ep_size)]


@pytest.mark.parametrize("dtype", COMBINE_DTYPES)
@pytest.mark.parametrize("out_dtype", [None, *COMBINE_DTYPES])
@pytest.mark.parametrize("ep_size,num_experts,top_k", [(1, 4, 2), (4, 10, 4), (8, 16, 8), (6, 3, 3)])
def test_combine_matches_loop(gen, dtype, out_dtype, ep_size, num_experts, top_k):
    runtime_max, hidden = 12, 24
    topk_ids = make_case(gen, ep_size, num_experts, top_k, runtime_max, zero_ranks={0}, minus_one_frac=0.15)
    partials = random_partials(gen, ep_size, runtime_max, hidden, dtype)
    expected = loop_combine(partials, topk_ids, num_experts, out_dtype or dtype)
    result = ref.reference_dispatch(topk_ids, [[ids] for ids in topk_ids], num_experts, runtime_max)
    from_dispatch = ref.reference_combine(partials, result, out_dtype=out_dtype)
    from_ids = ref.reference_combine(partials, topk_ids, num_experts, out_dtype=out_dtype)
    for r in range(ep_size):
        assert from_dispatch[r].shape == (topk_ids[r].shape[0], hidden)
        assert ref.bitwise_equal(from_dispatch[r], expected[r]), f"rank {r}"
        assert ref.bitwise_equal(from_ids[r], expected[r]), f"rank {r}"


def three_rank_case(values, dtype):
    """One token on rank 0 routed to ranks 0, 1, 2 (3 experts, 1 each); partial on rank d is values[d]."""
    topk_ids = [torch.tensor([[0, 1, 2]]), torch.empty(0, 3, dtype=torch.int64), torch.empty(0, 3, dtype=torch.int64)]
    partials = [torch.full((3, 1, 1), v, dtype=dtype) for v in values]
    return partials, topk_ids


def test_combine_accumulates_in_fp32_not_bf16():
    # 2^20 + 1 is exact in fp32 but rounds to 2^20 in bf16 (8 significand bits).
    partials, topk_ids = three_rank_case([2.0**20, 1.0, -(2.0**20)], torch.bfloat16)
    (out, _, _) = ref.reference_combine(partials, topk_ids, 3)
    assert out.item() == 1.0
    bf16_acc = torch.zeros((), dtype=torch.bfloat16)
    for p in partials:
        bf16_acc = bf16_acc + p[0, 0, 0]
    assert bf16_acc.item() == 0.0  # the value an implementation summing in bf16 would produce


def test_combine_sums_in_increasing_rank_order():
    # In fp32, 2^30 + 1 rounds back to 2^30, so the order decides whether the 1 survives.
    values = [2.0**30, 1.0, -(2.0**30)]
    partials, topk_ids = three_rank_case(values, torch.float32)
    (out, _, _) = ref.reference_combine(partials, topk_ids, 3)
    assert out.item() == 0.0  # ((0 + 2^30) + 1) - 2^30
    f = torch.tensor(values, dtype=torch.float32)
    assert ((f[0] + f[2]) + f[1]).item() == 1.0  # another order differs


def test_combine_starts_from_positive_zero():
    # A token whose only partial is -0.0 yields +0.0: the accumulator starts at +0.0 and +0.0 + -0.0 == +0.0.
    partials, topk_ids = three_rank_case([-0.0, -0.0, -0.0], torch.float32)
    (out, _, _) = ref.reference_combine(partials, topk_ids, 3)
    assert math.copysign(1.0, out.item()) == 1.0


def test_combine_identity_expert_counts_distinct_ranks(gen):
    ep_size, num_experts, runtime_max, hidden = 4, 10, 20, 32
    topk_ids = make_case(gen, ep_size, num_experts, 6, runtime_max, distinct=False, minus_one_frac=0.2)
    # Small integers: every sum is exact in bf16 and fp32, so the expectation needs no rounding model.
    hiddens = [torch.randint(-8, 9, (ids.shape[0], hidden), generator=gen).to(torch.bfloat16) for ids in topk_ids]
    result = ref.reference_dispatch(topk_ids, [[h] for h in hiddens], num_experts, runtime_max)
    # Identity expert: each rank returns what it received (poison rows included; combine must not read them).
    partials = [recv[0] for recv in result.recv_payloads]
    outs = ref.reference_combine(partials, result)
    for r in range(ep_size):
        counts = torch.tensor([len(ranks) for ranks in loop_token_ranks(topk_ids[r], num_experts, ep_size)])
        expected = hiddens[r].float() * counts.unsqueeze(1)
        assert torch.equal(outs[r].float(), expected), f"rank {r}"
        assert (outs[r][counts == 0] == 0).all()


def test_combine_rejects_mismatched_partials():
    ids = [torch.zeros(1, 1, dtype=torch.int32)] * 2
    result = ref.reference_dispatch(ids, [[torch.zeros(1, 4)]] * 2, 2, 3)
    with pytest.raises(ValueError, match="runtime_max"):
        ref.reference_combine([torch.zeros(2, 4, 4)] * 2, result)
    with pytest.raises(ValueError, match=r"partials\[1\]"):
        ref.reference_combine([torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)], result)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        ref.reference_combine([torch.zeros(2, 3, 4, dtype=torch.int32)] * 2, result)
    with pytest.raises(ValueError, match="num_experts"):
        ref.reference_combine([torch.zeros(2, 3, 4)] * 2, ids)


# ----------------------------------------------------------------------------------------------------------------
# Sanitize
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_sanitize_fills_exactly_invalid_rows(gen, dtype):
    ep_size, runtime_max, top_k, invalid_id = 5, 9, 4, 1 << 20
    recv = torch.randint(0, 64, (ep_size, runtime_max, top_k), generator=gen, dtype=dtype)
    counts = torch.randint(0, runtime_max + 1, (ep_size,), generator=gen, dtype=torch.int32)
    counts[0], counts[1] = 0, runtime_max
    out = ref.reference_sanitize(recv, counts, invalid_id)
    assert out.dtype == dtype and out.shape == recv.shape
    for src in range(ep_size):
        for slot in range(runtime_max):
            if slot < counts[src]:
                assert torch.equal(out[src, slot], recv[src, slot])
            else:
                assert (out[src, slot] == invalid_id).all()
    assert not (recv == invalid_id).any()  # input untouched


def test_sanitize_rejects_bad_arguments():
    with pytest.raises(ValueError, match="does not fit"):
        ref.reference_sanitize(torch.zeros(2, 3, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), 2**31)
    with pytest.raises(ValueError, match="recv_counts"):
        ref.reference_sanitize(torch.zeros(2, 3, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), -1)


# ----------------------------------------------------------------------------------------------------------------
# Random inputs
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_random_topk_ids_distinct_and_in_range(gen, dtype):
    ids = ref.random_topk_ids(500, 8, 16, dtype=dtype, generator=gen)
    assert ids.dtype == dtype and ids.shape == (500, 8)
    assert int(ids.min()) >= 0 and int(ids.max()) < 16
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert ref.random_topk_ids(0, 4, 16, generator=gen).shape == (0, 4)


def test_random_topk_ids_minus_one_and_skew(gen):
    ids = ref.random_topk_ids(4000, 4, 64, generator=gen, minus_one_frac=0.25)
    frac = (ids == -1).float().mean().item()
    assert 0.2 < frac < 0.3
    hot = ref.random_topk_ids(7, 3, 64, generator=gen, skew=math.inf)
    assert hot.tolist() == [[0, 1, 2]] * 7
    assert ref.random_topk_ids(5, 3, 64, generator=gen, skew=math.inf, distinct=False).tolist() == [[0, 0, 0]] * 5
    skewed = ref.random_topk_ids(2000, 2, 64, generator=gen, skew=1.5)
    assert (skewed < 8).float().mean() > 0.5  # Zipf(1.5) puts most mass on the first experts
    assert all(len(set(row)) == 2 for row in skewed.tolist())
    with pytest.raises(ValueError, match="num_experts >= top_k"):
        ref.random_topk_ids(1, 9, 8)
