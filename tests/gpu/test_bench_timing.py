"""The benchmark's graph-mode clock on a GPU: every captured iteration runs once per replay, the last replay is the
one timed, and the samples have the layout the report reads (per phase, or one per group of whole pairs)."""

import pytest
import torch

from flashinfer_a2a.bench import timing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _counting_ranks(n: int):
    """n ranks, each on a stream of its own, whose phases add 1 to their own slot of a device counter; the
    combine also scales a scratch buffer, so that a pair's time is never zero."""
    counts = torch.zeros(n, 2, dtype=torch.int64, device="cuda")
    scratch = torch.zeros(1 << 16, device="cuda")
    ranks = []
    for r in range(n):
        def dispatch(r=r):
            counts[r, 0] += 1

        def combine(r=r):
            scratch.mul_(0.5)
            counts[r, 1] += 1

        ranks.append(timing.RankSteps(dispatch, combine, torch.cuda.Stream()))
    return ranks, counts


@pytest.mark.parametrize("split, group", [(True, 1), (False, 1), (False, 4)])
def test_graph_mode_replays_every_iteration_and_times_the_last_replay(split, group):
    ranks, counts = _counting_ranks(2)
    warmup, iters = 3, 10
    result = timing.time_loop(ranks, iters, warmup, graph=True, barrier=lambda: None, split=split, group=group)
    warmup, iters = timing.whole_groups(warmup, group), timing.whole_groups(iters, group)
    torch.cuda.synchronize()
    # Capture launches nothing; each replay runs every iteration, warm-up included, on every rank.
    assert counts.cpu().tolist() == [[timing.GRAPH_REPLAYS * (warmup + iters)] * 2] * 2
    samples = iters // group
    assert result.gpu_us.shape == (2, samples, 2 if split else 1)
    assert result.host_us is None
    assert bool((result.gpu_us >= 0).all()) and bool((result.gpu_us.sum(-1) > 0).all())


def test_eager_mode_runs_each_iteration_once_and_times_the_host():
    ranks, counts = _counting_ranks(2)
    result = timing.time_loop(ranks, 6, 2, graph=False, barrier=lambda: None)
    torch.cuda.synchronize()
    assert counts.cpu().tolist() == [[8, 8]] * 2
    assert result.gpu_us.shape == (2, 6, 2) and result.host_us.shape == (2, 6, 2)
    assert bool((result.gpu_us >= 0).all()) and bool((result.gpu_us.sum(-1) > 0).all())
    assert bool((result.host_us > 0).all())
