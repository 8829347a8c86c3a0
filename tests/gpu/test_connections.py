"""Simulated ranks and CUDA's work queues (CUDA_DEVICE_MAX_CONNECTIONS): SimulatedRanks refuses fewer queues than
ranks + 1, and with a queue per rank every replay of ranks captured in one graph is bitwise right. Each case is a
fresh process (CUDA reads the variable once, when it initializes). What too few queues do to the ranks is measured
by ``python -m tests.gpu.connections_probe``."""

from __future__ import annotations

import pytest

from .connections_probe import run_child, run_guard


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
