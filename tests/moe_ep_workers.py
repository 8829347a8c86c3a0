"""Rank bodies for tests/test_compat_moe_ep.py: flashinfer_a2a.compat.moe_ep end to end on spawned gloo ranks (CPU),
over the native nccl transport, bitwise against flashinfer_a2a.reference.

Every rank draws every rank's inputs from one seed, so each computes the reference of the whole group and checks its
own share: every valid received row byte for byte, every padding row's ids equal to ``invalid_expert_id``, every
output element bit for bit (outputs and received rows are poisoned before each step).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashinfer_a2a import reference as ref
from flashinfer_a2a.compat import moe_ep
from flashinfer_a2a.reference import quant

from .comm_workers import expect_raises

HIDDEN, NUM_EXPERTS, TOP_K, MAX_TOKENS = 256, 8, 4, 24
INVALID = NUM_EXPERTS + 3  # any id outside [0, num_experts) marks padding rows; not -1, which the inputs use


def params(**kwargs) -> moe_ep.MoEEpCommParams:
    return moe_ep.MoEEpCommParams(NUM_EXPERTS, TOP_K, MAX_TOKENS, HIDDEN, invalid_expert_id=INVALID, **kwargs)


def build(rank: int, world_size: int, layer_params: moe_ep.MoEEpCommParams, config=None, **options):
    """A layer as an engine builds it, on the nccl transport over the default (gloo) group."""
    bootstrap = moe_ep.BootstrapConfig(world_size, rank)
    return moe_ep.create_communication(bootstrap, layer_params, config or moe_ep.NVLinkOneSidedConfig(),
                                       transport="nccl", device="cpu", **options)


class Step:
    """One step's inputs on every rank (rank 1 idle), from ``seed``: bf16 hidden states, int64 or int32 ids with
    some -1, fp32 weights."""

    def __init__(self, world_size: int, seed: int, runtime_max: int, id_dtype=torch.int64):
        gen = torch.Generator().manual_seed(seed)
        self.runtime_max = runtime_max
        self.tokens = [0 if r == 1 else runtime_max - (r % 3) for r in range(world_size)]
        self.ids = [ref.random_topk_ids(n, TOP_K, NUM_EXPERTS, dtype=id_dtype, generator=gen, minus_one_frac=0.15)
                    for n in self.tokens]
        self.x = [torch.randn(n, HIDDEN, generator=gen).to(torch.bfloat16) for n in self.tokens]
        self.w = [torch.rand(n, TOP_K, generator=gen) for n in self.tokens]
        self.partials = [torch.randn(world_size, runtime_max, HIDDEN, generator=gen).to(torch.bfloat16)
                         for _ in range(world_size)]


def poison(*tensors: torch.Tensor) -> None:
    for t in tensors:
        t.view(torch.uint8).fill_(0xFF)


def check_received(rank: int, rows: list[torch.Tensor], want: ref.DispatchResult, runtime_max: int) -> None:
    """Our ``[ep * T, ...]`` rows against the reference's ``[ep, T, ...]`` receive buffers of ``rank``: every valid
    row byte for byte; the ids' padding rows (payload index 1 of ``rows`` after the hidden rows) all invalid."""
    counts = want.recv_counts[rank]
    ep_size = len(counts)
    for p, (got, expected) in enumerate(zip(rows, want.recv_payloads[rank])):
        assert got.shape[0] == ep_size * runtime_max, (p, got.shape)
        got = got.view(ep_size, runtime_max, *got.shape[1:])
        assert got.dtype == expected.dtype and got.shape == expected.shape, (p, got.dtype, got.shape)
        valid = ref.valid_row_mask(counts, runtime_max)
        assert ref.bitwise_equal(got[valid], expected[valid]), f"payload {p}: valid rows differ"


def check_padding_ids(rank: int, ids: torch.Tensor, want: ref.DispatchResult, runtime_max: int) -> None:
    ep_size = len(want.recv_counts[rank])
    padding = ~ref.valid_row_mask(want.recv_counts[rank], runtime_max)
    assert bool((ids.view(ep_size, runtime_max, TOP_K)[padding] == INVALID).all()), "padding rows keep stale ids"


def run_step(layer, rank: int, step: Step, *, quantized: str | None = None, prequantized: str | None = None,
             weights=True, zero_copy=False, three_d=False, give_output=False, fp8_combine=False, **calls):
    """One dispatch + combine of ``layer`` on ``step``, checked against the reference."""
    runtime_max = step.runtime_max
    wire, scale = [], None
    for r in range(len(step.tokens)):  # what travels: the hidden states as the format has them, ids, weights
        if quantized is not None:
            values_scales = list(quant.quantize(step.x[r], quantized))
        elif prequantized is not None:
            values_scales = list(quant.quantize(step.x[r], prequantized))
        else:
            values_scales = [step.x[r]]
        wire.append([*values_scales, step.ids[r].to(torch.int32), *([step.w[r]] if weights else [])])
    if prequantized is not None:
        hidden, scale = wire[rank][0], wire[rank][1]
    else:
        hidden = step.x[rank]
    want = ref.reference_dispatch(step.ids, wire, NUM_EXPERTS, runtime_max)
    result = layer.dispatch(hidden, step.ids[rank], step.w[rank] if weights else None, hidden_states_scale=scale,
                            runtime_max_tokens_per_rank=runtime_max, **calls)
    assert result.tokens_per_rank == runtime_max and result.eplb_gathered_stats is None
    scaled = quantized is not None or prequantized is not None
    rows = [result.hidden_states, *([result.hidden_states_scale] if scaled else []), result.topk_ids,
            *([result.topk_weights] if weights else [])]
    assert (result.hidden_states_scale is None) != scaled and (result.topk_weights is None) != weights
    check_received(rank, rows, want, runtime_max)
    check_padding_ids(rank, result.topk_ids, want, runtime_max)
    assert torch.equal(layer.recv_counts, want.recv_counts[rank])
    poison(*rows)  # the next step must write every row again

    mine = step.partials[rank]
    if zero_copy:
        buffer = layer.get_combine_input_buffer(torch.bfloat16)
        assert buffer.shape == (len(step.tokens) * runtime_max, HIDDEN)
        buffer.copy_(mine.view(-1, HIDDEN))
        expert_output = buffer.view(len(step.tokens), runtime_max, HIDDEN) if three_d else buffer
    else:
        expert_output = mine.clone() if three_d else mine.clone().view(-1, HIDDEN)
    output = None
    if give_output:
        output = torch.empty(step.tokens[rank], HIDDEN, dtype=torch.bfloat16)
        poison(output)
    got = layer.combine(expert_output, output=output, **calls)
    assert output is None or got is output
    combined = (quant.reference_combine_fp8 if fp8_combine else ref.reference_combine)(step.partials, want)[rank]
    assert ref.bitwise_equal(got, combined), "combine differs from the reference"


def check_flows(rank: int, world_size: int, tmp: Path) -> None:
    """Several layers built by create_communication, every dispatch format the payloads can take, the quantizing
    dispatch, the FP8 combine, zero-copy and staged combine inputs of both shapes, given outputs, an idle rank, a
    smaller runtime_max, int32 and int64 ids, no weights, and enable_rank_mask with every rank active."""
    plain = [build(rank, world_size, params(), moe_ep.NVLinkOneSidedConfig(enable_rank_mask=True)) for _ in range(2)]
    assert plain[0].native.transport == "nccl" and not plain[0].lamport_enabled and plain[0].lamport_max_tokens == 0
    assert (plain[0].ep_rank, plain[0].ep_size, plain[0].num_local_experts) == (rank, world_size,
                                                                                 NUM_EXPERTS // world_size)
    fp8 = build(rank, world_size, params(dispatch_format=moe_ep.QuantFormat.DeepSeekFp8))
    mxfp8 = build(rank, world_size, params(dispatch_format=moe_ep.QuantFormat.MXFP8), quantize_dispatch=True)
    low = build(rank, world_size, params(), moe_ep.NVLinkOneSidedConfig(use_low_precision_combine=True))
    everyone = plain[0].active_rank_mask(range(world_size))

    run_step(plain[0], rank, Step(world_size, 1, MAX_TOKENS), zero_copy=True)
    run_step(plain[1], rank, Step(world_size, 2, 16, torch.int32), zero_copy=True, three_d=True, give_output=True)
    run_step(plain[0], rank, Step(world_size, 3, MAX_TOKENS), three_d=True, active_rank_mask=everyone)
    run_step(plain[1], rank, Step(world_size, 4, 9), weights=False, give_output=True)
    run_step(fp8, rank, Step(world_size, 5, MAX_TOKENS), prequantized="fp8_block", zero_copy=True)
    run_step(mxfp8, rank, Step(world_size, 6, 12), quantized="mxfp8", give_output=True)
    run_step(low, rank, Step(world_size, 7, MAX_TOKENS), fp8_combine=True, zero_copy=True)
    run_step(low, rank, Step(world_size, 8, 5, torch.int32), fp8_combine=True)
    for layer in (*plain, fp8, mxfp8, low):
        layer.checkpoint_prepare()  # no workspace on the nccl transport: nothing to release
        layer.checkpoint_restore(None)
        layer.destroy()
        layer.destroy()
    expect_raises(RuntimeError, "has been destroyed", plain[0].dispatch, torch.zeros(0, HIDDEN, dtype=torch.bfloat16),
                  torch.zeros(0, TOP_K, dtype=torch.int32))


def check_errors(rank: int, world_size: int, tmp: Path) -> None:
    """Every refused call raises on the host before anything is launched, on every rank alike, and leaves the
    layer usable: a step after them is still bitwise right, and no rank hangs."""
    layer = build(rank, world_size, params(), moe_ep.NVLinkOneSidedConfig(enable_rank_mask=True))
    unmasked = build(rank, world_size, params())
    step = Step(world_size, 11, MAX_TOKENS)
    x, ids, w = step.x[rank], step.ids[rank], step.w[rank]
    full = layer.active_rank_mask(range(world_size))
    others = [r for r in range(world_size) if r != rank]

    dispatch = layer.dispatch
    expect_raises(TypeError, "active_rank_mask must be uint64", dispatch, x, ids, w, active_rank_mask=full.long())
    expect_raises(ValueError, "active_rank_mask must have shape [4]", dispatch, x, ids, w,
                  active_rank_mask=full[:1])
    expect_raises(ValueError, "must be a CPU tensor", dispatch, x, ids, w, active_rank_mask=full.to("meta"))
    expect_raises(ValueError, f"leaves out the calling rank {rank}", dispatch, x, ids, w,
                  active_rank_mask=layer.active_rank_mask(others))
    past = full.clone()
    past[0] = (1 << world_size) | int(full[0])  # a rank the group does not have
    expect_raises(ValueError, f"sets ranks [{world_size}]", dispatch, x, ids, w, active_rank_mask=past)
    expect_raises(ValueError, "requires enable_rank_mask=True", unmasked.dispatch, x, ids, w, active_rank_mask=full)
    expect_raises(ValueError, "active_ranks: rank", layer.active_rank_mask, [world_size])
    if world_size > 1:  # a set that drops a rank needs the nvlink transport
        expect_raises(ValueError, "nvlink", dispatch, x, ids, w, active_rank_mask=layer.active_rank_mask([rank]))
    expect_raises(ValueError, f"runtime_max_tokens_per_rank={MAX_TOKENS + 1}", dispatch, x, ids, w,
                  runtime_max_tokens_per_rank=MAX_TOKENS + 1)
    expect_raises(ValueError, "runtime_max_tokens_per_rank=0", dispatch, x, ids, w, runtime_max_tokens_per_rank=0)
    expect_raises(ValueError, "hidden_states: dispatch_format=None carries torch.bfloat16", dispatch, x.half(), ids, w)
    expect_raises(ValueError, "hidden_states_scale: dispatch_format=None carries no per-token scales", dispatch, x,
                  ids, w, hidden_states_scale=torch.ones(x.shape[0], 2))
    expect_raises(ValueError, f"topk_ids must be [num_tokens, top_k={TOP_K}]", dispatch, x, ids[:, :2], w)
    expect_raises(ValueError, "topk_weights must be", dispatch, x, ids, w.double())
    expect_raises(ValueError, "eplb_stats_num_experts=0", dispatch, x, ids, w,
                  eplb_local_stats=torch.zeros(NUM_EXPERTS, dtype=torch.int32))
    expect_raises(RuntimeError, "combine called before dispatch", layer.combine, step.partials[rank])
    expect_raises(RuntimeError, "get_combine_input_buffer called before dispatch", layer.get_combine_input_buffer,
                  torch.bfloat16)
    expect_raises(ValueError, "nvlink", build, rank, world_size, params(),
                  moe_ep.NVLinkOneSidedConfig(eplb_stats_num_experts=4))  # EPLB statistics ride the nvlink transport

    result = dispatch(x, ids, w)  # after every refusal: a whole step, bitwise
    expect_raises(RuntimeError, "dispatch called twice", dispatch, x, ids, w)
    expect_raises(ValueError, "expert_output must be", layer.combine, step.partials[rank][:, :3])
    expect_raises(TypeError, "active_rank_mask must be uint64", layer.combine, step.partials[rank],
                  active_rank_mask=full.int())
    if world_size > 1:
        expect_raises(ValueError, "active_rank_mask of combine selects ranks", layer.combine, step.partials[rank],
                      active_rank_mask=layer.active_rank_mask([rank]))
    want = ref.reference_dispatch(step.ids, [[step.x[r], step.ids[r].to(torch.int32), step.w[r]]
                                             for r in range(world_size)], NUM_EXPERTS, MAX_TOKENS)
    check_received(rank, [result.hidden_states, result.topk_ids, result.topk_weights], want, MAX_TOKENS)
    got = layer.combine(step.partials[rank], active_rank_mask=full)
    assert ref.bitwise_equal(got, ref.reference_combine(step.partials, want)[rank])
    run_step(unmasked, rank, Step(world_size, 12, 7), zero_copy=True)
    layer.destroy()
    unmasked.destroy()


CHECKS = {"flows": check_flows, "errors": check_errors}
