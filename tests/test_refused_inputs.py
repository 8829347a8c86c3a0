"""Arguments of the wrong kind get a TypeError that names them, before any launch, on every path: the functional API
and its split halves, MoeAlltoAll's eager calls (the bound C++ entries) and split halves, the FlashInfer-compatible
layer, the nccl transport; and a refused call moves nothing (the call order, the pending dispatch). On CPU: one
simulated rank, and one spawned gloo rank for the nccl transport."""

from __future__ import annotations

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import MoeAlltoAll, split_phase
from flashinfer_a2a.memory import shared_workspace
from flashinfer_a2a.compat import flashinfer as fi
from flashinfer_a2a.testing.simulated_group import SimulatedGroup

from .comm_workers import expect_raises
from .nccl_workers import spawn_gloo

pytestmark = pytest.mark.usefixtures("a2a_env")

HIDDEN, TOP_K, EXPERTS, MAX_TOKENS = 64, 2, 4, 16
CONFIG = fa.WorkspaceConfig(ep_size=1, max_num_tokens=MAX_TOKENS, top_k=TOP_K, dispatch_bytes_per_token=4 * HIDDEN,
                            combine_bytes_per_token=2 * HIDDEN)

# (topk_ids, payloads) from valid ones -> the message
BAD_DISPATCH = [
    (lambda ids, x: (ids, [None]), r"payloads\[0\] must be a torch.Tensor, got NoneType"),
    (lambda ids, x: (ids, [None, x]), r"payloads\[0\] must be a torch.Tensor, got NoneType"),
    (lambda ids, x: (ids, [x, "x"]), r"payloads\[1\] must be a torch.Tensor, got str"),
    (lambda ids, x: (None, [x]), "topk_ids must be a torch.Tensor, got NoneType"),
    (lambda ids, x: (ids.tolist(), [x]), "topk_ids must be a torch.Tensor, got list"),
    (lambda ids, x: (ids, x), "payloads must be a list or tuple of tensors, got Tensor"),
]
# combine keywords -> the message
BAD_COMBINE = [
    (dict(out="x"), "out must be a torch.Tensor or None, got str"),
    (dict(partials="x"), "partials must be a torch.Tensor or None, got str"),
    (dict(partials=[[0.0] * HIDDEN]), "partials must be a torch.Tensor or None, got list"),
]


def _inputs(tokens: int = 3):
    return torch.zeros(tokens, TOP_K, dtype=torch.int32), torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)


def _refused(call, match: str, *args, **kwargs) -> None:
    with pytest.raises(TypeError, match=match) as info:
        call(*args, **kwargs)
    assert "Check failed" not in str(info.value)


@pytest.mark.parametrize("bad, match", BAD_DISPATCH)
def test_functional_dispatch_and_its_send_half(bad, match):
    workspace = fa.functional.empty_workspace(1, CONFIG.bytes_per_rank, "cpu")
    args = bad(*_inputs())
    _refused(fa.dispatch, match, workspace, 0, CONFIG, *args, MAX_TOKENS, EXPERTS)
    _refused(split_phase.dispatch_send, match, workspace, 0, CONFIG, *args, MAX_TOKENS, EXPERTS)


@pytest.mark.parametrize("bad, match", BAD_COMBINE)
def test_functional_combine_and_its_halves(bad, match):
    workspace = fa.functional.empty_workspace(1, CONFIG.bytes_per_rank, "cpu")
    counts = torch.zeros(1, dtype=torch.int32)
    _refused(fa.combine, match, workspace, 0, CONFIG, counts, 3, MAX_TOKENS, hidden=HIDDEN, dtype=torch.bfloat16,
             **bad)
    _refused(split_phase.combine_recv, match, workspace, 0, CONFIG, counts, 3, MAX_TOKENS, hidden=HIDDEN,
             dtype=torch.bfloat16, **bad)
    if "partials" in bad:
        _refused(split_phase.combine_send, match, workspace, 0, CONFIG, counts, MAX_TOKENS, bad["partials"])


@pytest.fixture
def moe():
    group = SimulatedGroup(1, "cpu")
    [a2a] = group.run(lambda rank, comm: MoeAlltoAll(comm, max_num_tokens=MAX_TOKENS, top_k=TOP_K,
                                                     num_experts=EXPERTS, hidden_size=HIDDEN))
    yield a2a
    a2a._transport.shared.pending = None  # a dispatch the stub below "launched" is never combined
    a2a._transport.shared.order.reset()
    a2a.destroy()
    assert shared_workspace.live_workspaces() == []


@pytest.mark.parametrize("bad, match", BAD_DISPATCH)
def test_moe_alltoall_dispatch_and_dispatch_send(moe, bad, match):
    """Through the bound C++ entry (its own TypeError for a None payload, then the Python checks' message)."""
    for call in (moe.dispatch, moe.dispatch_send):
        _refused(call, match, *bad(*_inputs()))
        assert moe._transport.shared.order.state == "idle" and moe._transport.shared.pending is None


def _launch_nothing(moe, monkeypatch) -> None:
    """The eager calls of ``moe`` record their steps without launching (a CPU workspace cannot)."""
    calls = moe._transport.eager()
    monkeypatch.setattr(calls, "_dispatch", lambda *args: 0)
    monkeypatch.setattr(calls, "_combine", lambda *args: None)


@pytest.mark.parametrize("bad, match", BAD_COMBINE)
def test_moe_alltoall_combine_and_its_halves_leave_the_dispatch_pending(moe, monkeypatch, bad, match):
    _launch_nothing(moe, monkeypatch)
    ids, x = _inputs()
    moe.dispatch(ids, [x])
    pending = moe._transport.shared.pending
    _refused(moe.combine, match, **bad)
    if "partials" in bad:
        _refused(moe.combine_send, match, bad["partials"])
    assert moe._transport.shared.order.state == "dispatched" and moe._transport.shared.pending is pending
    moe.combine_send()
    if "out" in bad:
        _refused(moe.combine_recv, match, **bad)
    assert moe._transport.shared.order.state == "combine_sent" and moe._transport.shared.pending is pending
    assert moe.combine_recv().shape == (3, HIDDEN)
    assert moe._transport.shared.order.state == "idle"


def test_a_refused_combine_can_be_made_again(moe, monkeypatch):
    calls = moe._transport.eager()
    monkeypatch.setattr(calls, "_dispatch", lambda *args: 0)
    ids, x = _inputs()
    moe.dispatch(ids, [x])
    pending = moe._transport.shared.pending
    _refused(moe.combine, "out must be", out="x")
    out = torch.full((3, HIDDEN), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="^workspace must be a CUDA tensor$"):  # refused by the bound C++ entry
        moe.combine(out=out)
    assert moe._transport.shared.order.state == "dispatched" and moe._transport.shared.pending is pending
    monkeypatch.setattr(calls, "_combine", lambda *args: None)
    assert moe.combine(out=out) is out and moe._transport.shared.order.state == "idle"


def test_traced_calls():
    """Under torch.compile the Python checks run while dynamo traces: the TypeError (wrapped by dynamo under
    fullgraph) names the argument before any op is recorded."""
    workspace = torch.empty(1, CONFIG.bytes_per_rank, dtype=torch.uint8, device="meta")
    ids, x = (t.to("meta") for t in _inputs())

    def dispatch(topk_ids, hidden):
        return fa.dispatch(workspace, 0, CONFIG, topk_ids, [hidden, None], MAX_TOKENS, EXPERTS)

    def combine(partials):
        return fa.combine(workspace, 0, CONFIG, torch.zeros(1, dtype=torch.int32, device="meta"), 3, MAX_TOKENS,
                          partials, out="x")

    for fn, args, match in ((dispatch, (ids, x), r"payloads\[1\] must be a torch.Tensor, got NoneType"),
                            (combine, (torch.empty(1, MAX_TOKENS, HIDDEN, device="meta"),),
                             "out must be a torch.Tensor or None, got str")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=match):
            torch.compile(fn, fullgraph=True, backend="eager")(*args)
        torch._dynamo.reset()
        with pytest.raises(TypeError, match=match):  # without fullgraph, the call falls back to eager Python
            torch.compile(fn, backend="eager")(*args)


def test_flashinfer_compat_dispatch():
    group = SimulatedGroup(1, "cpu")

    def build(rank, comm):
        return fi.MoeAlltoAll(fi.Mapping(), MAX_TOKENS, TOP_K, EXPERTS, hidden_size=HIDDEN,
                              mnnvl_config=fi.MnnvlConfig(comm_backend=comm.comm_backend()))

    [a2a] = group.run(build)
    try:
        ids, x = _inputs()
        for bad, match in BAD_DISPATCH[:4]:
            _refused(a2a.dispatch, match, *bad(ids, x), MAX_TOKENS)
            assert a2a._a2a._transport.shared.order.state == "idle"
    finally:
        a2a.destroy()
    assert shared_workspace.live_workspaces() == []


def check_nccl(rank: int, ep_size: int, device) -> None:
    """Rank body (spawned): the nccl transport refuses alike, before any collective, and keeps its pending
    dispatch."""
    moe = MoeAlltoAll(None, max_num_tokens=8, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN, device=device,
                      transport="nccl")
    ids, x = _inputs()
    for bad, match in BAD_DISPATCH:
        args = bad(ids, x)
        exc = expect_raises(TypeError, match.replace("\\", ""), moe.dispatch, *args)
        assert "Check failed" not in str(exc)
    moe.dispatch(ids, [x])
    for bad, match in BAD_COMBINE:
        expect_raises(TypeError, match, moe.combine, **bad)
    out = moe.combine(torch.zeros(ep_size, 8, HIDDEN, dtype=torch.bfloat16))  # the dispatch was still pending
    assert out.shape == (3, HIDDEN)
    moe.destroy()


CHECKS = {"nccl": check_nccl}


def test_nccl_transport(tmp_path):
    spawn_gloo(["nccl"], 1, tmp_path, module=__name__)
