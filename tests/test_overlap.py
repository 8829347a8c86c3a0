"""Communication streams on the CPU: the argument checks, the fork and join of a transfer (over a stand-in CUDA
layer that logs what would be queued where), MoeAlltoAll's split calls on a communication stream with the launches
recorded (order rules, ``out`` rules), and the split calls on a stream traced by torch.compile(fullgraph=True)
with the fake kernels."""

import contextlib
import gc
import weakref

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a import split_phase as sp
from flashinfer_a2a.transports import overlap

from .test_moe_alltoall import _OneRank
from .test_split_phase import _CpuWorkspace, trace_with_fakes


class FakeStream:
    """Stands in for torch.cuda.Stream: logs the waits queued on it."""

    made = 0

    def __init__(self, device=None, priority=0, log=None, name=None):
        FakeStream.made += 1
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.priority, self.log = priority, log if log is not None else []
        self.cuda_stream = 1000 + FakeStream.made
        self.name = name or f"stream{self.cuda_stream}"

    def wait_event(self, event):
        self.log.append(f"{self.name} waits {event.name}@{event.at}")


class FakeCuda:
    """The calls CommStream makes, on a log: events record where they were recorded, ``torch.cuda.stream`` switches
    the current stream."""

    def __init__(self, monkeypatch):
        self.log, self.capturing = [], False
        self.caller = FakeStream(log=self.log, name="caller")
        self.current = self.caller
        events = iter(range(10 ** 6))
        fake = self

        class Event:
            def __init__(self):
                self.name, self.at = f"event{next(events)}", None

            def record(self, stream):
                self.at = stream.name
                fake.log.append(f"{self.name} recorded on {stream.name}")

        @contextlib.contextmanager
        def stream(s):
            previous, fake.current = fake.current, s
            try:
                yield
            finally:
                fake.current = previous

        monkeypatch.setattr(torch.cuda, "Event", Event)
        class Stream(FakeStream):  # what the package makes (and what isinstance checks)
            def __init__(self, device=None, priority=0):
                super().__init__(device, priority, fake.log, "package")

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.current)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(overlap, "_PACKAGE", {})

    def launch(self, what):
        """A launch that logs the stream it was queued on."""
        return lambda: self.log.append(f"{what} on {self.current.name}")


@pytest.mark.parametrize("value", ["yes", 1, object()])
def test_comm_stream_must_be_none_a_bool_or_a_stream(value):
    with pytest.raises(TypeError, match="comm_stream must be None, True .* or a torch.cuda.Stream, got"):
        overlap.check_comm_stream(value)
    with pytest.raises(TypeError, match="comm_stream must be"):  # before any allocation (the one collective: the
        MoeAlltoAll(_OneRank(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64,  # agreement)
                    comm_stream=value)


def test_the_nccl_transport_has_no_comm_stream():
    with pytest.raises(ValueError, match="comm_stream is for the split halves, which the nccl transport does not"):
        MoeAlltoAll(_OneRank(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, transport="nccl",
                    comm_stream=True)


def test_resolve(monkeypatch):
    FakeCuda(monkeypatch)
    cpu = torch.device("cpu")
    assert overlap.resolve(None, "k", cpu) is None and overlap.resolve(False, "k", cpu) is None
    package = overlap.resolve(True, ("group", 2, 0), cpu)
    assert package.stream.priority == overlap.PRIORITY < 0
    assert overlap.resolve(True, ("group", 2, 0), cpu) is package  # one per rank of a group on a device
    assert overlap.resolve(True, ("group", 2, 1), cpu) is not package  # simulated ranks: one each
    mine = torch.cuda.Stream()
    assert overlap.resolve(mine, "k", cpu) is overlap.resolve(mine, "other", cpu)  # one CommStream per stream
    assert overlap.registered(package.index) is package
    with pytest.raises(ValueError, match="comm_stream is a stream of meta, the workspace is on cpu"):
        overlap.resolve(torch.cuda.Stream("meta"), "k", cpu)
    for index in (-1, 10 ** 6, "0"):
        with pytest.raises(ValueError, match="names no communication stream"):
            overlap.registered(index)


def test_run_forks_after_the_caller_and_wait_joins(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    comm = overlap.for_stream(FakeStream(log=cuda.log, name="comm"))
    workspace, held = torch.zeros(4), torch.zeros(3)
    gone = weakref.ref(held)
    assert comm.run(workspace, cuda.launch("send"), (held,)) is None
    assert comm.in_flight(workspace)
    comm.run(workspace, cuda.launch("receive"))  # a second launch of the same transfer
    ready, done = cuda.log[0].split()[0], cuda.log[3].split()[0]
    assert cuda.log == [f"{ready} recorded on caller", f"comm waits {ready}@caller", "send on comm",
                        f"{done} recorded on comm", f"{ready} recorded on caller", f"comm waits {ready}@caller",
                        "receive on comm", f"{done} recorded on comm"]
    assert cuda.current is cuda.caller
    del held
    gc.collect()
    assert gone() is not None  # held until the join
    cuda.log.clear()
    comm.wait(workspace)
    assert cuda.log == [f"caller waits {done}@comm"]
    gc.collect()
    assert gone() is None and not comm.in_flight(workspace)
    with pytest.raises(RuntimeError, match="no transfer of this workspace is in flight .* needs its send half first"):
        comm.wait(workspace)


def test_both_halves_must_be_in_one_capture(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    comm = overlap.for_stream(FakeStream(log=cuda.log, name="comm"))
    workspace = torch.zeros(4)
    cuda.capturing = True
    comm.run(workspace, cuda.launch("send"))
    cuda.capturing = False  # the capture ended between the halves
    with pytest.raises(RuntimeError, match="a send half was queued inside a CUDA graph capture and the receive half "
                                           "after it comes outside any capture; both halves .* same graph"):
        comm.wait(workspace)
    with pytest.raises(RuntimeError, match="and the next send half after it comes outside any capture"):
        comm.run(workspace, cuda.launch("send"))
    cuda.capturing = True
    comm.wait(workspace)  # within the capture: joined
    comm.run(workspace, cuda.launch("send"))
    comm.wait(workspace)


def _tvm_ffi_stream(cuda, call) -> str:
    """The stream a bound C++ entry launches on, as tvm-ffi picks it: torch's current stream when the call passes a
    tensor (the C++ reads the stream tvm-ffi sets from it), else the legacy default stream (nothing set it). A bound
    call without a tensor once sent the receive kernel there, beside the communication stream instead of on it."""
    return cuda.current.name if any(isinstance(arg, torch.Tensor) for arg in call) else "the legacy default stream"


def _recording_moe(monkeypatch, cuda, comm_stream=True, **kwargs):
    """MoeAlltoAll over a CPU workspace (with comm_stream=True by default), its bound C++ entries replaced by recorders
    that log the stream they would launch on (:func:`_tvm_ffi_stream`)."""
    from flashinfer_a2a.library import ops as library_ops

    class Comm(_OneRank):
        def barrier(self):
            pass

        def allocate_workspace(self, bytes_per_rank, device):
            return _CpuWorkspace(self, bytes_per_rank)

    def bind_eager_calls(workspace, recv_counts, ep_rank, sizes, num_experts, num_sms, one_gpu_per_rank=False):
        def dispatch(*call):
            cuda.log.append(f"dispatch phase {call[7]} on {_tvm_ffi_stream(cuda, call)}")
            return 0

        def dispatch_recv(*call):
            cuda.log.append(f"dispatch_recv on {_tvm_ffi_stream(cuda, call)}")

        def combine(*call):
            cuda.log.append(f"combine phase {call[-1]} on {_tvm_ffi_stream(cuda, call)}")

        return dispatch, dispatch_recv, combine

    monkeypatch.setattr(library_ops, "bind_eager_calls", bind_eager_calls)
    return MoeAlltoAll(Comm(), max_num_tokens=8, top_k=2, num_experts=4, hidden_size=64, comm_stream=comm_stream,
                       **kwargs)


@pytest.mark.usefixtures("a2a_env")
def test_moe_alltoall_split_calls_on_the_comm_stream(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    a2a = _recording_moe(monkeypatch, cuda, num_sms=4)
    ids = torch.zeros(5, 2, dtype=torch.int32)
    x = torch.zeros(5, 64, dtype=torch.bfloat16)

    def launches():
        seen = [line for line in cuda.log if " phase " in line or line.startswith("dispatch_recv")]
        cuda.log.clear()
        return seen

    for _ in range(2):
        a2a.dispatch_send(ids, [x], 8)
        assert launches() == ["dispatch phase 1 on package", "dispatch_recv on package"]
        with pytest.raises(RuntimeError, match="call dispatch_recv first"):
            a2a.combine()
        (recv_x,), counts = a2a.dispatch_recv()
        assert cuda.log[-1].startswith("caller waits") and cuda.log[-1].endswith("@package")
        assert launches() == []
        a2a.combine_input()
        out = torch.empty(5, 64, dtype=torch.bfloat16)
        a2a.combine_send(out=out)
        assert launches() == ["combine phase 1 on package", "combine phase 2 on package"]
        with pytest.raises(ValueError, match="with a communication stream the combine runs at combine_send"):
            a2a.combine_recv(out=out)  # refused, and nothing changed: the receive still comes
        assert a2a.combine_recv() is out
        assert launches() == []
    # Whole calls stay on the caller's stream.
    a2a.dispatch(ids, [x], 8)
    a2a.combine()
    assert launches() == ["dispatch phase 0 on caller", "combine phase 0 on caller"]
    # Without out, combine_send makes one (on the caller's stream, before the fork) and combine_recv returns it.
    a2a.dispatch_send(ids, [x], 8)
    a2a.dispatch_recv()
    a2a.combine_send()
    made = a2a.combine_recv()
    assert made.shape == (5, 64) and made.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="combine_recv called without a pending dispatch"):
        a2a.combine_recv()
    a2a.destroy()


@pytest.mark.usefixtures("a2a_env")
def test_out_given_to_combine_send_without_a_comm_stream(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    a2a = _recording_moe(monkeypatch, cuda, comm_stream=None)  # out is only kept for the receive
    ids = torch.zeros(5, 2, dtype=torch.int32)
    x = torch.zeros(5, 64, dtype=torch.bfloat16)
    a2a.dispatch_send(ids, [x], 8)
    a2a.dispatch_recv()
    out = torch.empty(5, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be \[num_tokens=5, hidden=64\]"):
        a2a.combine_send(out=torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out must be a torch.Tensor or None, got str"):
        a2a.combine_send(out="out")
    a2a.combine_send(out=out)
    with pytest.raises(ValueError, match="out was given to combine_send already"):
        a2a.combine_recv(out=out)
    assert a2a.combine_recv() is out
    # Every half on the caller's stream (not the legacy default one: the caller's may be any stream).
    assert [line for line in cuda.log if " on " in line] == [
        "dispatch phase 1 on caller", "dispatch_recv on caller", "combine phase 1 on caller",
        "combine phase 2 on caller"]
    a2a.destroy()


def test_functional_out_rules():
    config = fa.WorkspaceConfig(ep_size=1, max_num_tokens=8, dispatch_bytes_per_token=128,
                                combine_bytes_per_token=128, top_k=2)
    workspace = fa.functional.empty_workspace(1, config.bytes_per_rank, "cpu")
    counts = torch.zeros(1, dtype=torch.int32)
    out = torch.empty(4, 64, dtype=torch.bfloat16)
    comm = overlap.CommStream(FakeStream())
    with pytest.raises(ValueError, match="out is the receive half's argument without a comm_stream"):
        sp.combine_send(workspace, 0, config, counts, 8, hidden=64, dtype=torch.bfloat16, out=out)
    with pytest.raises(ValueError, match="combine_send with a comm_stream needs out"):
        sp.combine_send(workspace, 0, config, counts, 8, hidden=64, dtype=torch.bfloat16, comm_stream=comm)
    with pytest.raises(ValueError, match="combine_recv with a comm_stream needs the out given to combine_send"):
        sp.combine_recv(workspace, 0, config, counts, 4, 8, comm_stream=comm)


def test_on_stream_schemas():
    for name in ("dispatch", "dispatch_recv", "combine"):
        base = str(getattr(torch.ops.flashinfer_a2a, name).default._schema)
        wrapped = str(getattr(torch.ops.flashinfer_a2a, f"{name}_on_stream").default._schema)
        # The base op's arguments and declared writes, the stream's index after the workspace.
        assert wrapped == base.replace(f"::{name}(Tensor(a!) workspace, ",
                                       f"::{name}_on_stream(Tensor(a!) workspace, int comm_stream, ")
    join = str(torch.ops.flashinfer_a2a.join_stream.default._schema)
    assert join.endswith("join_stream(Tensor(a!) workspace, int comm_stream, Tensor(b!) result) -> ()")


@pytest.mark.usefixtures("a2a_env")  # the workspace size comes from the built library
def test_split_calls_on_a_stream_run_outside_compiled_graphs():
    """Two micro-batches, their halves interleaved on a communication stream, under torch.compile (meta tensors):
    each half with a comm_stream is a graph break and runs eagerly (inductor could otherwise give the memory of a
    buffer the stream still reads to the next computation), the compute between them stays in the graphs, and
    fullgraph=True refuses the step."""
    hidden, top_k, runtime_max = 256, 4, 16
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=16, dispatch_bytes_per_token=hidden * 2 + top_k * 8,
                                combine_bytes_per_token=hidden * 2, top_k=top_k)

    class Recording:
        """A communication stream that records its launches and joins, and whether dynamo was tracing them."""

        def __init__(self):
            self.calls = []

        def op(self, base):
            return lambda workspace, *args: self.calls.append((base.name, torch.compiler.is_compiling()))

        def join(self, workspace, result):
            self.calls.append(("join", torch.compiler.is_compiling()))

    comm = Recording()

    def step(wa, wb, ids, x):
        (ra,), ca = sp.dispatch_send(wa, 0, config, ids, [x], runtime_max, 8, num_sms=4, comm_stream=comm)
        (rb,), cb = sp.dispatch_send(wb, 0, config, ids, [x], runtime_max, 8, comm_stream=comm)
        sp.dispatch_recv(wa, 0, config, ca, runtime_max, comm_stream=comm)
        pa = (ra.float() * 2).to(torch.bfloat16)
        oa = sp.combine_send(wa, 0, config, ca, runtime_max, pa, out=torch.empty_like(x), comm_stream=comm)
        sp.dispatch_recv(wb, 0, config, cb, runtime_max, comm_stream=comm)
        ob = sp.combine_send(wb, 0, config, cb, runtime_max, hidden=hidden, dtype=torch.bfloat16,
                             out=torch.empty_like(x), comm_stream=comm)
        sp.combine_recv(wa, 0, config, ca, ids.shape[0], runtime_max, pa, out=oa, comm_stream=comm)
        sp.combine_recv(wb, 0, config, cb, ids.shape[0], runtime_max, out=ob, comm_stream=comm)
        return oa, ob, ra, ca

    (oa, ob, ra, ca), calls = trace_with_fakes(step, config, hidden, fullgraph=False, every_call=True)
    assert oa.shape == ob.shape == (10, hidden) and ra.shape == (2, runtime_max, hidden) and ca.shape == (2,)
    targets = [str(n.target) for n in calls]
    assert not [t for t in targets if t.startswith("flashinfer_a2a.")], targets  # the halves ran eagerly
    assert any("mul" in t for t in targets)  # the experts' arithmetic between them was compiled
    assert comm.calls == [("dispatch", False), ("dispatch_recv", False), ("dispatch", False), ("dispatch_recv", False),
                          ("join", False), ("combine", False), ("combine", False), ("join", False),
                          ("combine", False), ("combine", False), ("join", False), ("join", False)]
    with pytest.raises(torch._dynamo.exc.Unsupported):
        trace_with_fakes(step, config, hidden)
    # Without a comm_stream the halves trace as the base ops (test_split_phase).


@pytest.mark.usefixtures("a2a_env")  # the workspace size comes from the built library
def test_the_functional_calls_never_take_the_truth_of_launch():
    """dispatch_counts and combine pick the op with ``launch is None``: dynamo of torch 2.11 cannot take the truth
    of a function made inside the traced code (CommStream.op's lambda), and `launch or ops.dispatch` broke
    torch.compile(fullgraph=True) of the split calls on a communication stream there."""
    launched = []

    class Launch:  # stands in for that function: calling it works, its truth does not
        def __bool__(self):
            raise AssertionError("the truth of launch was taken")

        def __call__(self, *args):
            launched.append(args)

    config = fa.WorkspaceConfig(ep_size=1, max_num_tokens=8, dispatch_bytes_per_token=128,
                                combine_bytes_per_token=128, top_k=2)
    workspace = fa.functional.empty_workspace(1, config.bytes_per_rank, "cpu")
    ids = torch.zeros(4, 2, dtype=torch.int32)
    counts = fa.functional.dispatch_counts(workspace, 0, config, ids, [torch.zeros(4, 64, dtype=torch.bfloat16)], 8,
                                           4, launch=Launch())
    out = fa.functional.combine(workspace, 0, config, counts, 4, 8, hidden=64, dtype=torch.bfloat16, phase=1,
                                launch=Launch())
    assert len(launched) == 2 and launched[0][3] is counts and launched[1][3] is out
