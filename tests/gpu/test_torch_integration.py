"""opcheck, torch.compile(fullgraph=True) and CUDA-graph capture of dispatch and combine."""

import torch

import flashinfer_a2a as fa
from flashinfer_a2a.library import ops
from flashinfer_a2a import reference as ref
from flashinfer_a2a.testing.simulate import SimulatedRanks

HIDDEN, TOP_K, EXPERTS = 2048, 4, 16


def _inputs(ep_size, tokens, gen):
    ids = [ref.random_topk_ids(tokens, TOP_K, EXPERTS, generator=gen).cuda() for _ in range(ep_size)]
    hidden = [torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda() for _ in range(ep_size)]
    return ids, hidden


def _config(ep_size, max_tokens):
    return fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=max_tokens, dispatch_bytes_per_token=HIDDEN * 2,
                              combine_bytes_per_token=HIDDEN * 2, top_k=TOP_K)


def test_opcheck_dispatch_and_combine():
    gen = torch.Generator().manual_seed(torch.seed())
    config = _config(1, 32)
    sim = SimulatedRanks(config)
    ids, hidden = _inputs(1, 32, gen)
    recv_counts = torch.empty(1, dtype=torch.int32, device="cuda")
    dispatch_args = (sim.workspace, ids[0], [hidden[0]], recv_counts, 0, *config.sizes(), 32, EXPERTS, 5.0)
    torch.library.opcheck(ops.dispatch.overload, dispatch_args)
    # opcheck runs the op on copies too: one real dispatch leaves the routing record combine reads.
    ops.dispatch(*dispatch_args)
    partials = torch.randn(1, 32, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty(32, HIDDEN, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(ops.combine.overload,
                          (sim.workspace, partials, recv_counts, out, 0, *config.sizes(), 32, 5.0, False))
    ops.combine(sim.workspace, partials, recv_counts, out, 0, *config.sizes(), 32, 5.0, False)
    torch.cuda.synchronize()
    assert torch.equal(out, partials[0])  # one rank: every token's sum is its own partial
    fa.check_error(sim.workspace, 0)


def _moe_layer(workspace, rank, config, ids, hidden, runtime_max):
    (recv_hidden, recv_ids), counts = fa.dispatch(workspace, rank, config, ids, [hidden, ids], runtime_max, EXPERTS)
    # Toy expert: scale by (1 + the first expert id owned here, as a number) — depends on the received data only.
    partial = (recv_hidden.float() * (1.0 + recv_ids[..., :1].float() / 64)).to(torch.bfloat16)
    return fa.combine(workspace, rank, config, counts, ids.shape[0], runtime_max, partial)


def test_compile_fullgraph_matches_eager(monkeypatch):
    """Each rank's compiled call equals its eager call, bit for bit, with nothing recorded in the error record.

    One thread drives both ranks, and loading a kernel for the first time can synchronize the device (inductor's
    Triton kernels, the eager experts' torch kernels) while the other rank's kernels wait for it: a first round
    loads and builds everything, eager and compiled, with a short timeout that such a stall may hit, and the
    workspace is initialized again after it. The checked rounds then poison each rank's receive region between the
    eager and the compiled call, so no row can come from the eager one."""
    monkeypatch.setenv("FLASHINFER_A2A_TIMEOUT_S", "2")  # read while tracing: the compiled calls keep it
    gen = torch.Generator().manual_seed(torch.seed())
    ep_size, tokens = 2, 48
    config = fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=tokens,
                                dispatch_bytes_per_token=HIDDEN * 2 + TOP_K * 4, combine_bytes_per_token=HIDDEN * 2,
                                top_k=TOP_K)
    sim = SimulatedRanks(config)
    compiled = torch.compile(_moe_layer, fullgraph=True)
    ids, hidden = _inputs(ep_size, tokens, gen)
    for layer in (_moe_layer, compiled):  # loads and builds every kernel; may time out (see above)
        sim.run(lambda r: layer(sim.workspace, r, config, ids[r], hidden[r], tokens).clone())
        torch.cuda.synchronize()
    sim.initialize()
    for _ in range(3):
        ids, hidden = _inputs(ep_size, tokens, gen)
        eager = sim.run(lambda r: _moe_layer(sim.workspace, r, config, ids[r], hidden[r], tokens).clone())
        torch.cuda.synchronize()
        for r in range(ep_size):
            fa.check_error(sim.workspace, r)
            for view in fa.functional.recv_views(sim.workspace, r, config, tokens, [hidden[r], ids[r]]):
                view.fill_(-1)  # bf16 -1.0 rows and expert -1: neither is what the compiled dispatch receives
        got = sim.run(lambda r: compiled(sim.workspace, r, config, ids[r], hidden[r], tokens).clone())
        torch.cuda.synchronize()
        for r in range(ep_size):
            fa.check_error(sim.workspace, r)
            assert ref.bitwise_equal(got[r].cpu(), eager[r].cpu())


def test_cuda_graph_replay_matches_eager():
    """Each rank captures its own graph on its own stream, as each process does on real GPUs; replays run
    concurrently and stay in step through the epochs in device memory, interleaved with eager calls."""
    gen = torch.Generator().manual_seed(torch.seed())
    ep_size, tokens = 2, 40
    config = fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=tokens,
                                dispatch_bytes_per_token=HIDDEN * 2 + TOP_K * 4, combine_bytes_per_token=HIDDEN * 2,
                                top_k=TOP_K)
    sim = SimulatedRanks(config)
    static_ids, static_hidden = _inputs(ep_size, tokens, gen)
    sim.run(lambda r: _moe_layer(sim.workspace, r, config, static_ids[r], static_hidden[r], tokens))
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(ep_size)]
    static_out = []
    for r in range(ep_size):
        with torch.cuda.graph(graphs[r], stream=sim.streams[r]):
            static_out.append(_moe_layer(sim.workspace, r, config, static_ids[r], static_hidden[r], tokens))
    torch.cuda.synchronize()
    for _ in range(100):
        ids, hidden = _inputs(ep_size, tokens, gen)
        for r in range(ep_size):
            static_ids[r].copy_(ids[r])
            static_hidden[r].copy_(hidden[r])
        eager = sim.run(lambda r: _moe_layer(sim.workspace, r, config, ids[r], hidden[r], tokens).clone())
        for out in static_out:
            out.fill_(float("nan"))
        sim.run(lambda r: graphs[r].replay())
        torch.cuda.synchronize()
        for r in range(ep_size):
            assert ref.bitwise_equal(static_out[r].cpu(), eager[r].cpu())
    for r in range(ep_size):
        fa.check_error(sim.workspace, r)
