"""What the GPU scripts and launchers decide, checked on CPU with each defect they once let through planted:
tests/gpu/unjoined_capture.py takes only CUDA's refusal of the unjoined fork as the capture's expected error;
tests/gpu/graph_first_replay.py poisons what a replay writes, so a replay that wrote nothing fails even where its
routing repeats; a test skipped for want of mpirun is named in the run's summary."""

from __future__ import annotations

import types

import pytest
import torch

from . import test_comm
from .gpu import graph_first_replay as replays
from .gpu.unjoined_capture import capture_refusal
from .progress import MISSING_LAUNCHER, missing_launchers


@pytest.mark.parametrize(("exc", "expected"), [
    (RuntimeError("CUDA error: capturing stream has unjoined work\nCUDA kernel errors might be asynchronously "
                  "reported"), True),
    (RuntimeError("cudaErrorStreamCaptureUnjoined"), True),
    (RuntimeError("CUDA error: operation not permitted when stream is capturing"), False),
    (RuntimeError("CUDA error: operation failed due to a previous error during capture"), False),
    (ValueError("capturing stream has unjoined work"), False),
    (RuntimeError("timed out waiting for rank 1"), False),
])
def test_only_cudas_unjoined_refusal_counts_as_the_capture_refused(exc, expected):
    """Any error of the capture once passed as the refusal expected."""
    assert capture_refusal(exc).startswith("capture refused: " if expected else "FAIL: ")


def _step(ep: int = 3, tokens: int = 6, top_k: int = 2, experts: int = 7, hidden: int = 8):
    """A correct step of ``ep`` simulated ranks, computed on the host: (host_ids, x, owners, rec, outs)."""
    gen = torch.Generator().manual_seed(0)
    owners = replays.expert_owners(experts, ep)
    host_ids = [torch.randint(0, experts, (tokens, top_k), generator=gen) for _ in range(ep)]
    x = [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(ep)]
    sent = [replays.sent_mask(ids, owners, ep) for ids in host_ids]
    counts = torch.stack([m.sum(0) for m in sent], dim=1).to(torch.int32)
    rec = [([torch.zeros(ep, tokens, hidden, dtype=torch.bfloat16)], counts[d].clone()) for d in range(ep)]
    outs = [(sent[r].sum(1, keepdim=True).float() * x[r].float()).to(torch.bfloat16) for r in range(ep)]
    return host_ids, x, owners, rec, outs


def test_a_correct_step_passes():
    host_ids, x, owners, rec, outs = _step()
    assert replays.step_problems(host_ids, x, owners, rec, outs) == []


def test_a_replay_that_wrote_nothing_fails_once_poisoned():
    """The routing and rows of the replay repeat the last step's and the replay writes nothing: without the poison
    the last step's counts and outputs pass for the replay's (the defect); poisoned, both fail."""
    host_ids, x, owners, rec, outs = _step()
    assert replays.step_problems(host_ids, x, owners, rec, outs) == []  # what a no-op replay left: passes
    replays.poison(rec, outs)
    problems = replays.step_problems(host_ids, x, owners, rec, outs)
    assert len(problems) == 2 and problems[0].startswith("recv_counts") and problems[1].startswith("combine rows")
    assert all(bool((t.view(torch.uint8) == 0xFF).all()) for recv, _ in rec for t in recv)


def test_a_missing_mpirun_is_named_in_the_summary(monkeypatch):
    monkeypatch.setattr(test_comm, "find_mpirun", lambda: None)
    with pytest.raises(pytest.skip.Exception) as info:
        test_comm.require_mpirun()
    reason = str(info.value)
    assert MISSING_LAUNCHER in reason and "mpi" in reason
    report = types.SimpleNamespace(longrepr=("tests/x.py", 1, f"Skipped: {reason}"),
                                   nodeid="tests/multigpu/test_multigpu.py::test_all_checks[2-mpirun]")
    assert missing_launchers([report]) == [f"skipped, {reason}: {report.nodeid}"]
    other = types.SimpleNamespace(longrepr=("tests/x.py", 1, "Skipped: needs a CUDA GPU"), nodeid="tests/gpu/a.py::b")
    assert missing_launchers([other]) == []
