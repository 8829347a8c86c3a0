"""Simulated ranks need a CUDA work queue each (CUDA_DEVICE_MAX_CONNECTIONS): with one queue the ranks' kernels
run one after another and the first rank's wait for its peer times out; with enough queues every call is bitwise
right; and SimulatedRanks refuses too few queues instead of timing out. Each case is a fresh process (CUDA reads the
variable once, when it initializes)."""

from __future__ import annotations

import pytest

from .connections_probe import run_child, run_guard


@pytest.mark.parametrize("ep_size, mode", [(2, "eager"), (2, "graph"), (4, "graph")])
def test_one_queue_serializes_the_ranks_into_a_recorded_timeout(ep_size, mode):
    result = run_child(1, ep_size, mode, replays=2)
    assert "crashed" not in result, result
    assert result["errors"], result  # recorded by the kernels (A2AError), not a hang
    assert result["first_bad_call"] == 0, result


@pytest.mark.parametrize("ep_size", (2, 4, 8))
def test_a_queue_per_rank_passes_every_replay(ep_size):
    result = run_child(32, ep_size, "graph", replays=5, seed=ep_size)
    assert "crashed" not in result, result
    assert not result["errors"] and not result["wrong"], result


def test_simulated_ranks_refuse_too_few_queues():
    refused = run_guard(4, 4)["refused"]
    assert refused and "CUDA_DEVICE_MAX_CONNECTIONS" in refused and "ep_size=4" in refused
    assert run_guard(5, 4)["refused"] is None  # 4 ranks + the launching stream
    assert run_guard(None, 8)["refused"]  # CUDA's default, 8 queues, is one short for 8 ranks
    assert run_guard(None, 7)["refused"] is None
