"""Split-phase dispatch and combine, and the SM budget, on simulated ranks: two micro-batches in flight on two
workspaces, their calls interleaved, equal bit for bit to running them one after the other and to the reference."""

import dataclasses

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a import split_phase as sp
from flashinfer_a2a.library.errors import metadata_offsets
from flashinfer_a2a.testing.simulate import SimulatedRanks
from flashinfer_a2a.transports import overlap

from .cases import scramble_

HIDDEN, TOP_K, EXPERTS = 1024, 4, 16


def _config(ep_size, max_tokens):
    return fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=max_tokens,
                              dispatch_bytes_per_token=HIDDEN * 2 + TOP_K * 4, combine_bytes_per_token=HIDDEN * 2,
                              top_k=TOP_K)


@dataclasses.dataclass
class Batch:
    ids: list
    hidden: list

    @property
    def tokens(self):
        return [t.shape[0] for t in self.ids]


def _batch(tokens, gen):
    ids = [ref.random_topk_ids(n, TOP_K, EXPERTS, generator=gen) for n in tokens]
    hidden = [torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16) for n in tokens]
    return Batch([t.cuda() for t in ids], [h.cuda() for h in hidden])


def _experts(recv_hidden, rank):
    """Toy experts, exact on CPU and GPU alike: a power-of-two scale per rank."""
    return (recv_hidden.float() * 2.0 ** -(rank + 1)).to(torch.bfloat16)


def _load_torch_kernels():
    """Launches once every torch kernel these tests run between cross-rank calls. With lazy module loading the
    first launch of a kernel may synchronize the device: it would wait on a rank spinning for a peer whose calls the
    host has not launched yet, until the spin times out."""
    x = torch.ones(2, 3, HIDDEN, dtype=torch.bfloat16, device="cuda")
    y = _experts(x, 0)
    x.copy_(y)
    x[0, :1] = y[0, :1] * 2
    y.clone().fill_(float("nan"))
    torch.ones(2, dtype=torch.int32, device="cuda").clone()
    torch.cuda.synchronize()


def _poison(*sims):
    for sim in sims:
        scramble_(sim.workspace[:, metadata_offsets()["metadata_bytes"]:])


def _whole(sim, batch, runtime_max, num_sms=0):
    """dispatch -> experts -> combine with the whole calls; per rank (out, recv_counts)."""
    config = sim.config

    def rank_fn(r):
        (recv,), counts = fa.dispatch(sim.workspace, r, config, batch.ids[r], [batch.hidden[r]], runtime_max,
                                      EXPERTS)
        out = fa.combine(sim.workspace, r, config, counts, batch.tokens[r], runtime_max, _experts(recv, r),
                         num_sms=num_sms)
        return out, counts.clone()

    return sim.run(rank_fn)


def _interleaved_rank(config, wa, wb, ids_a, hidden_a, ids_b, hidden_b, r, runtime_max, num_sms, comm=None):
    """One rank's step of dual-batch overlap: send A, send B, receive A, experts A, send A's partials, receive B,
    experts B (zero copy), send B's partials, receive both combines. ``comm``: the rank's communication stream, where
    each send half queues both kernels of its call (the combine's output is then the send's)."""
    (va,), ca = sp.dispatch_send(wa, r, config, ids_a, [hidden_a], runtime_max, EXPERTS, num_sms=num_sms,
                                 comm_stream=comm)
    (vb,), cb = sp.dispatch_send(wb, r, config, ids_b, [hidden_b], runtime_max, EXPERTS, num_sms=num_sms,
                                 comm_stream=comm)
    sp.dispatch_recv(wa, r, config, ca, runtime_max, comm_stream=comm)
    pa = _experts(va, r)  # on a communication stream: held by the transfer until its join
    oa, ob = ((None, None) if comm is None else
              [torch.empty(ids.shape[0], HIDDEN, dtype=torch.bfloat16, device="cuda") for ids in (ids_a, ids_b)])
    sp.combine_send(wa, r, config, ca, runtime_max, pa, num_sms=num_sms, out=oa, comm_stream=comm)
    sp.dispatch_recv(wb, r, config, cb, runtime_max, comm_stream=comm)
    fa.combine_input(wb, r, config, runtime_max, HIDDEN, torch.bfloat16).copy_(_experts(vb, r))
    sp.combine_send(wb, r, config, cb, runtime_max, hidden=HIDDEN, dtype=torch.bfloat16, num_sms=num_sms, out=ob,
                    comm_stream=comm)
    oa = sp.combine_recv(wa, r, config, ca, ids_a.shape[0], runtime_max, pa, num_sms=num_sms, out=oa,
                         comm_stream=comm)
    ob = sp.combine_recv(wb, r, config, cb, ids_b.shape[0], runtime_max, hidden=HIDDEN, dtype=torch.bfloat16,
                         num_sms=num_sms, out=ob, comm_stream=comm)
    return oa, ob, ca, cb, va, vb


def _step(config, sim_a, sim_b, a, b, r, runtime_max, num_sms=0, comm=None):
    return _interleaved_rank(config, sim_a.workspace, sim_b.workspace, a.ids[r], a.hidden[r], b.ids[r], b.hidden[r],
                             r, runtime_max, num_sms, comm[r] if comm else None)


def comm_streams(ep_size, on_stream=True):
    """A communication stream per rank (``on_stream``), else None."""
    if not on_stream:
        return None
    return [overlap.for_stream(torch.cuda.Stream(priority=overlap.PRIORITY)) for _ in range(ep_size)]


def _reference(batch, runtime_max):
    expected = ref.reference_dispatch([t.cpu() for t in batch.ids], [[h.cpu()] for h in batch.hidden], EXPERTS,
                                      runtime_max)
    partials = [_experts(expected.recv_payloads[d][0], d) for d in range(len(batch.ids))]
    return expected, ref.reference_combine(partials, expected)


@pytest.mark.parametrize("ep_size, tokens, runtime_max, num_sms", [
    (2, (37, 0), 40, 0),
    (2, (1, 1), 1, 0),
    (4, (300, 5, 0, 129), 300, 0),
    (4, (300, 5, 0, 129), 300, 1),  # one multiprocessor's worth: every kernel loops over its work
    (3, (64, 64, 64), 64, 3),
])
@pytest.mark.parametrize("on_stream", [False, True], ids=["one stream", "comm stream"])
def test_interleaved_micro_batches_equal_sequential(ep_size, tokens, runtime_max, num_sms, on_stream):
    """The halves on the caller's stream, or on a communication stream per rank (both kernels of each call queued
    by its send half, the receive half a join)."""
    _load_torch_kernels()
    gen = torch.Generator().manual_seed(torch.seed())
    config = _config(ep_size, runtime_max)
    sim_a, sim_b = SimulatedRanks(config), SimulatedRanks(config)
    comm = comm_streams(ep_size, on_stream)
    for _ in range(2):  # a second round: the epochs the split calls advance stay in step with the whole calls
        a = _batch(tokens, gen)
        b = _batch(tuple(reversed(tokens)), gen)
        want_a, want_b = _reference(a, runtime_max), _reference(b, runtime_max)
        _poison(sim_a, sim_b)
        got = sim_a.run(lambda r: _step(config, sim_a, sim_b, a, b, r, runtime_max, num_sms, comm))
        torch.cuda.synchronize()
        for sim in (sim_a, sim_b):  # a timeout also reads as a count of 0
            for r in range(ep_size):
                fa.check_error(sim.workspace, r)
        for r in range(ep_size):
            oa, ob, ca, cb, va, vb = got[r]
            for (expected, want_out), counts, view, out in ((want_a, ca, va, oa), (want_b, cb, vb, ob)):
                assert torch.equal(counts.cpu(), expected.recv_counts[r]), f"recv_counts of rank {r}"
                mask = ref.valid_row_mask(expected.recv_counts[r], runtime_max)
                assert ref.bitwise_equal(view.cpu()[mask], expected.recv_payloads[r][0][mask]), f"rows of rank {r}"
                assert ref.bitwise_equal(out.cpu(), want_out[r]), f"combine on rank {r}"
        _poison(sim_a, sim_b)
        seq_a = _whole(sim_a, a, runtime_max)
        seq_b = _whole(sim_b, b, runtime_max)
        torch.cuda.synchronize()
        for r in range(ep_size):
            assert ref.bitwise_equal(got[r][0].cpu(), seq_a[r][0].cpu()), f"interleaved != sequential, rank {r}"
            assert ref.bitwise_equal(got[r][1].cpu(), seq_b[r][0].cpu()), f"interleaved != sequential, rank {r}"
    for sim in (sim_a, sim_b):
        for r in range(ep_size):
            fa.check_error(sim.workspace, r)


@pytest.mark.parametrize("dispatch_quant, combine_quant", [(None, None), ("fp8_block", "fp8_block"),
                                                           ("mxfp8", None)])
@pytest.mark.parametrize("num_sms", [0, 2])
def test_split_calls_equal_whole_calls(dispatch_quant, combine_quant, num_sms):
    """Receive rows, counts and combine output of send + receive equal the whole calls' bit for bit, quantized
    wires included; the SM budget changes no bit either."""
    _load_torch_kernels()
    gen = torch.Generator().manual_seed(torch.seed())
    ep_size, runtime_max = 2, 96
    tokens = (96, 33)
    config = fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=runtime_max,
                                dispatch_bytes_per_token=HIDDEN * 2 + TOP_K * 4,
                                combine_bytes_per_token=HIDDEN * 2 + 128, top_k=TOP_K)
    sim = SimulatedRanks(config)
    batch = _batch(tokens, gen)
    kw = dict(quant_format=dispatch_quant)
    # Made before the ranks' calls: a copy from pageable host memory waits for the stream, which may hold a rank
    # spinning on a peer the host has not launched yet.
    parts = [torch.randn(ep_size, runtime_max, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
             for _ in range(ep_size)]

    def whole(r):
        recv, counts = fa.dispatch(sim.workspace, r, config, batch.ids[r], [batch.hidden[r], batch.ids[r]],
                                   runtime_max, EXPERTS, **kw)
        out = fa.combine(sim.workspace, r, config, counts, tokens[r], runtime_max, parts[r],
                         quant_format=combine_quant)
        return recv, counts, out

    def split(r):
        recv, counts = sp.dispatch_send(sim.workspace, r, config, batch.ids[r], [batch.hidden[r], batch.ids[r]],
                                        runtime_max, EXPERTS, num_sms=num_sms, **kw)
        sp.dispatch_recv(sim.workspace, r, config, counts, runtime_max)
        sp.combine_send(sim.workspace, r, config, counts, runtime_max, parts[r], quant_format=combine_quant,
                        num_sms=num_sms)
        out = sp.combine_recv(sim.workspace, r, config, counts, tokens[r], runtime_max, parts[r],
                              quant_format=combine_quant, num_sms=num_sms)
        return recv, counts, out

    def run(fn):  # the receive views are cloned once every rank is done: the next dispatch overwrites them
        _poison(sim)
        results = sim.run(fn)
        torch.cuda.synchronize()
        return [([v.cpu() for v in recv], counts.cpu(), out.cpu()) for recv, counts, out in results]

    want = run(whole)
    got = run(split)
    for r in range(ep_size):
        (want_recv, want_counts, want_out), (got_recv, got_counts, got_out) = want[r], got[r]
        assert torch.equal(got_counts, want_counts)
        mask = ref.valid_row_mask(want_counts, runtime_max)
        for p, (g, w) in enumerate(zip(got_recv, want_recv)):
            assert ref.bitwise_equal(g[mask], w[mask]), f"payload {p} on rank {r}"  # row-major views only here
        assert ref.bitwise_equal(got_out, want_out), f"combine on rank {r}"
        fa.check_error(sim.workspace, r)


@pytest.mark.parametrize("on_stream", [False, True], ids=["one stream", "comm stream"])
def test_cuda_graph_of_interleaved_step_replays_like_eager(on_stream):
    """Each rank captures its interleaved step (two workspaces; on a communication stream, forked and joined inside
    the capture) in a graph on its own stream; replays stay in step with eager whole calls through the epochs in
    device memory."""
    _load_torch_kernels()
    gen = torch.Generator().manual_seed(torch.seed())
    ep_size, tokens, runtime_max = 2, (24, 17), 24
    config = _config(ep_size, runtime_max)
    sim_a, sim_b = SimulatedRanks(config), SimulatedRanks(config)
    comm = comm_streams(ep_size, on_stream)
    static_a, static_b = _batch(tokens, gen), _batch(tokens, gen)
    sim_a.run(lambda r: _step(config, sim_a, sim_b, static_a, static_b, r, runtime_max, comm=comm))
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(ep_size)]
    outs = []
    for r in range(ep_size):
        with torch.cuda.graph(graphs[r], stream=sim_a.streams[r]):
            outs.append(_step(config, sim_a, sim_b, static_a, static_b, r, runtime_max, comm=comm)[:2])
    torch.cuda.synchronize()
    for _ in range(20):
        a, b = _batch(tokens, gen), _batch(tokens, gen)
        for static, fresh in ((static_a, a), (static_b, b)):
            for r in range(ep_size):
                static.ids[r].copy_(fresh.ids[r])
                static.hidden[r].copy_(fresh.hidden[r])
        want_a = [o.clone() for o, _ in _whole(sim_a, a, runtime_max)]
        want_b = [o.clone() for o, _ in _whole(sim_b, b, runtime_max)]
        for oa, ob in outs:
            oa.fill_(float("nan"))
            ob.fill_(float("nan"))
        sim_a.run(lambda r: graphs[r].replay())
        torch.cuda.synchronize()
        for r in range(ep_size):
            assert ref.bitwise_equal(outs[r][0].cpu(), want_a[r].cpu())
            assert ref.bitwise_equal(outs[r][1].cpu(), want_b[r].cpu())
    for sim in (sim_a, sim_b):
        for r in range(ep_size):
            fa.check_error(sim.workspace, r)


def test_compile_fullgraph_split_step_matches_eager():
    """The interleaved step compiled whole by inductor, as the existing whole-call layer is: the receive views are
    taken after the receives and the partials are tensors, the shape of graph whose workspace mutations inductor
    keeps in place (a backend that keeps functionalization's copies, such as aot_eager, would run the ops on a
    private copy of the workspace, which no peer sees).

    One rank: simulated ranks driven from one thread cannot run a compiled step, whose first call loads its Triton
    kernels (a device synchronization) while its receive waits for a rank not launched yet. The bitwise checks of
    several ranks are the eager tests above; this one checks what compiling changes."""
    _load_torch_kernels()
    gen = torch.Generator().manual_seed(torch.seed())
    ep_size, tokens, runtime_max = 1, (13,), 16
    config = _config(ep_size, runtime_max)
    sim_a, sim_b = SimulatedRanks(config), SimulatedRanks(config)

    def step(wa, wb, ids_a, hidden_a, ids_b, hidden_b, r):
        _, ca = sp.dispatch_send(wa, r, config, ids_a, [hidden_a], runtime_max, EXPERTS)
        _, cb = sp.dispatch_send(wb, r, config, ids_b, [hidden_b], runtime_max, EXPERTS)
        sp.dispatch_recv(wa, r, config, ca, runtime_max)
        (va,) = fa.functional.recv_views(wa, r, config, runtime_max, [hidden_a])
        pa = _experts(va, r)
        sp.combine_send(wa, r, config, ca, runtime_max, pa)
        sp.dispatch_recv(wb, r, config, cb, runtime_max)
        (vb,) = fa.functional.recv_views(wb, r, config, runtime_max, [hidden_b])
        pb = _experts(vb, r)
        sp.combine_send(wb, r, config, cb, runtime_max, pb)
        oa = sp.combine_recv(wa, r, config, ca, ids_a.shape[0], runtime_max, pa)
        ob = sp.combine_recv(wb, r, config, cb, ids_b.shape[0], runtime_max, pb)
        return oa, ob

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(2):
        a, b = _batch(tokens, gen), _batch(tokens, gen)
        args = lambda r: (sim_a.workspace, sim_b.workspace, a.ids[r], a.hidden[r], b.ids[r], b.hidden[r], r)  # noqa
        eager = [(oa.cpu(), ob.cpu()) for oa, ob in sim_a.run(lambda r: step(*args(r)))]
        got = sim_a.run(lambda r: compiled(*args(r)))
        torch.cuda.synchronize()
        for sim in (sim_a, sim_b):
            for r in range(ep_size):
                fa.check_error(sim.workspace, r)
        for r in range(ep_size):
            assert ref.bitwise_equal(got[r][0].cpu(), eager[r][0])
            assert ref.bitwise_equal(got[r][1].cpu(), eager[r][1])


def test_opcheck_dispatch_recv():
    config = _config(1, 8)
    sim = SimulatedRanks(config)
    gen = torch.Generator().manual_seed(torch.seed())
    batch = _batch((8,), gen)
    counts = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    sp.dispatch_send(sim.workspace, 0, config, batch.ids[0], [batch.hidden[0]], 8, EXPERTS, recv_counts=counts)
    from flashinfer_a2a.library import ops

    # opcheck runs the op on copies of the arguments, several times; each waits for the epoch the send advanced to,
    # already reached. Then the receive itself, into counts.
    torch.library.opcheck(ops.dispatch_recv.overload, (sim.workspace, counts, 0, *config.sizes(), 8, 5.0))
    ops.dispatch_recv(sim.workspace, counts, 0, *config.sizes(), 8, 5.0)
    torch.cuda.synchronize()
    assert counts.tolist() == [8]
    fa.check_error(sim.workspace, 0)


def test_moe_alltoall_split_calls_one_rank():
    """MoeAlltoAll's split calls as a group of one rank, under an SM budget: cached views, the call order checked
    before any launch, the same results as the whole calls."""
    from .test_moe_alltoall_one_rank import OneRank

    a2a = fa.MoeAlltoAll(OneRank(), max_num_tokens=64, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
                         num_sms=1)
    gen = torch.Generator().manual_seed(torch.seed())
    try:
        with pytest.raises(RuntimeError, match="dispatch_recv called without a pending dispatch"):
            a2a.dispatch_recv()
        for tokens, runtime_max in ((40, 64), (0, 9), (64, 64)):
            ids = ref.random_topk_ids(tokens, TOP_K, EXPERTS, generator=gen).cuda()
            x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
            a2a.dispatch_send(ids, [x, ids], runtime_max)
            with pytest.raises(RuntimeError, match="call dispatch_recv first"):
                a2a.combine()
            (recv_x, recv_ids), counts = a2a.dispatch_recv()
            partials = a2a.combine_input()
            partials.fill_(float("nan"))  # rows past the count must not be read
            partials[0, :tokens] = recv_x[0, :tokens] * 2
            a2a.combine_send()
            with pytest.raises(RuntimeError, match="call combine_recv first"):
                a2a.dispatch_send(ids, [x, ids], runtime_max)
            out = torch.full((tokens, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda")
            assert a2a.combine_recv(out=out) is out
            torch.cuda.synchronize()
            assert counts.tolist() == [tokens]
            assert torch.equal(recv_x[0, :tokens], x) and torch.equal(recv_ids[0, :tokens], ids)
            assert torch.equal(out, x * 2)
            # And the whole calls on the same object, in between.
            (recv_x, _), counts = a2a.dispatch(ids, [x, ids], runtime_max)
            a2a.combine_input()[0, :tokens] = recv_x[0, :tokens] * 4
            whole = a2a.combine()
            torch.cuda.synchronize()
            assert torch.equal(whole, x * 4)
        fa.check_error(a2a.workspace, 0)
    finally:
        a2a.destroy()
