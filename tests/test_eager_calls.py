"""MoeAlltoAll's eager path on CPU (flashinfer_a2a.transports.nvlink_eager): its calls reach the bound C++ entry
points, skip the ops and the functional layer, are refused before any launch with errors in the caller's terms, and
leave the call order where it was when refused. (tests/gpu/test_moe_alltoall_one_rank.py runs the path on a GPU.)"""

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import functional as F
from flashinfer_a2a.library import ops
from flashinfer_a2a.memory import shared_workspace
from flashinfer_a2a.transports.nvlink_eager import EagerCalls
from flashinfer_a2a.testing.simulated_group import SimulatedGroup
from flashinfer_a2a.library import checks

pytestmark = pytest.mark.usefixtures("a2a_env")

HIDDEN, TOP_K, EXPERTS = 64, 4, 8


@pytest.fixture
def moe(monkeypatch):
    def never(*args):
        raise AssertionError("an eager MoeAlltoAll call went through the ops")

    group = SimulatedGroup(1, "cpu")
    [a2a] = group.run(lambda rank, comm: fa.MoeAlltoAll(comm, max_num_tokens=16, top_k=TOP_K, num_experts=EXPERTS,
                                                        hidden_size=HIDDEN, device=None))
    monkeypatch.setattr(ops.dispatch, "impl", never)
    monkeypatch.setattr(ops.dispatch, "overload", never)
    monkeypatch.setattr(ops.combine, "impl", never)
    monkeypatch.setattr(ops.combine, "overload", never)
    yield a2a
    a2a.destroy()
    assert shared_workspace.live_workspaces() == []


def _inputs(tokens=3):
    return torch.zeros(tokens, TOP_K, dtype=torch.int32), torch.zeros(tokens, HIDDEN, dtype=torch.bfloat16)


def test_eager_calls_reach_the_bound_entry_points(moe):
    ids, x = _inputs()
    # The C++ entry's own check (a CPU workspace cannot launch), so the call got as far as the bound Dispatch.
    with pytest.raises(ValueError, match="^workspace must be a CUDA tensor$"):
        moe.dispatch(ids, [x, ids])
    calls = moe._transport.eager()
    assert isinstance(calls, EagerCalls) and calls.workspace is moe.workspace
    assert moe._transport.eager() is calls  # made once per workspace
    with pytest.raises(ValueError, match="^workspace must be a CUDA tensor$"):
        moe.dispatch_send(ids, [x])
    # The other bound entries, called as MoeAlltoAll's steps call them after an eager dispatch: the receive half of
    # a split dispatch, a whole combine and both halves of a split one.
    with pytest.raises(ValueError, match="^workspace must be a CUDA tensor$"):
        calls.dispatch_recv(16, 10.0)
    for phase in (0, 1, 2):
        with pytest.raises(ValueError, match="^workspace must be a CUDA tensor$"):
            calls.combine(None, None, 3, HIDDEN, torch.bfloat16, 16, 10.0, phase=phase)
    with pytest.raises(ValueError, match="combine quant_format must be None or 'fp8_block', got 'fp4'"):
        calls.combine(None, None, 3, HIDDEN, torch.bfloat16, 16, 10.0, quant_format="fp4")
    with pytest.raises(ValueError, match=r"out must be \[num_tokens=3, hidden=64\], got \(2, 64\)"):
        calls.combine(None, torch.zeros(2, HIDDEN, dtype=torch.bfloat16), 3, HIDDEN, torch.bfloat16, 16, 10.0)


@pytest.mark.parametrize("bad, message", [
    (lambda ids, x: (None, [x]), "topk_ids must be a torch.Tensor, got NoneType"),
    (lambda ids, x: (ids, [x, None]), r"payloads\[1\] must be a torch.Tensor, got NoneType"),
    (lambda ids, x: (ids, x), "payloads must be a list or tuple of tensors, got Tensor"),
    (lambda ids, x: (ids, [x[:2]]), r"payloads\[0\] must be \[num_tokens=3, ...\], got \(2, 64\)"),
    (lambda ids, x: (ids[0], [x]), r"topk_ids must be \[num_tokens, top_k\]"),
])
def test_refused_calls_name_the_argument_and_change_nothing(moe, bad, message):
    ids, x = _inputs()
    args = bad(ids, x)
    for call in (moe.dispatch, moe.dispatch_send):
        with pytest.raises((TypeError, ValueError), match=message) as info:
            call(*args)
        assert "Check failed" not in str(info.value)
        # refused before the call was recorded: a dispatch may follow
        assert moe._transport.shared.order.state == "idle"
    with pytest.raises(ValueError, match="exceeds max_num_tokens=16"):
        moe.dispatch(ids, [x], 17)


def test_a_moved_workspace_gets_new_eager_calls():
    group = SimulatedGroup(1, "cpu")

    def build(rank, comm):
        return fa.MoeAlltoAll(comm, max_num_tokens=16, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
                              device=None)

    [small] = group.run(build)
    try:
        before = small._transport.eager()
        [big] = group.run(lambda rank, comm: fa.MoeAlltoAll(comm, max_num_tokens=64, top_k=TOP_K,
                                                            num_experts=EXPERTS, hidden_size=HIDDEN, device=None))
        after = small._transport.eager()  # the growth dropped every user's calls: bound to the old layout, they would be wrong
        assert after is not before and after.config == small.config and after.config.max_num_tokens == 64
        assert after.workspace is small.workspace
        assert big._transport.eager() is not after  # one per instance: each has its counts tensor, experts and budget
        big.destroy()
    finally:
        small.destroy()
    assert shared_workspace.live_workspaces() == []


def test_functional_checks_are_the_ones_eager_calls_fall_back_on():
    ids, x = _inputs()
    assert checks.check_dispatch_call(ids, [x, ids], 3) is None
    assert checks.check_dispatch_call(ids, [x], 3, "mxfp8").name == "mxfp8"
    with pytest.raises(ValueError, match="at most 7 tensors per dispatch that quantizes"):
        checks.check_dispatch_call(ids, [x] * 8, 3, "mxfp8")
