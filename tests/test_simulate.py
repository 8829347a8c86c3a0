"""Simulated ranks refuse to share CUDA work queues: CUDA_DEVICE_MAX_CONNECTIONS read through config (CUDA's
variable, not in ENV_VARS), checked before anything is allocated, and set by the benchmark for its own simulated
ranks unless the user set it. The GPU side (a queue shared means a timeout) is tests/gpu/test_connections.py."""

from __future__ import annotations

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import config
from flashinfer_a2a.bench.main import main as bench_main
from flashinfer_a2a.simulate import SimulatedRanks, check_stream_queues

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"


def _unset(monkeypatch):
    monkeypatch.setenv(VAR, "1")  # recorded, so the value the session had comes back afterwards
    monkeypatch.delenv(VAR)


def test_connections_are_cudas_default_when_unset(monkeypatch):
    _unset(monkeypatch)
    assert config.cuda_device_max_connections() == 8
    assert VAR not in {v.name for v in config.ENV_VARS}  # CUDA's, documented with SimulatedRanks, not ours
    check_stream_queues(7)
    with pytest.raises(ValueError, match=r"ep_size=8 ranks need 9 concurrent CUDA work queues .* gives 8.*"
                                         r"set CUDA_DEVICE_MAX_CONNECTIONS=9"):
        check_stream_queues(8)


@pytest.mark.parametrize("value, ok, refused", [("4", 3, 4), ("32", 31, 32), ("100", 31, 32), (" 12 ", 11, 12)])
def test_connections_bound_the_simulated_ranks(monkeypatch, value, ok, refused):
    monkeypatch.setenv(VAR, value)
    check_stream_queues(ok)
    with pytest.raises(ValueError, match=f"ep_size={refused} ranks"):
        check_stream_queues(refused)
    if refused == 32:
        with pytest.raises(ValueError, match="at most 31 ranks can be simulated on one GPU"):
            check_stream_queues(refused)


@pytest.mark.parametrize("value", ["eight", "0", "-3"])
def test_a_malformed_value_names_the_variable(monkeypatch, value):
    monkeypatch.setenv(VAR, value)
    with pytest.raises(ValueError, match=f"CUDA_DEVICE_MAX_CONNECTIONS='{value}': expected an integer >= 1"):
        config.cuda_device_max_connections()


def test_simulated_ranks_refuse_before_allocating(monkeypatch):
    monkeypatch.setenv(VAR, "2")
    cfg = fa.WorkspaceConfig(ep_size=2, max_num_tokens=4, top_k=1, dispatch_bytes_per_token=16,
                             combine_bytes_per_token=16)

    def no_allocation(*args, **kwargs):
        raise AssertionError("allocated before the queue check")

    monkeypatch.setattr(torch.cuda, "Stream", no_allocation)
    monkeypatch.setattr("flashinfer_a2a.simulate.F.empty_workspace", no_allocation)
    with pytest.raises(ValueError, match="ep_size=2 ranks need 3 concurrent CUDA work queues"):
        SimulatedRanks(cfg, "cpu")


def test_request_keeps_the_users_value(monkeypatch):
    _unset(monkeypatch)
    assert config.request_cuda_connections(64) == 32 and config.cuda_device_max_connections() == 32
    monkeypatch.setenv(VAR, "12")
    assert config.request_cuda_connections(32) == 12


def test_the_benchmark_sets_the_queues_before_cuda_when_not_launched(monkeypatch):
    _unset(monkeypatch)
    for name in config.LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # stops main right after, as on a CPU machine
    assert bench_main(["--quiet"]) == 1
    assert config.cuda_device_max_connections() == 32
    _unset(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "2")  # launched ranks are one per process: the benchmark leaves CUDA alone
    assert bench_main(["--quiet"]) == 1
    assert config.cuda_device_max_connections() == 8
