"""Mismatched calls refused, memory that outlives destroy(), steps ordered across streams: on one GPU (simulated ranks, or a
MoeAlltoAll group of one rank)."""

import gc

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import MoeAlltoAll
from flashinfer_a2a import reference as ref
from flashinfer_a2a.testing.simulate import SimulatedRanks
from flashinfer_a2a.memory.symm_mem import SymmetricWorkspace

from .cases import Case, run_case
from .test_moe_alltoall_one_rank import OneRank

HIDDEN, TOP_K, EXPERTS, MAX_TOKENS = 256, 4, 8, 32


def _sim() -> SimulatedRanks:
    config = fa.WorkspaceConfig(ep_size=2, max_num_tokens=MAX_TOKENS, top_k=TOP_K,
                                dispatch_bytes_per_token=HIDDEN * 4 + TOP_K * 8, combine_bytes_per_token=HIDDEN * 2)
    return SimulatedRanks(config, "cuda")


def _inputs(gen, tokens, id_dtype, hidden=HIDDEN, dtype=torch.bfloat16):
    """topk_ids, and the payloads [hidden states, fp32 top-k weights] (the ids' dtype changes no payload)."""
    ids = ref.random_topk_ids(tokens, TOP_K, EXPERTS, generator=gen).to(id_dtype).cuda()
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).cuda()
    w = torch.rand(tokens, TOP_K, generator=gen).cuda()
    return ids, [x, w]


@pytest.mark.parametrize("rank1, field", [
    (dict(id_dtype=torch.int64), "topk_ids dtype"),
    (dict(hidden=128), "payload row bytes"),
    (dict(dtype=torch.float16), "payload dtypes"),
])
def test_mismatched_call_layout_is_recorded_and_no_row_is_trusted(rank1, field):
    """Rank 0 dispatches int32 ids and bf16 [*, 256] rows; rank 1 differs in one field. Each rank records an
    A2AError naming the other and the field, and counts no row from it; re-initialized, matching calls work."""
    sim = _sim()
    gen = torch.Generator().manual_seed(torch.seed())
    args = [dict(id_dtype=torch.int32), dict(dict(id_dtype=torch.int32), **rank1)]
    inputs = [_inputs(gen, 20 + 3 * r, **args[r]) for r in range(2)]
    results = sim.run(lambda r: fa.dispatch(sim.workspace, r, sim.config, inputs[r][0], inputs[r][1], MAX_TOKENS,
                                            EXPERTS, timeout_s=5.0))
    torch.cuda.synchronize()
    for r, (_, counts) in enumerate(results):
        peer = 1 - r
        with pytest.raises(fa.A2AError, match=f"rank {peer} dispatched with another call layout") as info:
            fa.check_error(sim.workspace, r)
        assert info.value.peer == peer and info.value.phase == "dispatch"
        assert f"differing: {field})" in str(info.value), str(info.value)
        assert int(counts.cpu()[peer]) == 0  # the receiver does not trust the peer's rows
    sim.initialize()
    torch.cuda.synchronize()
    run_case(Case(2, TOP_K, HIDDEN, EXPERTS, [20, 23], MAX_TOKENS), sim=sim)
    for r in range(2):
        fa.check_error(sim.workspace, r)


def test_workspace_stays_mapped_while_a_view_lives():
    symm = SymmetricWorkspace(OneRank(), 1 << 20)
    mapping = symm._mapping
    view = symm.tensor[0, 4096:8192]
    view.fill_(7)
    symm.destroy()
    assert mapping.base != 0 and mapping.mapped == [0]  # the view holds it
    view.add_(1)  # still valid memory: no fault, no dead context
    torch.cuda.synchronize()
    assert bool((view == 8).all())
    del view
    gc.collect()
    assert mapping.base == 0 and mapping.mapped == [] and mapping.own == 0  # the last view released it
    torch.cuda.synchronize()


def _moe():
    return MoeAlltoAll(OneRank(), max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN)


def test_views_outlive_destroy_and_later_calls_raise():
    a2a = _moe()
    gen = torch.Generator().manual_seed(torch.seed())
    ids, payloads = _inputs(gen, 17, torch.int32)
    (recv_x, recv_w), counts = a2a.dispatch(ids, payloads)
    a2a.combine_input().zero_()
    a2a.combine()
    a2a.destroy()
    a2a.destroy()  # idempotent
    torch.cuda.synchronize()
    assert torch.equal(recv_x[0, :17], payloads[0]) and torch.equal(recv_w[0, :17], payloads[1])  # mapped
    with pytest.raises(RuntimeError, match="destroyed"):
        a2a.dispatch(ids, payloads)
    with pytest.raises(RuntimeError, match="destroyed"):
        a2a.combine()
    del recv_x, recv_w
    gc.collect()


def test_steps_on_two_streams_are_ordered_by_the_package():
    """A dispatch on one stream, kept busy before it, and its combine on another with nothing ordering them: the
    combine waits for the dispatch (unordered, it would run first and find no counts). Both ways round, then eager
    steps after a capture on a side stream, and bind_stream for a caller that ordered the streams itself."""
    a2a = _moe()
    gen = torch.Generator().manual_seed(torch.seed())
    default, other = torch.cuda.current_stream(), torch.cuda.Stream()
    try:
        for first, second in [(default, other), (other, default), (default, other), (default, default)]:
            ids, payloads = _inputs(gen, 9 + 4 * (first is other), torch.int64)
            partials = torch.zeros(1, MAX_TOKENS, HIDDEN, dtype=torch.bfloat16, device="cuda")
            partials[0, :ids.shape[0]] = payloads[0]  # one rank: token t is received in row t
            torch.cuda.synchronize()
            with torch.cuda.stream(first):
                torch.cuda._sleep(50_000_000)  # tens of milliseconds of one busy block
                a2a.dispatch(ids, payloads)
            with torch.cuda.stream(second):
                out = torch.full_like(payloads[0], float("nan"))
                a2a.combine(partials, out=out)
            torch.cuda.synchronize()
            assert torch.equal(out, payloads[0])
            fa.check_error(a2a.workspace, 0)
        # A capture on torch.cuda.graph's own stream after eager steps on the default one, then eager again.
        ids, payloads = _inputs(gen, 11, torch.int64)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (recv_x, _), _ = a2a.dispatch(ids, payloads)
            a2a.combine_input().copy_(recv_x)
            captured = a2a.combine()
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, payloads[0])
        with torch.cuda.stream(other):
            torch.cuda.current_stream().wait_stream(default)
            a2a.bind_stream()  # ordered by the caller: taken without another wait
            (recv_x, _), _ = a2a.dispatch(ids, payloads)
            a2a.combine_input().copy_(recv_x)
            out = a2a.combine()
        torch.cuda.synchronize()
        assert torch.equal(out, payloads[0])
        fa.check_error(a2a.workspace, 0)
    finally:
        a2a.destroy()
