"""MoeAlltoAll's split calls on communication streams, on one GPU: the transfer runs beside work the caller queues
after the send; two micro-batches interleaved on simulated ranks equal the serial step bit for bit, eagerly and
replayed from CUDA graphs; a capture holding a send without its receive is refused clearly; the step compiled by
torch.compile (the halves run eagerly between the compiled graphs) equals the serial one too. The functional calls
on communication streams are in test_split_phase.py."""

import subprocess
import sys

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.testing.simulated_group import SimulatedGroup

from ..multigpu.test_multigpu import ROOT, _env
from . import unjoined_capture
from .simulated import on_streams, warm_up
from .test_moe_alltoall_one_rank import OneRank
from .test_split_phase import EXPERTS, HIDDEN, TOP_K, _experts


def test_the_transfer_runs_beside_work_queued_after_the_send():
    """One rank: after dispatch_send, the caller's stream sleeps; the transfer (on the communication stream)
    completes while it still sleeps, and dispatch_recv's join orders what follows after both."""
    a2a = fa.MoeAlltoAll(OneRank(), max_num_tokens=64, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
                         comm_stream=True, num_sms=4)
    gen = torch.Generator().manual_seed(torch.seed())
    try:
        ids = ref.random_topk_ids(64, TOP_K, EXPERTS, generator=gen).cuda()
        x = torch.randn(64, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
        torch.cuda._sleep(1000)  # loads the sleep kernel
        torch.cuda.synchronize()
        a2a.dispatch_send(ids, [x], 64)
        transfer_done = torch.cuda.Event()
        transfer_done.record(a2a._transport.comm_stream.stream)
        torch.cuda._sleep(2_000_000_000)  # about a second
        slept = torch.cuda.Event()
        slept.record()
        transfer_done.synchronize()
        assert not slept.query(), "the transfer waited for work queued after the send"
        (recv_x,), counts = a2a.dispatch_recv()
        got = recv_x[0, :64].clone()  # ordered after the join
        torch.cuda.synchronize()
        assert counts.tolist() == [64] and torch.equal(got, x)
        a2a.combine_input()[0, :64] = got * 2
        out = torch.empty_like(x)
        a2a.combine_send(out=out)
        assert a2a.combine_recv() is out
        torch.cuda.synchronize()
        assert torch.equal(out, x * 2)
        fa.check_error(a2a.workspace, 0)
    finally:
        a2a.destroy()


class _Pair:
    """Two MoeAlltoAll per simulated rank (a namespace per micro-batch), comm_stream=True, and the step both ways."""

    EP, MAX_TOKENS = 2, 48

    def __init__(self):
        self.gen = torch.Generator().manual_seed(torch.seed())
        self.group = SimulatedGroup(self.EP)
        self.a2a = self.group.run(lambda r, comm: [fa.MoeAlltoAll(
            comm, max_num_tokens=self.MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
            comm_stream=True, num_sms=2, namespace=f"micro-batch {m}") for m in range(2)])
        self.streams = [torch.cuda.Stream() for _ in range(self.EP)]
        warm_up(self.streams, lambda: _experts(torch.ones(2, 3, HIDDEN, dtype=torch.bfloat16, device="cuda"), 0))

    def inputs(self, counts):
        ids = [ref.random_topk_ids(n, TOP_K, EXPERTS, generator=self.gen).cuda() for n in counts]
        xs = [torch.randn(n, HIDDEN, generator=self.gen).to(torch.bfloat16).cuda() for n in counts]
        return ids, xs

    def serial(self, r, batches):
        outs = []
        for a2a, (ids, xs) in zip(self.a2a[r], batches):
            (recv,), _ = a2a.dispatch(ids[r], [xs[r]], self.MAX_TOKENS)
            a2a.combine_input().copy_(_experts(recv, r))
            outs.append(a2a.combine())
        return outs

    def overlapped(self, r, batches, outs=None):
        (a, (ids_a, xs_a)), (b, (ids_b, xs_b)) = zip(self.a2a[r], batches)
        a.dispatch_send(ids_a[r], [xs_a[r]], self.MAX_TOKENS)
        b.dispatch_send(ids_b[r], [xs_b[r]], self.MAX_TOKENS)
        (recv,), _ = a.dispatch_recv()
        a.combine_input().copy_(_experts(recv, r))
        a.combine_send(out=None if outs is None else outs[0])
        (recv,), _ = b.dispatch_recv()
        b.combine_send(_experts(recv, r), out=None if outs is None else outs[1])  # partials as a tensor
        return [a.combine_recv(), b.combine_recv()]

    def check(self, got, want):
        for r in range(self.EP):
            for m in range(2):
                fa.check_error(self.a2a[r][m].workspace, r)
                assert ref.bitwise_equal(got[r][m].cpu(), want[r][m].cpu()), f"micro-batch {m}, rank {r}"

    def close(self):
        self.group.run(lambda r, comm: [a.destroy() for a in self.a2a[r]])


def test_moe_alltoall_overlap_equals_serial_eager_and_in_graphs():
    pair = _Pair()
    try:
        for counts in ([48, 5], [0, 48], [17, 30]):
            batches = [pair.inputs(counts), pair.inputs(counts[::-1])]
            want = [[o.clone() for o in outs] for outs in on_streams(pair.streams, lambda r: pair.serial(r, batches))]
            got = on_streams(pair.streams, lambda r: pair.overlapped(r, batches))
            torch.cuda.synchronize()
            pair.check(got, want)
        # Captured: every rank's step in a graph on its stream, the package's communication streams inside.
        counts = [40, 33]
        static = [pair.inputs(counts), pair.inputs(counts)]
        # rank r's two micro-batches have counts[r] tokens each
        outs = [[torch.empty(n, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(2)] for n in counts]
        graphs = [torch.cuda.CUDAGraph() for _ in range(pair.EP)]
        for r in range(pair.EP):
            with torch.cuda.graph(graphs[r], stream=pair.streams[r]):
                pair.overlapped(r, static, outs[r])
        for _ in range(5):
            fresh = [pair.inputs(counts), pair.inputs(counts)]
            for (ids, xs), (new_ids, new_xs) in zip(static, fresh):
                for r in range(pair.EP):
                    ids[r].copy_(new_ids[r])
                    xs[r].copy_(new_xs[r])
            want = [[o.clone() for o in outs_r] for outs_r in on_streams(pair.streams,
                                                                         lambda r: pair.serial(r, fresh))]
            for outs_r in outs:
                for o in outs_r:
                    o.fill_(float("nan"))
            on_streams(pair.streams, lambda r: graphs[r].replay())
            torch.cuda.synchronize()
            pair.check([[o.clone() for o in outs_r] for outs_r in outs], want)
    finally:
        pair.close()


def test_a_receive_outside_the_capture_of_its_send_is_refused_clearly():
    """The send half captured (its transfer joined back by hand, so that the capture ends cleanly) and its receive
    called eagerly after it: refused with a message naming both, before anything is queued."""
    a2a = fa.MoeAlltoAll(OneRank(), max_num_tokens=16, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
                         comm_stream=True)
    ids = torch.zeros(16, TOP_K, dtype=torch.int64, device="cuda")
    x = torch.zeros(16, HIDDEN, dtype=torch.bfloat16, device="cuda")
    try:
        a2a.dispatch(ids, [x])  # eager first: the module is loaded, the views made
        a2a.combine()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            a2a.dispatch_send(ids, [x])
            torch.cuda.current_stream().wait_stream(a2a._transport.comm_stream.stream)  # joined: the capture ends
        with pytest.raises(RuntimeError, match=unjoined_capture.RECEIVE_REFUSED):
            a2a.dispatch_recv()
    finally:
        torch.cuda.synchronize()
        a2a.destroy()


def test_a_capture_with_a_send_and_no_receive_is_refused_clearly():
    """CUDA refuses to end a capture whose communication stream was not joined back, and the receive after it is
    refused by the package: in a process of its own (tests/gpu/unjoined_capture.py), since torch's failed capture
    leaves its CUDA generator in capture mode for the rest of the process."""
    proc = subprocess.run([sys.executable, "-m", "tests.gpu.unjoined_capture"], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "capture refused: " in proc.stdout and "receive refused" in proc.stdout, out[-6000:]


def test_compiled_overlapped_step_equals_the_serial_one():
    """torch.compile of the overlapped step through MoeAlltoAll's methods (inductor): the halves are graph breaks
    and run eagerly, the experts between them compiled; fullgraph=True is refused. One rank, as in
    test_split_phase: simulated ranks driven from one thread cannot run a compiled step, whose first call loads its
    kernels while its receive waits for a rank not launched yet."""
    a2a = [fa.MoeAlltoAll(OneRank(), max_num_tokens=32, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
                          comm_stream=True, namespace=f"compiled {m}") for m in range(2)]
    gen = torch.Generator().manual_seed(torch.seed())

    def overlapped(ids_a, x_a, ids_b, x_b):
        a2a[0].dispatch_send(ids_a, [x_a])
        a2a[1].dispatch_send(ids_b, [x_b])
        (ra,), _ = a2a[0].dispatch_recv()
        a2a[0].combine_send(_experts(ra, 0))
        (rb,), _ = a2a[1].dispatch_recv()
        a2a[1].combine_send(_experts(rb, 0))
        return a2a[0].combine_recv(), a2a[1].combine_recv()

    def serial(ids_a, x_a, ids_b, x_b):
        outs = []
        for a, ids, x in ((a2a[0], ids_a, x_a), (a2a[1], ids_b, x_b)):
            (recv,), _ = a.dispatch(ids, [x])
            outs.append(a.combine(_experts(recv, 0)))
        return outs

    torch._dynamo.reset()
    compiled = torch.compile(overlapped)
    try:
        for tokens in (32, 32, 9):
            ids = [ref.random_topk_ids(tokens, TOP_K, EXPERTS, generator=gen).cuda() for _ in range(2)]
            xs = [torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda() for _ in range(2)]
            args = (ids[0], xs[0], ids[1], xs[1])
            want = [o.clone() for o in serial(*args)]
            got = compiled(*args)
            torch.cuda.synchronize()
            for m in range(2):
                fa.check_error(a2a[m].workspace, 0)
                assert ref.bitwise_equal(got[m].cpu(), want[m].cpu()), f"micro-batch {m}"
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported):
            torch.compile(overlapped, fullgraph=True)(*args)
        got = compiled(*args)  # the refused trace left nothing pending: the next step runs as before
        torch.cuda.synchronize()
        assert all(ref.bitwise_equal(g.cpu(), w.cpu()) for g, w in zip(got, serial(*args)))
    finally:
        for a in a2a:
            a.destroy()
