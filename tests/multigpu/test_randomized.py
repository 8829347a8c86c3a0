"""The randomized suite (tests/multigpu/randomized.py) on real ranks: one process per GPU on 2 and on 4 GPUs, and 2
processes sharing one GPU; skipped without the GPUs. On CPU its harness runs over the nccl transport on 2 gloo
ranks (no CUDA graphs, split calls or pushed combines there). Each layout must run at least
``randomized.MIN_CASES`` random cases (all, when fewer are asked for) in its time budget, which starts after the
first case has loaded (or built) the library; how many ran is shown in the run's summary.

    pytest -q tests/multigpu/test_randomized.py
    FLASHINFER_A2A_TEST_RANDOM_CASES=500 FLASHINFER_A2A_TEST_RANDOM_SECONDS=1800 \\
        pytest -q tests/multigpu/test_randomized.py  # longer
    FLASHINFER_A2A_TEST_SEED=<printed seed> pytest -q tests/multigpu/test_randomized.py  # replays a run
"""

import os
import time

import pytest
import torch

from ..nccl_workers import spawn_gloo
from . import randomized
from .randomized import MIN_CASES, REPORT_ENV, SECONDS
from .test_multigpu import NUM_GPUS, _launch

# Cases stop starting after FLASHINFER_A2A_TEST_RANDOM_SECONDS; the rest is start-up (the JIT build included).
TIMEOUT_S = int(float(os.environ.get("FLASHINFER_A2A_TEST_RANDOM_SECONDS", SECONDS))) + 480


def check_report(report, record_counts, least: int = MIN_CASES) -> None:
    """The counts the suite's rank 0 wrote to ``report``: one layout, at least ``least`` cases (fewer only where
    fewer were asked for); each goes to the run's summary."""
    lines = report.read_text().splitlines() if report.exists() else []
    assert len(lines) == 1, f"the suite reported {lines} (one line expected: did it run?)"
    layout, count = lines[0].rsplit(": ", 1)
    asked = int(os.environ.get("FLASHINFER_A2A_TEST_RANDOM_CASES", least))
    assert int(count) >= min(least, asked), f"{layout}: {count} random cases ran, fewer than {least}"
    record_counts(f"randomized: {count} cases on {layout}")


def _run(nproc: int, tmp_path, record_counts, extra_env=None) -> None:
    report = tmp_path / "report"
    out = _launch("torchrun", nproc, ["randomized"], timeout=TIMEOUT_S,
                  extra_env={**(extra_env or {}), REPORT_ENV: str(report)})
    for rank in range(nproc):
        assert f"CHECK randomized rank {rank} ok" in out, out[-6000:]
    print("\n".join(line for line in out.splitlines() if line.startswith("randomized:")))
    check_report(report, record_counts)


@pytest.mark.parametrize("nproc", [2, 4])
def test_one_process_per_gpu(nproc, tmp_path, record_counts):
    if NUM_GPUS < nproc:
        pytest.skip(f"needs {nproc} GPUs, found {NUM_GPUS}")
    _run(nproc, tmp_path, record_counts)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_two_processes_on_one_gpu(tmp_path, record_counts):
    _run(2, tmp_path, record_counts, {"FLASHINFER_A2A_TEST_SHARED_GPU": "1"})


def test_the_harness_over_the_nccl_transport_on_cpu(tmp_path, monkeypatch, record_counts):
    report = tmp_path / "report"
    monkeypatch.setenv(REPORT_ENV, str(report))  # the spawned ranks inherit it
    spawn_gloo(["gloo"], 2, tmp_path, module="tests.multigpu.randomized")
    check_report(report, record_counts, least=randomized.GLOO_CASES)


# ------------------------------------------------------------------------------------------ planted defects


class _Comm:
    rank, size = 0, 2

    def broadcast(self, data, root=0):
        return data

    def barrier(self):
        pass


def _suite(monkeypatch, tmp_path, first_case_s: float, seconds: float, cases: int = 3) -> int:
    """run_suite on a stand-in group whose first case takes ``first_case_s`` (a build) and the others no time."""
    ran = []

    class Runner:
        def __init__(self, group, comm, case, seed, transport, device):
            pass

        def run(self):
            time.sleep(first_case_s if not ran else 0.0)
            ran.append(1)

    monkeypatch.setattr(randomized, "Runner", Runner)
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "report"))
    return randomized.run_suite(None, _Comm(), device="cpu", cases=cases, seconds=seconds, seed=1)


def test_a_build_in_the_first_case_does_not_eat_the_budget(monkeypatch, tmp_path, record_counts):
    """The budget once started before the idle case, whose first build could take all of it: no random case ran
    and the suite passed."""
    assert _suite(monkeypatch, tmp_path, first_case_s=0.5, seconds=0.3) == 3
    check_report(tmp_path / "report", lambda line: None, least=3)


def test_a_suite_that_ran_too_few_cases_fails(monkeypatch, tmp_path):
    with pytest.raises(AssertionError, match="0 cases ran in 0 s on 2 ranks, nvlink transport on cpu, fewer than 3"):
        _suite(monkeypatch, tmp_path, first_case_s=0.0, seconds=0.0)
    with pytest.raises(AssertionError, match="the suite reported"):
        check_report(tmp_path / "no_report", lambda line: None)
