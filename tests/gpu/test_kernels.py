"""Dispatch, combine and sanitize on simulated ranks against the reference: rows and counts exact, combine bitwise."""

import random

import pytest
import torch

from .cases import Case, run_case

TOP_KS = (1, 2, 4, 6, 8, 9, 16)
HIDDENS = (128, 2880, 4096, 7168, 7169)  # 7169 bf16: rows of 14338 bytes, not a multiple of 16


@pytest.mark.parametrize("ep_size", (1, 2, 4, 8))
@pytest.mark.parametrize("top_k", TOP_KS)
def test_matrix(ep_size, top_k):
    rng = random.Random()
    hidden = HIDDENS[(ep_size + top_k) % len(HIDDENS)]
    num_experts = max(top_k, ep_size) * rng.choice((1, 2, 4)) + rng.choice((0, 1, 3))  # often not divisible
    runtime_max = rng.choice((1, 7, 64, 300))
    tokens = [rng.randint(0, runtime_max) for _ in range(ep_size)]
    tokens[rng.randrange(ep_size)] = 0 if ep_size > 1 else tokens[0]
    case = Case(ep_size, top_k, hidden, num_experts, tokens, runtime_max,
                id_dtype=rng.choice((torch.int32, torch.int64)), minus_one_frac=rng.choice((0.0, 0.2)),
                distinct=rng.random() < 0.7, zero_copy=rng.random() < 0.5, caller_out=rng.random() < 0.5)
    run_case(case)


@pytest.mark.parametrize("hidden", HIDDENS)
@pytest.mark.parametrize("combine_dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_hidden_sizes(hidden, combine_dtype):
    run_case(Case(4, 8, hidden, 64, [33, 0, 128, 5], 128, combine_dtype=combine_dtype))


def test_all_tokens_to_one_expert():
    run_case(Case(8, 4, 4096, 64, [256] * 8, 256, skew=float("inf")))


def test_several_experts_of_a_token_on_one_rank():
    # 16 experts on 8 ranks, top-8: most tokens have 2+ experts on some rank, each rank receives them once.
    run_case(Case(8, 8, 2880, 16, [100, 3, 77, 0, 1, 64, 99, 100], 100, id_dtype=torch.int64))


@pytest.mark.parametrize("num_payloads", range(1, 9))
def test_payload_counts_and_dtypes(num_payloads):
    extras = [((128,), torch.float8_e4m3fn), ((56,), torch.float32), ((1,), torch.int32), ((7,), torch.uint8),
              ((3, 5), torch.float16), ((), torch.float32)]
    # hidden first, then topk ids, then extras
    case = Case(4, 6, 2880, 32, [17, 64, 0, 40], 64, extra_payloads=extras[: max(num_payloads - 2, 0)],
                with_ids=num_payloads >= 2)
    run_case(case)


def test_small_rows_grouped():
    # Enough tokens that blocks own several each (kSmallGroupMinTokens): the ids and the small extra payloads are
    # copied a group of tokens per warp, in 16-, 4- and 1-byte vectors; the rank with fewer tokens takes the per-token
    # copy in the same exchange.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 6 * sms + 5
    extras = [((128,), torch.float8_e4m3fn), ((56,), torch.float32), ((1,), torch.int32), ((7,), torch.uint8),
              ((3, 5), torch.float16)]
    for id_dtype in (torch.int32, torch.int64):
        run_case(Case(4, 8, 256, 64, [n, 0, 4 * sms, 2 * sms + 1], n, id_dtype=id_dtype, extra_payloads=extras,
                      minus_one_frac=0.2))


def test_long_dispatches():
    # Thousands of tokens: a chunk late in the grid counts several tiles of 512 tokens before it; ranks with fewer
    # tokens in the same exchange, int64 and int32 ids on one workspace.
    sim = None
    for id_dtype in (torch.int64, torch.int32):
        sim = run_case(Case(4, 8, 256, 64, [3000, 700, 0, 1025], 3000, id_dtype=id_dtype, minus_one_frac=0.2),
                       sim=sim)
    # Eight ranks of 2100 tokens: their grids cannot all be resident at once.
    run_case(Case(8, 8, 128, 64, [2100] * 8, 2100, extra_payloads=[((56,), torch.float32)]))


def test_expert_count_below_ep_size():
    run_case(Case(8, 2, 128, 3, [10, 20, 30, 40, 0, 1, 2, 3], 40))


def test_workspace_reused_across_many_rounds():
    sim = run_case(Case(4, 8, 1024, 32, [50, 50, 50, 50], 64))
    for _ in range(5):
        rng = random.Random()
        run_case(Case(4, 8, 1024, 32, [rng.randint(0, 64) for _ in range(4)], 64), sim=sim)


# (2, [200, 1]): rank 0's pull is too big for one kernel, rank 1's is not; each rank chooses for itself.
@pytest.mark.parametrize("ep_size,tokens,hidden", [(1, [9], 7168), (2, [1, 0], 7168), (2, [4, 3], 7169),
                                                   (4, [16, 0, 5, 16], 2880), (2, [200, 1], 7168)])
def test_one_kernel_combine(ep_size, tokens, hidden):
    # At most a wave of blocks per rank: every rank's blocks fit on the GPU together, so simulated ranks cannot
    # starve each other (what one_gpu_per_rank otherwise promises).
    case = Case(ep_size, 8, hidden, 16 * ep_size, tokens, max(tokens), zero_copy=True, caller_out=True,
                one_gpu_per_rank=True)
    sim = run_case(case)
    for _ in range(2):  # the epochs advance inside the one kernel too
        run_case(case, sim=sim)
