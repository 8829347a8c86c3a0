"""An engine written for FlashInfer 0.7.4's ``flashinfer.moe_ep``, replayed over ``flashinfer_a2a.compat.moe_ep``,
one process per rank (``python -m tests.multigpu.moe_ep_engine [CHECK ...]`` under torchrun;
tests/multigpu/test_moe_ep_engine.py launches it with one GPU per rank and with two processes on one GPU).

``engine``, as such an engine runs its decode steps: every MoE layer is built first through ``create_communication``
(three bf16 layers of one layout, which share one workspace, and a layer that quantizes its activations to FP8 block
scales on the way and combines over the FP8 wire, which gets a workspace of its own; all with EPLB statistics and
rank masks enabled), warmed up eagerly, then one CUDA graph is captured per batch size (1, 8, 32) and the graphs are
replayed out of order, eager steps between them. Every layer gathers the EPLB statistics at every step (the engine
copies them out of the view inside the graph). Mid-run rank 1 is masked out: the other ranks pass the mask on an
eager step and replay their graphs, which follow the set in force, while rank 1 makes no call; then every rank takes
it back at one step and all replay again. ``flashinfer_072`` runs the 0.7.2 surface's EPLB statistics and masks
(``flashinfer_a2a.compat.flashinfer.MoeAlltoAll``) the same way, eagerly.

Every step has fresh random inputs and poisoned outputs, and every output element, received count and gathered
statistic is compared bit for bit with :mod:`flashinfer_a2a.reference` (every rank computes the whole group's
reference from the shared seed). The stand-in experts compute exactly (one rounding per multiplication), so the
GPU's rows equal the CPU reference's.
"""

from __future__ import annotations

import sys

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.compat import flashinfer as fi
from flashinfer_a2a.compat import moe_ep
from flashinfer_a2a.reference import quant

from .common import bootstrap, shared_seed

HIDDEN, TOP_K, EXPERTS_PER_RANK, MAX_TOKENS = 512, 4, 4, 32
BATCH_SIZES = (1, 8, 32)
LAYERS = ("bf16", "bf16", "bf16", "fp8")  # the target model's MoE layers, in order
MASKED = 1  # the rank masked out mid-run
BF16 = torch.bfloat16


def expert(rows: torch.Tensor, scales, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The stand-in expert stage on ``[ep, T, ...]`` received rows (bf16, or FP8 values with fp32 scales per 128):
    each row times its first weight and a factor from its first expert id, one rounding per product, so a GPU and
    the CPU reference agree bit for bit. Padding rows give garbage that no combine reads."""
    x = rows.float()
    if scales is not None:
        x = x * scales.repeat_interleave(quant.FP8_BLOCK, dim=-1)[..., :HIDDEN]
    factor = weights[..., :1].float() * (1 + ids[..., :1].remainder(4)).float()
    return (x * factor).to(BF16)


class Layer:
    """One MoE layer of the engine: dispatch with this step's EPLB statistics, experts into the combine buffer,
    combine; the gathered statistics and received counts copied into the engine's buffers."""

    def __init__(self, kind: str, index: int, bootstrap_config, num_experts: int):
        self.kind, self.index, self.num_experts = kind, index, num_experts
        fp8 = kind == "fp8"
        params = moe_ep.MoEEpCommParams(num_experts, TOP_K, MAX_TOKENS, HIDDEN,
                                        dispatch_format=moe_ep.QuantFormat.DeepSeekFp8 if fp8 else None)
        config = moe_ep.NVLinkOneSidedConfig(eplb_stats_num_experts=num_experts, enable_rank_mask=True,
                                             use_low_precision_combine=fp8, timeout_sec=60)
        self.comm = moe_ep.create_communication(bootstrap_config, params, config, quantize_dispatch=fp8)

    def __call__(self, h, inputs, mask=None, output=None, keep=None):
        ep, batch = self.comm.ep_size, inputs.batch
        res = self.comm.dispatch(h, inputs.ids, inputs.w, runtime_max_tokens_per_rank=batch,
                                 eplb_local_stats=inputs.stats[self.index], active_rank_mask=mask)
        inputs.gathered[self.index].copy_(res.eplb_gathered_stats)
        inputs.counts[self.index].copy_(self.comm.recv_counts)
        if keep is not None:  # copied now: after this rank's combine a peer's next dispatch may land in the view
            keep.append(res.topk_ids.clone())
        scales = None if res.hidden_states_scale is None else res.hidden_states_scale.view(ep, batch, -1)
        rows = expert(res.hidden_states.view(ep, batch, -1), scales, res.topk_ids.view(ep, batch, TOP_K),
                      res.topk_weights.view(ep, batch, TOP_K))
        buffer = self.comm.get_combine_input_buffer(BF16)
        buffer.view(ep, batch, HIDDEN).copy_(rows)
        return self.comm.combine(buffer, output=output, active_rank_mask=mask)


class Inputs:
    """Static input and output tensors of one batch size, refilled with fresh values before each step."""

    def __init__(self, batch: int, ep: int, num_experts: int):
        self.batch, self.ep, self.num_experts = batch, ep, num_experts
        self.x = torch.empty(batch, HIDDEN, dtype=BF16, device="cuda")
        self.ids = torch.empty(batch, TOP_K, dtype=torch.int64, device="cuda")
        self.w = torch.empty(batch, TOP_K, dtype=torch.float32, device="cuda")
        self.stats = torch.empty(len(LAYERS), num_experts, dtype=torch.int32, device="cuda")
        self.gathered = torch.empty(len(LAYERS), ep, num_experts, dtype=torch.int32, device="cuda")
        self.counts = torch.empty(len(LAYERS), ep, dtype=torch.int32, device="cuda")
        self.every_rank = None  # every rank's (x, ids, w, stats) of the step, on the CPU

    def refill(self, seed: int, rank: int, active: list[int]) -> None:
        """Every rank's inputs of the step ``seed`` (ranks outside ``active`` have none: they make no calls); this
        rank's copied into the static tensors, the outputs poisoned."""
        gen = torch.Generator().manual_seed(seed)
        self.every_rank = []
        for r in range(self.ep):
            n = self.batch if r in active else 0
            ids = ref.random_topk_ids(n, TOP_K, self.num_experts, generator=gen, dtype=torch.int64,
                                      minus_one_frac=0.1)
            x = torch.randn(n, HIDDEN, generator=gen).to(BF16)
            w = torch.rand(n, TOP_K, generator=gen)
            stats = torch.randint(-(1 << 30), 1 << 30, (len(LAYERS), self.num_experts), generator=gen,
                                  dtype=torch.int32)
            self.every_rank.append((x, ids, w, stats))
        x, ids, w, stats = self.every_rank[rank]
        self.x.copy_(x)
        self.ids.copy_(ids)
        self.w.copy_(w)
        self.stats.copy_(stats)
        self.gathered.fill_(-7)
        self.counts.fill_(-7)


def model_step(layers, inputs, mask=None, output=None, keep=None):
    """The target model's MoE layers back to back, each on the previous one's output."""
    h = inputs.x
    for i, layer in enumerate(layers):
        h = layer(h, inputs, mask, output if i == len(layers) - 1 else None, keep)
    return h


def reference_step(inputs: Inputs, active: list[int]):
    """Every rank's final output, and per layer its reference dispatch (received counts), from every rank's
    inputs, as the layers compute them (each layer on the previous one's output)."""
    ep, batch, experts = inputs.ep, inputs.batch, inputs.num_experts
    h = [x for x, _, _, _ in inputs.every_rank]
    ids = [i for _, i, _, _ in inputs.every_rank]
    w = [w for _, _, w, _ in inputs.every_rank]
    dispatched = []
    for kind in LAYERS:
        wire = []
        for r in range(ep):
            if kind == "fp8" and h[r].shape[0]:
                hidden = list(quant.quantize(h[r], "fp8_block"))
            elif kind == "fp8":
                hidden = [torch.empty(0, HIDDEN, dtype=torch.float8_e4m3fn),
                          torch.empty(0, -(-HIDDEN // quant.FP8_BLOCK), dtype=torch.float32)]
            else:
                hidden = [h[r]]
            wire.append([*hidden, ids[r].to(torch.int32), w[r]])
        want = ref.reference_dispatch(ids, wire, experts, batch, active_ranks=active)
        partials = []
        for d in range(ep):
            got = want.recv_payloads[d]
            scales = got[1] if kind == "fp8" else None
            partials.append(expert(got[0], scales, got[-2], got[-1]) if d in active
                            else torch.zeros(ep, batch, HIDDEN, dtype=BF16))
        h = (quant.reference_combine_fp8 if kind == "fp8" else ref.reference_combine)(partials, want)
        dispatched.append(want)
    return h, dispatched


def check(what: str, rank: int, inputs: Inputs, got: torch.Tensor, active: list[int], kept=()) -> None:
    torch.cuda.synchronize()
    outs, dispatched = reference_step(inputs, active)
    assert ref.bitwise_equal(got.cpu(), outs[rank]), f"{what}: output differs from the reference"
    for i, want in enumerate(dispatched):
        assert torch.equal(inputs.counts[i].cpu(), want.recv_counts[rank]), f"{what}: layer {i} counts"
        expected = torch.stack([inputs.every_rank[s][3][i] if s in active else
                                torch.zeros(inputs.num_experts, dtype=torch.int32) for s in range(inputs.ep)])
        assert torch.equal(inputs.gathered[i].cpu(), expected), f"{what}: layer {i} EPLB statistics"
    for i, ids in enumerate(kept):  # eager steps: the received ids, padding rows invalid
        got_ids = ids.view(inputs.ep, inputs.batch, TOP_K).cpu()
        valid = ref.valid_row_mask(dispatched[i].recv_counts[rank], inputs.batch)
        assert torch.equal(got_ids[valid], dispatched[i].recv_payloads[rank][-2][valid]), f"{what}: layer {i} ids"
        assert bool((got_ids[~valid] == -1).all()), f"{what}: layer {i} padding ids"


def engine(comm) -> None:
    ep, rank = comm.size, comm.rank
    seed = shared_seed(comm)
    experts = EXPERTS_PER_RANK * ep
    boot = moe_ep.BootstrapConfig(ep, rank, device=torch.cuda.current_device())
    layers = [Layer(kind, i, boot, experts) for i, kind in enumerate(LAYERS)]
    workspaces = {layer.comm.workspace.data_ptr() for layer in layers}
    assert len(workspaces) == 2, "the bf16 layers share one workspace, the FP8 layer has its own"
    everyone = list(range(ep))
    inputs = {b: Inputs(b, ep, experts) for b in BATCH_SIZES}
    step = 0

    def eager(b, active, mask=None):
        nonlocal step
        step += 1
        inputs[b].refill(seed * 1000 + step, rank, active)
        out = torch.full((b, HIDDEN), float("nan"), dtype=BF16, device="cuda")
        kept = []
        got = model_step(layers, inputs[b], mask, out, kept)
        assert got is out
        check(f"eager step {step} (batch {b})", rank, inputs[b], got, active, kept)

    def replay(b, active):
        nonlocal step
        step += 1
        inputs[b].refill(seed * 1000 + step, rank, active)
        outs[b].fill_(float("nan"))
        graphs[b].replay()
        check(f"replay {step} of graph {b}", rank, inputs[b], outs[b], active)

    for b in BATCH_SIZES:  # eager warm-up of every layer and size
        eager(b, everyone)
    graphs, outs = {}, {}
    side = torch.cuda.Stream()
    for b in BATCH_SIZES:
        graphs[b] = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            model_step(layers, inputs[b])  # the engines' warm-up on the capture stream
            with torch.cuda.graph(graphs[b], stream=side):
                outs[b] = model_step(layers, inputs[b])
    for b in (32, 1, 8, 8, 32, 1):
        replay(b, everyone)
    eager(8, everyone)

    masked = [r for r in everyone if r != MASKED]
    if rank != MASKED:  # rank MASKED makes no call while it is out
        mask = layers[0].comm.active_rank_mask(masked)
        eager(8, masked, mask)  # the mask is in force for both workspaces from here on
        for b in (32, 1):
            replay(b, masked)
        eager(32, masked, mask)
        for b in (8, 1, 32):
            replay(b, masked)
    else:
        step += 7
    comm.barrier()
    for layer in (layers[0], layers[-1]):  # taking a rank back: every rank at one step, per workspace
        layer.comm.native.set_active_ranks(None)
    eager(1, everyone)
    for b in (8, 32, 1, 8):
        replay(b, everyone)
    for layer in layers:
        fa.check_error(layer.comm.workspace, rank)
    comm.barrier()
    for layer in layers:
        layer.comm.destroy()
    print(f"CHECK moe_ep engine rank {rank} ok ({step} steps)", flush=True)


def flashinfer_072(comm) -> None:
    """The 0.7.2 surface's EPLB statistics and masks: eager steps with every rank, with rank 1 masked out (it makes
    no call), and with it taken back; received rows, statistics and outputs bitwise against the reference."""
    ep, rank = comm.size, comm.rank
    seed = shared_seed(comm)
    experts = EXPERTS_PER_RANK * ep
    mapping = fi.Mapping(ep, rank, 8, tp_size=ep, moe_ep_size=ep)
    moe = fi.MoeAlltoAll(mapping, MAX_TOKENS, TOP_K, experts, hidden_size=HIDDEN, eplb_stats_num_experts=experts,
                         enable_rank_mask=True)
    everyone, masked = list(range(ep)), [r for r in range(ep) if r != MASKED]
    for step, active in enumerate([everyone, everyone, masked, masked, everyone, everyone]):
        if step == 4:
            comm.barrier()
            moe.native.set_active_ranks(None)  # taking rank MASKED back: every rank at one step
        if rank not in active:
            continue
        inputs = Inputs(8, ep, experts)
        inputs.refill(seed * 1000 + step, rank, active)
        mask = fi.moe_a2a_active_rank_mask(active, ep) if step % 2 else None
        if mask is None and active != everyone:
            mask = fi.moe_a2a_active_rank_mask(active, ep)
        ids32 = inputs.ids.to(torch.int32)
        recv = moe.dispatch(ids32, [inputs.x, ids32, inputs.w], 8, invalid_token_expert_id=-1,
                            expert_id_payload_index=1, eplb_local_stats=inputs.stats[0], active_rank_mask=mask)
        recv = [view.clone() for view in recv]  # after this rank's combine a peer's next dispatch may land there
        gathered = moe.eplb_gathered_stats.cpu()
        payload = moe.get_combine_payload_tensor_in_workspace(8, HIDDEN, BF16)
        payload.copy_(expert(recv[0], None, recv[1], recv[2]))
        out = torch.full((8, HIDDEN), float("nan"), dtype=BF16, device="cuda")
        moe.combine(payload, 8, payload_in_workspace=True, output=out, active_rank_mask=mask)
        assert moe.eplb_gathered_stats is None  # FlashInfer 0.7.2: valid until the combine
        torch.cuda.synchronize()
        wire = [[x, i.to(torch.int32), w] for x, i, w, _ in inputs.every_rank]
        want = ref.reference_dispatch([i for _, i, _, _ in inputs.every_rank], wire, experts, 8, active_ranks=active)
        valid = ref.valid_row_mask(want.recv_counts[rank], 8)
        for got, expected in zip(recv, want.recv_payloads[rank]):
            assert ref.bitwise_equal(got.cpu()[valid], expected[valid]), f"0.7.2 step {step}: received rows"
        assert bool((recv[1].cpu()[~valid] == -1).all()), f"0.7.2 step {step}: padding ids"
        expected = torch.stack([inputs.every_rank[s][3][0] if s in active else torch.zeros(experts, dtype=torch.int32)
                                for s in range(ep)])
        assert torch.equal(gathered, expected), f"0.7.2 step {step}: EPLB statistics"
        partials = [expert(p[0], None, p[1], p[2]) if d in active else torch.zeros(ep, 8, HIDDEN, dtype=BF16)
                    for d, p in enumerate(want.recv_payloads)]
        assert ref.bitwise_equal(out.cpu(), ref.reference_combine(partials, want)[rank]), f"0.7.2 step {step}"
    fa.check_error(moe.workspace, rank)
    comm.barrier()
    moe.destroy()
    print(f"CHECK moe_ep flashinfer_072 rank {rank} ok", flush=True)


CHECKS = {"engine": engine, "flashinfer_072": flashinfer_072}


def main(argv: list[str]) -> None:
    _, comm, _ = bootstrap()
    assert comm.size >= 2, "rank masks need two ranks or more"
    for name in argv or list(CHECKS):
        CHECKS[name](comm)
    comm.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
