"""Simulated ranks (ep 5-8) in CUDA graphs, many workspaces in a row (tests/gpu/graph_first_replay.py): every replay's
counts, sums and error records checked. ``FLASHINFER_A2A_TEST_GRAPH_WORKSPACES`` sets how many (default 36; the
release check runs 500)."""

import os

from . import graph_first_replay


def test_graph_replays_of_simulated_ranks_complete(capsys):
    workspaces = int(os.environ.get("FLASHINFER_A2A_TEST_GRAPH_WORKSPACES", "36"))
    failed = graph_first_replay.main(["--workspaces", str(workspaces), "--seed", str(workspaces)])
    out = capsys.readouterr().out
    assert f"0 of {workspaces} workspaces failed" in out, "\n".join(l for l in out.splitlines() if "FAIL" in l)
    assert failed == 0
