"""The engines' call sequences through flashinfer_a2a.compat.flashinfer on simulated ranks: SGLang's dispatcher
(one MoeAlltoAll per layer, positional calls, zero-copy combine or not, invalid id -1 or num_experts, a checkpoint
and restore between steps) and vLLM's one-sided prepare/finalize (keyword calls, combine into its output), idle
ranks included. Each is compared bit for bit with the native MoeAlltoAll and with the dense computation; and 60
layers hold one workspace's memory. Checkpoint and restore of symmetric memory shared by two processes on one GPU,
with a CUDA graph captured before it, are checked against the reference (tests/compat_workers.py)."""

import gc

import pytest
import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.compat import flashinfer as fi
from flashinfer_a2a.testing.simulated_group import SimulatedGroup

from ..compat_workers import spawn
from ..examples import example
from .simulated import on_streams, warm_up

ex = example("ep_moe_layer")
sglang = example("sglang_adapter")
vllm = example("vllm_adapter")

EP, HIDDEN, INTER, EXPERTS, TOP_K, MAX_TOKENS = 4, 512, 128, 16, 4, 64
STEPS = ([0, 64, 13, 40], [64, 64, 64, 64], [1, 0, 0, 0], [7, 7, 0, 3])


@pytest.fixture(autouse=True)
def _fresh_sizes(monkeypatch):
    monkeypatch.setattr(fi, "_SPLITS", {})


def _mapping(rank):
    return fi.Mapping(rank=rank, tp_size=EP, moe_ep_size=EP, world_size=EP, gpus_per_node=8, pp_size=1, cp_size=1)


def _compat_layers(group, size, n):
    def build(rank, comm):
        config = fi.MnnvlConfig(comm_backend=comm.comm_backend())
        return [fi.MoeAlltoAll(_mapping(rank), MAX_TOKENS, TOP_K, EXPERTS, size, mnnvl_config=config)
                for _ in range(n)]

    return group.run(build)


class Native:
    """The same step through the native API, for the bitwise comparison."""

    def __init__(self):
        self.group = SimulatedGroup(EP)
        self.a2as = self.group.run(lambda r, comm: fa.MoeAlltoAll(
            comm, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN,
            extra_dispatch_bytes_per_token=TOP_K * 8))

    def step(self, streams, xs, ids, ws, runtime_max, weights):
        def dispatch(r):
            return self.a2as[r].dispatch(ids[r], [xs[r], ids[r], ws[r]], runtime_max)

        recv = on_streams(streams, dispatch)

        def experts(r):
            (x, i, w), _ = recv[r]
            first, end = ref.rank_expert_range(r, EXPERTS, EP)
            partial = ex.expert_partials(x.view(-1, HIDDEN), i.view(-1, TOP_K), w.view(-1, TOP_K), weights, first,
                                         end)
            self.a2as[r].combine_input().copy_(partial.view(EP, runtime_max, HIDDEN))
            return self.a2as[r].combine()

        return on_streams(streams, experts), [counts for _, counts in recv]

    def close(self):
        self.group.run(lambda r, comm: self.a2as[r].destroy())


def _inputs(gen, counts, ids_dtype):
    xs = [torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16).cuda() for n in counts]
    ids = [ref.random_topk_ids(n, TOP_K, EXPERTS, generator=gen, dtype=ids_dtype).cuda() for n in counts]
    ws = [torch.rand(n, TOP_K, generator=gen).cuda() for n in counts]
    return xs, ids, ws


def _warm_up(streams, gen, weights):
    xs, ids, ws = _inputs(gen, [3, 0, 70, 1], torch.int32)
    warm_up(streams, lambda: [p.to(torch.bfloat16) for p in ex.dense_moe(xs, weights, TOP_K, EP, routing=(ids, ws))])


def _check_padding(recv_ids, counts, invalid):
    """Received id rows past each source's count hold the invalid id; valid rows are untouched ids."""
    rows = torch.arange(recv_ids.shape[1], device=recv_ids.device)
    pad = rows[None, :] >= counts[:, None].long()
    assert torch.all(recv_ids[pad] == invalid)
    assert torch.all((recv_ids[~pad] >= 0) & (recv_ids[~pad] < EXPERTS))


@pytest.mark.parametrize("invalid, zero_copy, checkpoint", [(-1, True, False), (EXPERTS, True, False),
                                                             (-1, False, False), (-1, True, True)])
def test_sglang_dispatcher_sequence(invalid, zero_copy, checkpoint):
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    weights = ex.MoEWeights.random(HIDDEN, INTER, EXPERTS, gen)
    # SGLang's arithmetic: bf16 rows, int32 ids, fp32 weights; one size for every layer
    size = fi.moe_a2a_get_workspace_size_per_rank(ep_size=EP, max_num_tokens=MAX_TOKENS,
                                                  total_dispatch_payload_size_per_token=HIDDEN * 2 + TOP_K * 8,
                                                  combine_payload_size_per_token=HIDDEN * 2)
    group = SimulatedGroup(EP)
    layers = _compat_layers(group, size, 3)  # one MoeAlltoAll per MoE layer, as SGLang builds them
    assert group.allocations == 1
    dispatchers = [[sglang.FlashinferStyleDispatcher(a, EP, HIDDEN, EXPERTS, invalid, zero_copy) for a in rank]
                   for rank in layers]
    native = Native()
    streams = [torch.cuda.Stream() for _ in range(EP)]
    _warm_up(streams, gen, weights)
    try:
        for step, counts in enumerate(STEPS):
            if checkpoint and step == 2:  # through any layer: they share the workspace; a fresh communicator after
                group.run(lambda r, comm: layers[r][1].checkpoint_prepare())
                group.run(lambda r, comm: layers[r][2].checkpoint_restore(comm.comm_backend()))
            runtime_max = max(counts)
            for layer in range(3):
                xs, ids, ws = _inputs(gen, counts, torch.int32)
                outs = on_streams(streams, lambda r: dispatchers[r][layer].dispatch(xs[r], ids[r], ws[r],
                                                                                    runtime_max))

                def experts(r):
                    d = outs[r]
                    first, end = ref.rank_expert_range(r, EXPERTS, EP)
                    partial = ex.expert_partials(d.hidden_states, d.topk_ids, d.topk_weights, weights, first, end)
                    if d.moe_output is not None:
                        d.moe_output.copy_(partial)  # the experts write straight into the workspace
                        return dispatchers[r][layer].combine(d.moe_output)
                    return dispatchers[r][layer].combine(partial.to(torch.bfloat16))

                got = on_streams(streams, experts)
                torch.cuda.synchronize()
                want, counts_native = native.step(streams, xs, ids, ws, runtime_max, weights)
                torch.cuda.synchronize()
                dense = ex.dense_moe(xs, weights, TOP_K, EP, routing=(ids, ws))
                for r in range(EP):
                    _check_padding(outs[r].topk_ids.view(EP, runtime_max, TOP_K), counts_native[r], invalid)
                    assert ref.bitwise_equal(got[r].cpu(), want[r].cpu()), f"rank {r} against the native API"
                    assert ref.bitwise_equal(got[r].cpu(), dense[r].cpu()), f"rank {r} against the dense layer"
                    fa.check_error(layers[r][layer].workspace, r)
    finally:
        native.close()
        group.run(lambda r, comm: [a.destroy() for a in layers[r]])


def test_vllm_prepare_finalize_sequence():
    gen = torch.Generator().manual_seed(torch.seed() % (1 << 31))
    weights = ex.MoEWeights.random(HIDDEN, INTER, EXPERTS, gen)
    # vLLM grows one size to the maximum over its layers (here a bf16 layer and an NVFP4 one with scales)
    sizes = [fi.moe_a2a_get_workspace_size_per_rank(EP, MAX_TOKENS, HIDDEN * 2 + TOP_K * 8, HIDDEN * 2),
             fi.moe_a2a_get_workspace_size_per_rank(EP, MAX_TOKENS, HIDDEN // 2 + HIDDEN // 16 + TOP_K * 8,
                                                    HIDDEN * 2)]
    group = SimulatedGroup(EP)
    (a2as,) = zip(*_compat_layers(group, max(sizes), 1))
    step = {"runtime_max": 0}
    pfs = [vllm.OneSidedPrepareAndFinalize(a, lambda: step["runtime_max"]) for a in a2as]
    assert all(pf.combine_takes_output for pf in pfs)
    native = Native()
    streams = [torch.cuda.Stream() for _ in range(EP)]
    _warm_up(streams, gen, weights)
    try:
        for counts in STEPS:
            step["runtime_max"] = max(counts)
            xs, ids, ws = _inputs(gen, counts, torch.int32)  # vLLM sized the workspace for int32 ids
            prepared = on_streams(streams, lambda r: pfs[r].prepare(xs[r], ws[r], ids[r], EXPERTS))
            outputs = [torch.full((n, HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda") for n in counts]

            def finalize(r):
                a1q, scale, meta, rids, rw = prepared[r]
                assert scale is None and meta is None and a1q.shape == (EP * max(counts), HIDDEN)
                first, end = ref.rank_expert_range(r, EXPERTS, EP)
                fused = ex.expert_partials(a1q, rids, rw, weights, first, end).to(torch.bfloat16)
                pfs[r].finalize(outputs[r], fused, ws[r], ids[r])

            on_streams(streams, finalize)
            torch.cuda.synchronize()
            want, counts_native = native.step(streams, xs, ids, ws, max(counts), weights)
            torch.cuda.synchronize()
            dense = ex.dense_moe(xs, weights, TOP_K, EP, routing=(ids, ws))
            for r in range(EP):
                _check_padding(prepared[r][3].view(EP, max(counts), TOP_K), counts_native[r], -1)
                assert ref.bitwise_equal(outputs[r].cpu(), want[r].cpu()), f"rank {r} against the native API"
                assert ref.bitwise_equal(outputs[r].cpu(), dense[r].cpu()), f"rank {r} against the dense layer"
    finally:
        native.close()
        group.run(lambda r, comm: a2as[r].destroy())


def test_checkpoint_restore_between_processes_on_one_gpu(tmp_path):
    spawn("checkpoint_gpu", 2, tmp_path, timeout_s=300)


def test_sixty_layers_hold_one_workspace_on_the_gpu():
    group = SimulatedGroup(EP)
    size = fi.moe_a2a_get_workspace_size_per_rank(EP, MAX_TOKENS, HIDDEN * 2 + TOP_K * 8, HIDDEN * 2)

    def native(r, comm):
        return fa.MoeAlltoAll(comm, max_num_tokens=MAX_TOKENS, top_k=TOP_K, num_experts=EXPERTS, hidden_size=HIDDEN)

    def allocated():
        gc.collect()  # tensors of earlier tests freed now, not while we measure
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    base = allocated()
    compat = _compat_layers(group, size, 1)
    natives = [[a] for a in group.run(native)]
    one_layer = allocated()
    assert one_layer - base >= group.live_bytes() > 0
    for r, more in enumerate(_compat_layers(group, size, 59)):
        compat[r] += more
    for _ in range(59):
        for r, a in enumerate(group.run(native)):
            natives[r].append(a)
    grown = allocated() - one_layer
    assert group.allocations == 2  # the compat namespace and the native default one
    assert grown < 1 << 20, grown  # 59 more layers per rank: their small recv_counts tensors, no workspace
    assert len({a.workspace.data_ptr() for rank in natives for a in rank}) == 1
    print(f"{EP} simulated ranks: 1 layer pair {(one_layer - base) / 2**20:.2f} MiB, 60 layer pairs "
          f"{(one_layer - base + grown) / 2**20:.2f} MiB of GPU memory")
    group.run(lambda r, comm: [a.destroy() for a in (*compat[r], *natives[r])])
    assert group.live_bytes() == 0
