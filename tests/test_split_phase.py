"""Split-phase calls on the CPU: the host-side call order, the SM budget's checks, the op schemas, and the split
functional API traced by torch.compile(fullgraph=True) with the fake kernels."""

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a.library import ops
from flashinfer_a2a import split_phase as sp
from flashinfer_a2a.library import constants
from flashinfer_a2a.memory.call_order import CallOrder

from .test_moe_alltoall import _OneRank


def _run(order, calls):
    for call in calls:
        order.advance(call)


@pytest.mark.parametrize("calls", [
    ("dispatch", "combine"),
    ("dispatch_send", "dispatch_recv", "combine"),
    ("dispatch", "combine_input", "combine_send", "combine_recv"),
    ("dispatch_send", "dispatch_recv", "combine_input", "combine_send", "combine_recv", "dispatch", "combine"),
])
def test_call_orders_that_pair_every_send_with_its_receive(calls):
    order = CallOrder()
    _run(order, calls)
    _run(order, calls)  # and again: each sequence ends where it started
    assert order.state == CallOrder.IDLE


@pytest.mark.parametrize("before, call, message", [
    ((), "dispatch_recv", "MoeAlltoAll.dispatch_recv called without a pending dispatch"),
    ((), "combine_recv", "called without a pending dispatch"),
    ((), "combine_send", "called without a pending dispatch"),
    ((), "combine_input", "called without a pending dispatch"),
    (("dispatch",), "dispatch", "dispatch called twice"),
    (("dispatch",), "dispatch_send", "call combine"),
    (("dispatch",), "combine_recv", "call combine"),
    (("dispatch_send",), "dispatch_send", "call dispatch_recv first"),
    (("dispatch_send",), "dispatch", "call dispatch_recv first"),
    (("dispatch_send",), "combine", "call dispatch_recv first"),
    (("dispatch_send",), "combine_input", "call dispatch_recv first"),
    (("dispatch", "combine_send"), "combine", "call combine_recv first"),
    (("dispatch", "combine_send"), "dispatch_send", "call combine_recv first"),
    (("dispatch", "combine_send"), "combine_input", "call combine_recv first"),
    (("dispatch", "combine_send", "combine_recv"), "dispatch_recv", "called without a pending dispatch"),
])
def test_calls_out_of_order_raise_and_change_nothing(before, call, message):
    order = CallOrder()
    _run(order, before)
    state = order.state
    with pytest.raises(RuntimeError, match=message):
        order.advance(call)
    assert order.state == state


@pytest.mark.parametrize("num_sms", [0, -3, 2.5, True, "8"])
def test_num_sms_is_checked_before_any_collective(num_sms):
    with pytest.raises(ValueError, match=f"num_sms must be None .* got {num_sms!r}"):
        MoeAlltoAll(_OneRank(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, num_sms=num_sms)


def test_phase_codes_and_schemas():
    assert (constants.SPLIT_BOTH, constants.SPLIT_SEND, constants.SPLIT_RECV) == (0, 1, 2)  # pinned to C++ too
    dispatch = str(torch.ops.flashinfer_a2a.dispatch.default._schema)
    combine = str(torch.ops.flashinfer_a2a.combine.default._schema)
    recv = str(torch.ops.flashinfer_a2a.dispatch_recv.default._schema)
    assert dispatch.endswith("int phase=0, int num_sms=0, bool one_gpu_per_rank=False, Tensor? eplb_local_stats=None) -> ()")
    assert combine.endswith("int phase=0, int num_sms=0) -> ()")
    # The receive half writes the counts and the workspace (its error record): both are declared mutated.
    assert "Tensor(a!) workspace, Tensor(b!) recv_counts" in recv


def trace_with_fakes(step, config, hidden, fullgraph=True, every_call=False):
    """Traces ``step(wa, wb, ids, x)`` (two workspaces of ``config`` on the meta device, 10 tokens of bf16
    ``hidden`` states and int64 ids) with dynamo; returns its outputs and the graphs' flashinfer_a2a op calls in
    order (``every_call``: all their calls)."""
    wa = torch.empty(2, config.bytes_per_rank, dtype=torch.uint8, device="meta")
    wb = torch.empty_like(wa)
    ids = torch.empty(10, config.top_k, dtype=torch.int64, device="meta")
    x = torch.empty(10, hidden, dtype=torch.bfloat16, device="meta")
    captured = []

    def backend(gm, example_inputs):
        captured.append(gm)
        return gm.forward

    torch._dynamo.reset()
    outputs = torch.compile(step, fullgraph=fullgraph, backend=backend)(wa, wb, ids, x)
    calls = [n for gm in captured for n in gm.graph.nodes if n.op == "call_function"
             and (every_call or str(n.target).startswith("flashinfer_a2a."))]
    return outputs, calls


@pytest.mark.usefixtures("a2a_env")  # the workspace size comes from the built library
def test_split_calls_trace_fullgraph_with_fakes():
    """Two micro-batches on two workspaces, their halves interleaved, traced by dynamo (meta tensors: no GPU)."""
    hidden, top_k, runtime_max = 256, 4, 16
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=hidden * 2 + top_k * 8,
                                combine_bytes_per_token=hidden * 2, top_k=top_k)

    def step(wa, wb, ids, x):
        (ra,), ca = sp.dispatch_send(wa, 0, config, ids, [x], runtime_max, 8, num_sms=4)
        (rb,), cb = sp.dispatch_send(wb, 0, config, ids, [x], runtime_max, 8)
        sp.dispatch_recv(wa, 0, config, ca, runtime_max)
        pa = (ra.float() * 2).to(torch.bfloat16)
        sp.combine_send(wa, 0, config, ca, runtime_max, pa)
        sp.dispatch_recv(wb, 0, config, cb, runtime_max)
        sp.combine_send(wb, 0, config, cb, runtime_max, hidden=hidden, dtype=torch.bfloat16)
        oa = sp.combine_recv(wa, 0, config, ca, ids.shape[0], runtime_max, pa)
        ob = sp.combine_recv(wb, 0, config, cb, ids.shape[0], runtime_max, hidden=hidden, dtype=torch.bfloat16)
        return oa, ob, ra, ca

    (oa, ob, ra, ca), calls = trace_with_fakes(step, config, hidden)
    assert oa.shape == ob.shape == (10, hidden) and ra.shape == (2, runtime_max, hidden)
    assert ca.shape == (2,) and ca.dtype == torch.int32
    phases = [(str(n.target).split(".")[1], n.args[16] if "dispatch.default" in str(n.target) else
               n.args[15] if "combine" in str(n.target) else None) for n in calls]
    assert phases == [("dispatch", 1), ("dispatch", 1), ("dispatch_recv", None), ("combine", 1),
                      ("dispatch_recv", None), ("combine", 1), ("combine", 2), ("combine", 2)]
    first_dispatch = calls[0]
    assert first_dispatch.args[17] == 4  # num_sms reaches the op


class _CpuWorkspace:
    """Stands in for the symmetric workspace: a CPU tensor of one rank (nothing here launches a kernel)."""

    one_gpu_per_rank = False

    def __init__(self, comm, bytes_per_rank):
        self.tensor = fa.functional.empty_workspace(comm.size, bytes_per_rank, "cpu")
        self.bytes_per_rank = bytes_per_rank

    def destroy(self):
        pass


@pytest.mark.usefixtures("a2a_env")
def test_moe_alltoall_checks_the_call_order_before_any_launch(monkeypatch):
    """MoeAlltoAll's split calls on the CPU, the launches replaced by recorders: calls out of order raise and launch
    nothing; a send then its receive launch once each, with the object's SM budget."""
    from flashinfer_a2a.library import ops as library_ops

    class Comm(_OneRank):
        def barrier(self):
            pass

        def allocate_workspace(self, bytes_per_rank, device):  # the shared workspace's hook: no CUDA memory
            return _CpuWorkspace(self, bytes_per_rank)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    a2a = MoeAlltoAll(Comm(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, num_sms=3)
    launched = []

    class Bound:  # the eager path's bound entry points, recording instead of launching
        def bind_dispatch(self, *args):
            num_sms = args[-1]
            return lambda *call: launched.append(("dispatch", call[7], num_sms)) or 0

        def bind_dispatch_recv(self, *args):
            return lambda *call: launched.append(("dispatch_recv",))

        def bind_combine(self, *args):  # records (phase, combine mode, SM budget)
            return lambda *call: launched.append(("combine", call[-1], call[-2], args[-1]))

    def bind_eager_calls(workspace, recv_counts, ep_rank, sizes, num_experts, num_sms, one_gpu_per_rank):
        bound = Bound()
        return (bound.bind_dispatch(num_sms), bound.bind_dispatch_recv(),
                bound.bind_combine(one_gpu_per_rank, num_sms))

    monkeypatch.setattr(library_ops, "bind_eager_calls", bind_eager_calls)
    ids = torch.zeros(5, 2, dtype=torch.int32)
    x = torch.zeros(5, 64, dtype=torch.bfloat16)
    for call, message in ((a2a.dispatch_recv, "dispatch_recv called without a pending dispatch"),
                          (a2a.combine_send, "combine_send called without a pending dispatch"),
                          (a2a.combine_recv, "combine_recv called without a pending dispatch"),
                          (a2a.combine_input, "combine_input called without a pending dispatch")):
        with pytest.raises(RuntimeError, match=message):
            call()
    assert launched == []
    a2a.dispatch_send(ids, [x], 8)
    for call, message in ((lambda: a2a.dispatch_send(ids, [x], 8), "call dispatch_recv first"),
                          (lambda: a2a.dispatch(ids, [x], 8), "call dispatch_recv first"),
                          (a2a.combine, "call dispatch_recv first"), (a2a.combine_input, "call dispatch_recv first"),
                          (a2a.combine_send, "call dispatch_recv first")):
        with pytest.raises(RuntimeError, match=message):
            call()
    (recv_x,), counts = a2a.dispatch_recv()
    assert recv_x.shape == (1, 8, 64) and counts is a2a._transport.recv_counts
    assert a2a.combine_input().shape == (1, 8, 64)
    a2a.combine_send()
    with pytest.raises(RuntimeError, match="call combine_recv first"):
        a2a.dispatch_send(ids, [x], 8)
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    assert a2a.combine_recv(out=out) is out
    # The halves of a split combine are pulled (mode 0) and keep the object's SM budget.
    assert launched == [("dispatch", 1, 3), ("dispatch_recv",), ("combine", 1, 0, 3), ("combine", 2, 0, 3)]
    with pytest.raises(RuntimeError, match="combine_recv called without a pending dispatch"):
        a2a.combine_recv()
    a2a.destroy()


@pytest.mark.usefixtures("a2a_env")
@pytest.mark.parametrize("op, phase, num_sms, message", [
    ("dispatch", 2, 0, "dispatch phase must be 0 .* or 1 .*, got 2"),
    ("dispatch", -1, 0, "dispatch phase must be .* got -1"),
    ("dispatch", 1, -4, "num_sms must be >= 0 .* got -4"),
    ("combine", 3, 0, "combine phase must be 0 .*, 1 .* or 2 .*, got 3"),
    ("combine", 2, -1, "num_sms must be >= 0 .* got -1"),
])
def test_bad_phase_and_num_sms_are_value_errors_before_any_launch(op, phase, num_sms, message):
    config = fa.WorkspaceConfig(ep_size=1, max_num_tokens=8, dispatch_bytes_per_token=128,
                                combine_bytes_per_token=128, top_k=2)
    workspace = fa.functional.empty_workspace(1, config.bytes_per_rank, "cpu")  # checked after: never reached
    ids = torch.zeros(4, 2, dtype=torch.int32)
    counts = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        if op == "dispatch":
            ops.dispatch(workspace, ids, [torch.zeros(4, 64, dtype=torch.bfloat16)], counts, 0, *config.sizes(), 8, 4,
                         5.0, 0, None, False, phase, num_sms)
        else:
            ops.combine(workspace, None, counts, torch.zeros(4, 64, dtype=torch.bfloat16), 0, *config.sizes(), 8, 5.0,
                        False, 0, 0, phase, num_sms)
