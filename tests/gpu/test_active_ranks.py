"""Active-rank sets and EPLB statistics on simulated ranks: the ranks outside the set make no calls, the others'
steps drop what was routed there and never wait for them, eagerly and in CUDA graphs that follow the set in force
at replay; a rank taken back after missing steps runs in step again. Bitwise against the reference."""

from __future__ import annotations

import pytest
import torch

from flashinfer_a2a import functional as F
from flashinfer_a2a import split_phase
from flashinfer_a2a import reference as ref
from flashinfer_a2a.library import active_ranks as act
from flashinfer_a2a.library.errors import check_error, metadata_offsets
from flashinfer_a2a.testing.simulate import SimulatedRanks

from .cases import poison_, scramble_

EP, TOP_K, EXPERTS, HIDDEN, MAX_TOKENS, EPLB = 4, 4, 16, 256, 32, 20


@pytest.fixture
def sim():
    config = F.WorkspaceConfig(ep_size=EP, max_num_tokens=MAX_TOKENS, top_k=TOP_K,
                               dispatch_bytes_per_token=HIDDEN * 2 + TOP_K * 4,
                               combine_bytes_per_token=HIDDEN * 2)
    return SimulatedRanks(config, "cuda")


def _inputs(gen: torch.Generator, tokens: list[int]):
    ids, payloads, stats = [], [], []
    for n in tokens:
        topk = ref.random_topk_ids(n, TOP_K, EXPERTS, generator=gen, minus_one_frac=0.1)
        hidden = ref.random_payload(n, (HIDDEN,), torch.bfloat16, generator=gen)
        ids.append(topk.cuda())
        payloads.append([hidden.cuda(), topk.cuda()])
        stats.append(torch.randint(-2**31, 2**31 - 1, (EPLB,), generator=gen, dtype=torch.int32).cuda())
    return ids, payloads, stats


def _step(sim: SimulatedRanks, active: list[int], gen: torch.Generator, runtime_max: int = MAX_TOKENS):
    """One dispatch and combine of the ranks in ``active``, checked bitwise against the reference with that set."""
    tokens = [int(torch.randint(0, runtime_max + 1, (1,), generator=gen)) for _ in range(EP)]
    ids, payloads, stats = _inputs(gen, tokens)
    scramble_(sim.workspace[:, metadata_offsets()["metadata_bytes"]:])  # regions and EPLB rows: stale-looking bytes
    counts = [poison_(torch.empty(EP, dtype=torch.int32, device="cuda")) for _ in range(EP)]
    sent = sim.run(lambda r: F.dispatch(sim.workspace, r, sim.config, ids[r], payloads[r], runtime_max, EXPERTS,
                                        timeout_s=20.0, num_sms=sim.dispatch_sms, eplb_local_stats=stats[r]),
                   ranks=active)
    torch.cuda.synchronize()
    want = ref.reference_dispatch([i.cpu() for i in ids], [[p.cpu() for p in ps] for ps in payloads], EXPERTS,
                                  runtime_max, active_ranks=active)
    for i, r in enumerate(active):
        check_error(sim.workspace, r)
        views, got_counts = sent[i]
        counts[r] = got_counts
        assert torch.equal(got_counts.cpu(), want.recv_counts[r]), (r, got_counts, want.recv_counts[r])
        valid = ref.valid_row_mask(want.recv_counts[r], runtime_max)
        for p, view in enumerate(views):
            assert ref.bitwise_equal(view[valid].cpu(), want.recv_payloads[r][p][valid]), (r, p)
        gathered = F.eplb_gathered_stats(sim.workspace, r, sim.config, EPLB).cpu()
        for src in range(EP):
            expected = stats[src].cpu() if src in active else torch.zeros(EPLB, dtype=torch.int32)
            assert torch.equal(gathered[src], expected), (r, src)
    partials = [poison_(torch.empty(EP, runtime_max, HIDDEN, dtype=torch.bfloat16, device="cuda")) for _ in range(EP)]
    for r in active:  # the rows a rank received get finite partials (sums of NaNs differ in their payload bits);
        # the rest stay poison (never read)
        valid = ref.valid_row_mask(want.recv_counts[r], runtime_max).cuda()
        partials[r][valid] = torch.randn(int(valid.sum()), HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    outs = [poison_(torch.empty(tokens[r], HIDDEN, dtype=torch.bfloat16, device="cuda")) for r in range(EP)]
    sim.run(lambda r: F.combine(sim.workspace, r, sim.config, counts[r], tokens[r], runtime_max, partials[r],
                                out=outs[r], timeout_s=20.0), ranks=active)
    torch.cuda.synchronize()
    combined = ref.reference_combine([p.cpu() for p in partials], [i.cpu() for i in ids], EXPERTS,
                                     active_ranks=active)
    for r in active:
        check_error(sim.workspace, r)
        assert ref.bitwise_equal(outs[r].cpu(), combined[r]), r


def _set(sim: SimulatedRanks, active: list[int]) -> None:
    sim.run(lambda r: F.set_active_ranks(sim.workspace, r, EP, active), ranks=active)


def _take_back(sim: SimulatedRanks, active: list[int]) -> None:
    """What MoeAlltoAll.set_active_ranks does for ranks coming back: they take the epoch of the ranks that stayed."""
    torch.cuda.synchronize()
    latest = act.latest_epoch(act.read_epoch(sim.workspace, r) for r in range(EP))
    for r in range(EP):
        act.write_epoch(sim.workspace, r, latest)
    _set(sim, active)


def test_inactive_ranks_are_dropped_and_taken_back(sim):
    gen = torch.Generator().manual_seed(67)
    current = list(range(EP))
    _step(sim, current, gen)
    for active in ([0, 1, 3], [1, 3], [0, 1, 2, 3], [0, 2], list(range(EP))):
        if set(active) - set(current):
            _take_back(sim, active)
        else:
            _set(sim, active)
        current = active
        for _ in range(3):
            _step(sim, active, gen, runtime_max=int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen)))


def test_a_graph_follows_the_set_in_force_at_replay(sim):
    gen = torch.Generator().manual_seed(68)
    three = [0, 1, 3]
    tokens, runtime_max = [7, 12, 0, 9], 16
    ids, payloads, stats = _inputs(gen, tokens)
    outs = [torch.empty(tokens[r], HIDDEN, dtype=torch.bfloat16, device="cuda") for r in range(EP)]
    partials = [torch.empty(EP, runtime_max, HIDDEN, dtype=torch.bfloat16, device="cuda") for _ in range(EP)]

    def step(active: list[int]) -> None:  # in halves, as SimulatedRanks captures every step
        sent = sim.run(lambda r: split_phase.dispatch_send(sim.workspace, r, sim.config, ids[r], payloads[r],
                                                           runtime_max, EXPERTS, recv_counts=counts_of[r],
                                                           timeout_s=20.0, num_sms=sim.dispatch_sms,
                                                           eplb_local_stats=stats[r]), ranks=active)
        assert all(got is counts_of[r] for r, (_, got) in zip(active, sent))
        sim.run(lambda r: split_phase.dispatch_recv(sim.workspace, r, sim.config, counts_of[r], runtime_max,
                                                    timeout_s=20.0), ranks=active)
        sim.run(lambda r: split_phase.combine_send(sim.workspace, r, sim.config, counts_of[r], runtime_max,
                                                   partials[r], timeout_s=20.0), ranks=active)
        sim.run(lambda r: split_phase.combine_recv(sim.workspace, r, sim.config, counts_of[r], tokens[r],
                                                   runtime_max, partials[r], out=outs[r], timeout_s=20.0),
                ranks=active)

    counts_of = [torch.empty(EP, dtype=torch.int32, device="cuda") for _ in range(EP)]
    step(list(range(EP)))  # eager warm-up of every kernel
    torch.cuda.synchronize()
    graphs = {}
    for name, active in (("all", list(range(EP))), ("three", three)):
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            step(active)

    def replay(name: str, active: list[int]) -> None:
        for r in range(EP):
            partials[r].copy_(torch.randn(EP, runtime_max, HIDDEN, generator=gen).to(torch.bfloat16))
            poison_(outs[r])
            poison_(counts_of[r])
        graphs[name].replay()
        torch.cuda.synchronize()
        want = ref.reference_dispatch([i.cpu() for i in ids], [[p.cpu() for p in ps] for ps in payloads], EXPERTS,
                                      runtime_max, active_ranks=active)
        combined = ref.reference_combine([p.cpu() for p in partials], [i.cpu() for i in ids], EXPERTS,
                                         active_ranks=active)
        for r in active:
            check_error(sim.workspace, r)
            assert torch.equal(counts_of[r].cpu(), want.recv_counts[r]), (name, r)
            assert ref.bitwise_equal(outs[r].cpu(), combined[r]), (name, r)
            gathered = F.eplb_gathered_stats(sim.workspace, r, sim.config, EPLB).cpu()
            assert torch.equal(gathered[2], stats[2].cpu() if 2 in active else torch.zeros(EPLB, dtype=torch.int32))

    replay("all", list(range(EP)))
    _set(sim, three)
    replay("three", three)  # captured while every rank was active: it follows the set of the replay
    replay("three", three)
    _take_back(sim, list(range(EP)))
    replay("all", list(range(EP)))
