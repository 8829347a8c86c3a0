"""Randomized dispatch -> combine rounds on real ranks, every element checked against flashinfer_a2a.reference.

Each case draws a layer (experts, top-k, hidden size, payloads, combine dtype and wire, a workspace sized for the
pulled or the pushed combine) and rounds of calls on it: routing uniform or skewed (Zipf, or every token to the
same experts), ids int32 or int64 with -1 entries, repeated experts, 0 to ``runtime_max`` tokens per rank, the hidden
states as raw bf16/fp16/fp32 rows, pre-quantized (values and scales as two payloads) or quantized by the dispatch
(fp8_block, mxfp8, nvfp4, scales row-major or swizzled), eager (whole or split calls) or replayed from a CUDA graph.
Before each round every rank poisons what the round writes: its workspace past the metadata, the counts, the
output. Received rows are compared byte for byte, quantized ones with the reference quantizers, sanitized ids and
the combine output bit for bit (the FP8 wire against its reference).

Every rank draws every rank's inputs from one seed, so each checks its own share against the whole group's
reference. Run by worker.py (check ``randomized``; tests/multigpu/test_randomized.py launches it):

    torchrun --nproc-per-node 4 -m tests.multigpu.worker randomized

The time budget starts once the first case (every rank idle, then one token) has run: it loads the library on every
rank, and builds it where no build is cached, which must not eat the budget. At least :data:`MIN_CASES` random
cases (all of them, when fewer are asked for) must run within it, or the suite fails: a slow machine cannot pass
having checked nothing.

Environment (read by this test only):
    FLASHINFER_A2A_TEST_RANDOM_CASES    cases to draw (default 24)
    FLASHINFER_A2A_TEST_RANDOM_SECONDS  no case starts after this long (default 120)
    FLASHINFER_A2A_TEST_SEED            seed of the run, to replay one (default: drawn, and printed)
    FLASHINFER_A2A_TEST_RANDOM_REPORT   a file rank 0 appends "<layout>: <cases run>" to (tests/multigpu/
                                        test_randomized.py reads it)
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from typing import Optional

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.moe_alltoall import MoeAlltoAll
from flashinfer_a2a.reference import quant as q
from flashinfer_a2a.library.wire_formats import WIRE_FORMATS, push_combine_bytes_per_token

from .common import SHARED_GPU, shared_seed

CASES, SECONDS = 24, 120.0
MIN_CASES = 8  # random cases every run must reach (after the idle one), fewer only when fewer are asked for
REPORT_ENV = "FLASHINFER_A2A_TEST_RANDOM_REPORT"
GLOO_CASES = 6  # the CPU harness's cases (small shapes), every one of which must run
REPLAYS = 3  # graph replays per graph case, each with fresh inputs
HIDDENS = (1, 7, 64, 100, 515, 1026, 2048, 2880, 4096, 7168)
TOP_KS = (1, 2, 4, 6, 8, 9, 22)
FUSED = (("fp8_block", False), ("mxfp8", False), ("mxfp8", True), ("nvfp4", False), ("nvfp4", True))
EXTRAS = ("ids", "weights", "extra_ids", "odd_bytes", "fp16_rows")  # payloads after the hidden states
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclasses.dataclass(frozen=True)
class Case:
    ep_size: int
    num_experts: int
    top_k: int
    distinct: bool  # a token's experts differ (else one may repeat)
    id_dtype: torch.dtype
    minus_one_frac: float
    skew: Optional[float]  # None uniform, s Zipf, inf every token to experts 0..top_k-1
    hidden: int
    hidden_kind: str  # "raw" rows of hidden_dtype, "fused" (the dispatch quantizes) or "prequantized"
    hidden_dtype: torch.dtype
    fmt: Optional[str]  # the wire format of "fused" and "prequantized"
    swizzled: bool
    extras: tuple[str, ...]
    combine_dtype: torch.dtype
    combine_wire: Optional[str]
    push: bool  # sized for the pushed combine: pushed where every rank has a GPU of its own
    partials: str  # "zero_copy", "tensor" or "misaligned" (a tensor one element off a 16-byte boundary)
    caller_out: bool
    graph: bool
    split: bool  # dispatch_send/recv and combine_send/recv
    max_tokens: int
    rounds: tuple[tuple[tuple[int, ...], int], ...]  # (tokens of each rank, runtime_max)

    def __str__(self) -> str:
        fields = (f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return ", ".join(fields).replace("torch.", "")


def draw_case(rng: random.Random, ep_size: int, *, cuda: bool, nccl: bool = False, max_hidden: int = 7168,
              max_tokens: int = 256) -> Case:
    """A case for ``ep_size`` ranks; without ``cuda`` (the nccl transport on CPU) no graph, split call or pushed
    combine; with ``nccl`` (the nccl transport on GPUs) graphs but no split call or pushed combine."""
    num_experts = rng.choice([ep_size, 8 * ep_size + 1, 32 * ep_size, 256, max(1, 3 * ep_size - 1)])
    distinct = rng.random() < 0.8
    top_k = rng.choice([k for k in TOP_KS if k <= num_experts or not distinct])
    hidden = rng.choice([h for h in HIDDENS if h <= max_hidden])
    kind = rng.choices(("raw", "fused", "prequantized"), (5, 3, 2))[0]
    fmt, swizzled, hidden_dtype = None, False, rng.choice((BF16, FP16, FP32))
    if kind == "fused":
        (fmt, swizzled), hidden_dtype = rng.choice(FUSED), rng.choice((BF16, FP16))
    elif kind == "prequantized":
        fmt = rng.choice(list(WIRE_FORMATS))
        hidden_dtype = WIRE_FORMATS[fmt].value_dtype
    room = fa.MAX_PAYLOADS - {"raw": 1, "fused": 2, "prequantized": 2}[kind]
    extras = tuple(rng.sample(EXTRAS, rng.randint(0, min(room, len(EXTRAS)))))
    combine_dtype = rng.choice((BF16, FP16, FP32))
    wire = "fp8_block" if combine_dtype != FP32 and hidden % 8 == 0 and rng.random() < 0.35 else None
    graph = cuda and rng.random() < 0.3
    tokens_cap = min(max_tokens, 128 if hidden > 2048 else max_tokens)
    most = rng.choice([m for m in (1, 16, 64, 128, 256) if m <= tokens_cap] or [tokens_cap])
    rounds = []
    for _ in range(1 if graph else rng.randint(1, 3)):
        draw = rng.random()
        runtime_max = most if draw < 0.5 else 0 if draw < 0.55 else rng.randint(1, most)
        rounds.append((tuple(rng.choice((0, runtime_max, rng.randint(0, runtime_max))) for _ in range(ep_size)),
                       runtime_max))
    return Case(ep_size=ep_size, num_experts=num_experts, top_k=top_k, distinct=distinct,
                id_dtype=rng.choice((torch.int32, torch.int64)), minus_one_frac=rng.choice((0.0, 0.0, 0.1, 0.5, 1.0)),
                skew=rng.choice((None, None, 0.5, 1.5, math.inf)), hidden=hidden, hidden_kind=kind,
                hidden_dtype=hidden_dtype, fmt=fmt, swizzled=swizzled, extras=extras, combine_dtype=combine_dtype,
                combine_wire=wire, push=cuda and not nccl and rng.random() < 0.4,
                partials=rng.choice(("zero_copy", "tensor") if wire else ("zero_copy", "tensor", "misaligned")),
                caller_out=rng.random() < 0.5, graph=graph,
                split=cuda and not nccl and not graph and rng.random() < 0.3,
                max_tokens=most, rounds=tuple(rounds))


# ------------------------------------------------------------------------------------------------ inputs


def _extra_row(case: Case, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """(trailing shape, dtype) of the payload called ``name``: the top-k ids themselves, fp32 weights, more int32
    ids, rows of 3 bytes, rows of 5 fp16."""
    return {"ids": ((case.top_k,), case.id_dtype), "weights": ((case.top_k,), FP32),
            "extra_ids": ((case.top_k,), torch.int32), "odd_bytes": ((3,), torch.uint8),
            "fp16_rows": ((5,), FP16)}[name]


def _extra(case: Case, name: str, ids: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if name == "ids":
        return ids.clone()
    shape, dtype = _extra_row(case, name)
    return ref.random_payload(ids.shape[0], shape, dtype, generator=gen)


def _hidden_states(case: Case, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if case.hidden_kind == "raw":
        return [ref.random_payload(n, (case.hidden,), case.hidden_dtype, generator=gen)]
    if case.hidden_kind == "prequantized":
        wire = WIRE_FORMATS[case.fmt]
        return [ref.random_payload(n, (wire.value_bytes(case.hidden),), wire.value_dtype, generator=gen),
                ref.random_payload(n, (wire.scale_cols(case.hidden),), wire.scale_dtype, generator=gen)]
    # Finite rows of very different magnitudes: every scale path of the quantizers.
    magnitude = torch.pow(10.0, torch.empty(n, 1).uniform_(-3, 3, generator=gen))
    return [(torch.randn(n, case.hidden, generator=gen) * magnitude).to(case.hidden_dtype)]


def draw_inputs(case: Case, tokens: tuple[int, ...], gen: torch.Generator):
    """Every rank's (topk_ids, payloads) on the CPU, and the NVFP4 global scale (None for other formats)."""
    ids, payloads = [], []
    for n in tokens:
        t = ref.random_topk_ids(n, case.top_k, case.num_experts, dtype=case.id_dtype, generator=gen,
                                distinct=case.distinct, minus_one_frac=case.minus_one_frac, skew=case.skew)
        ids.append(t)
        payloads.append(_hidden_states(case, n, gen) + [_extra(case, name, t, gen) for name in case.extras])
    global_scale = None
    if case.hidden_kind == "fused" and case.fmt == "nvfp4":
        amax = max((float(p[0].float().abs().max()) for p in payloads if p[0].numel()), default=0.0)
        global_scale = 448.0 * 6.0 / amax if amax > 0 else 1.0
    return ids, payloads, global_scale


def draw_partials(case: Case, runtime_max: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Every rank's expert outputs ``[ep_size, runtime_max, hidden]``."""
    return [(torch.randn(case.ep_size, runtime_max, case.hidden, generator=gen) * 2).to(case.combine_dtype)
            for _ in range(case.ep_size)]


def _poison(t: torch.Tensor) -> None:
    t.view(torch.uint8).fill_(ref.POISON_BYTE)


def _misaligned_like(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``t``'s shape starting one element past an aligned address."""
    return torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)


# ------------------------------------------------------------------------------------------------ checks


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and torch.equal(got.contiguous().view(torch.uint8),
                                                   want.contiguous().view(torch.uint8))


def check_dispatch(case: Case, rank: int, recv, counts, want, runtime_max: int, global_scale) -> None:
    assert torch.equal(counts.cpu(), want.recv_counts[rank]), f"recv_counts {counts.cpu()} != {want.recv_counts[rank]}"
    expected, got = list(want.recv_payloads[rank]), [r.cpu() for r in recv]
    if case.hidden_kind == "fused":
        _check_quantized(case, rank, got[0], got[1], expected[0], want, runtime_max, global_scale)
        got, expected = got[2:], expected[1:]
    assert len(got) == len(expected), (len(got), len(expected))
    valid = ref.valid_row_mask(want.recv_counts[rank], runtime_max)
    for p, (g, w) in enumerate(zip(got, expected)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"payload {p}: {g.dtype} {g.shape} != {w.dtype} {w.shape}"
        assert ref.bitwise_equal(g[valid], w[valid]), f"payload {p}: received rows differ"


def _check_quantized(case, rank, values, scales, hidden_rows, want, runtime_max, global_scale) -> None:
    wire = WIRE_FORMATS[case.fmt]
    cols = wire.scale_cols(case.hidden)
    for src in range(case.ep_size):
        m = int(want.recv_counts[rank][src])
        if m == 0:
            continue
        want_values, want_scales = q.quantize(hidden_rows[src, :m], case.fmt, global_scale)
        assert _same_bits(values[src, :m], want_values), f"quantized values from rank {src}"
        if not case.swizzled:
            assert _same_bits(scales[src, :m], want_scales), f"scales from rank {src}"
            continue
        grid = q.unswizzle_scales_128x4(scales[src], -(-runtime_max // 128) * 128, -(-cols // 4) * 4)
        assert _same_bits(grid[:m, :cols], want_scales), f"swizzled scales from rank {src}"
        assert torch.all(grid[:m, cols:].view(torch.uint8) == 0), f"scale padding from rank {src}"


def expected_out(case: Case, partials, want, rank: int) -> torch.Tensor:
    if case.combine_wire is None:
        return ref.reference_combine(partials, want)[rank]
    return q.reference_combine_fp8(partials, want)[rank]


# ------------------------------------------------------------------------------------------------ running


class Runner:
    """One case on this rank: its MoeAlltoAll, the rounds, the checks."""

    def __init__(self, group, comm, case: Case, seed: int, transport: str, device: str) -> None:
        self.comm, self.case, self.device, self.rank = comm, case, device, comm.rank
        self.gen = torch.Generator().manual_seed(seed)
        c = case
        hidden_row = (c.hidden * c.hidden_dtype.itemsize if c.hidden_kind == "raw"
                      else WIRE_FORMATS[c.fmt].row_bytes(c.hidden) if c.hidden_kind == "prequantized"
                      else WIRE_FORMATS[c.fmt].dispatch_bytes_per_token(c.hidden, c.max_tokens, c.swizzled))
        extra_rows = sum(math.prod(shape) * dtype.itemsize for shape, dtype in (_extra_row(c, e) for e in c.extras))
        combine_bytes = (push_combine_bytes_per_token(c.hidden, c.combine_dtype) if c.push  # fits the FP8 row too
                         else c.hidden * c.combine_dtype.itemsize)
        self.a2a = MoeAlltoAll(group, max_num_tokens=c.max_tokens, top_k=c.top_k, num_experts=c.num_experts,
                               hidden_size=c.hidden, dtype=c.combine_dtype, push_combine=c.push,
                               dispatch_bytes_per_token=hidden_row + extra_rows, combine_bytes_per_token=combine_bytes,
                               transport=transport, device="cpu" if device == "cpu" else None)
        self.nvlink = self.a2a.transport == "nvlink"
        self.received: list[torch.Tensor] = []  # the last round's receive tensors (the nccl transport reuses them)
        if self.nvlink and SHARED_GPU and c.push:
            self.a2a._transport.allocation.one_gpu_per_rank = True  # the pushed combine needs it (see common.SHARED_GPU)

    def counts_tensor(self) -> torch.Tensor:
        return self.a2a._transport.recv_counts

    def poison(self, *written: Optional[torch.Tensor]) -> None:
        """Poisons what the next round writes, once every rank is done with the last one (a peer may still be
        reading this rank's workspace), and before any rank starts it (a peer may write here at once)."""
        self.comm.barrier()
        if self.nvlink:
            at = int(self.a2a.metainfo[fa.get_metainfo_index_pairs()["routing_offset"]])
            _poison(self.a2a.workspace[self.rank, at:])
        self.counts_tensor().fill_(-1)
        for t in (*written, *self.received):
            if t is not None:
                _poison(t)
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.comm.barrier()

    def finish_step(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        if self.nvlink:
            fa.check_error(self.a2a.workspace, self.rank)

    def dispatch_kwargs(self, global_scale) -> dict:
        c = self.case
        if c.hidden_kind != "fused":
            return {}
        gs = None if global_scale is None else torch.tensor([global_scale], dtype=FP32, device=self.device)
        return dict(quant_format=c.fmt, global_scale=gs, swizzled_scales=c.swizzled)

    def mine(self, partials, want, runtime_max: int) -> torch.Tensor:
        """This rank's partials, its rows past the counts NaN: rows no combine may read."""
        mine = partials[self.rank].clone()
        mine[~ref.valid_row_mask(want.recv_counts[self.rank], runtime_max)] = float("nan")
        return mine

    def eager_round(self, tokens: tuple[int, ...], runtime_max: int) -> None:
        c, a2a, rank = self.case, self.a2a, self.rank
        ids, payloads, global_scale = draw_inputs(c, tokens, self.gen)
        partials = draw_partials(c, runtime_max, self.gen)
        want = ref.reference_dispatch(ids, payloads, c.num_experts, runtime_max)
        out = torch.empty(tokens[rank], c.hidden, dtype=c.combine_dtype, device=self.device) if c.caller_out else None
        self.poison(out)
        my_ids, my_payloads = ids[rank].to(self.device), [p.to(self.device) for p in payloads[rank]]
        kwargs = self.dispatch_kwargs(global_scale)
        if c.split:
            a2a.dispatch_send(my_ids, my_payloads, runtime_max, **kwargs)
            recv, counts = a2a.dispatch_recv()
        else:
            recv, counts = a2a.dispatch(my_ids, my_payloads, runtime_max, **kwargs)
        self.finish_step()
        self.received = list(recv)
        check_dispatch(c, rank, recv, counts, want, runtime_max, global_scale)
        self.check_sanitize(recv, counts, want)
        mine = self.mine(partials, want, runtime_max).to(self.device)
        if c.partials == "zero_copy":
            a2a.combine_input().copy_(mine)
            mine = None
        elif c.partials == "misaligned":
            mine = _misaligned_like(mine).copy_(mine)
        if out is None:  # combine allocates its out next: the caching allocator mostly hands it this block, poisoned
            _poison(torch.empty(tokens[rank], c.hidden, dtype=c.combine_dtype, device=self.device))
        if c.split:
            a2a.combine_send(mine, quant_format=c.combine_wire)
            result = a2a.combine_recv(out=out)
        else:
            result = a2a.combine(mine, out=out, quant_format=c.combine_wire)
        self.finish_step()
        assert out is None or result.data_ptr() == out.data_ptr(), "combine did not write the caller's out"
        assert ref.bitwise_equal(result.cpu(), expected_out(c, partials, want, rank)), "combine output differs"

    def check_sanitize(self, recv, counts, want) -> None:
        """Sanitizes the received ids (payload "ids"), on GPUs: rows past the counts take an invalid id."""
        c = self.case
        if "ids" not in c.extras or self.device != "cuda":
            return
        at = c.extras.index("ids") + (1 if c.hidden_kind == "raw" else 2)
        invalid = c.num_experts + 3
        fa.sanitize_expert_ids(recv[at], counts, invalid)
        torch.cuda.synchronize()
        wanted = ref.reference_sanitize(want.recv_payloads[self.rank][at - (c.hidden_kind == "fused")],
                                        want.recv_counts[self.rank], invalid)
        assert torch.equal(recv[at].cpu(), wanted), "sanitized ids differ"

    def graph_case(self) -> None:
        """The first round eagerly from static inputs, captured, then replayed with fresh inputs copied in."""
        c, a2a, rank = self.case, self.a2a, self.rank
        (tokens, runtime_max), = c.rounds
        ids, payloads, global_scale = draw_inputs(c, tokens, self.gen)
        static_ids, static_payloads = ids[rank].cuda(), [p.cuda() for p in payloads[rank]]
        kwargs = self.dispatch_kwargs(global_scale)
        static_partials = torch.empty(c.ep_size, runtime_max, c.hidden, dtype=c.combine_dtype, device="cuda")
        if c.partials == "misaligned":
            static_partials = _misaligned_like(static_partials)
        static_out = torch.empty(tokens[rank], c.hidden, dtype=c.combine_dtype, device="cuda") if c.caller_out else None

        def step():
            recv_, counts_ = a2a.dispatch(static_ids, static_payloads, runtime_max, **kwargs)
            if c.partials == "zero_copy":
                a2a.combine_input().copy_(static_partials)
            return recv_, counts_, a2a.combine(None if c.partials == "zero_copy" else static_partials,
                                               out=static_out, quant_format=c.combine_wire)

        partials = draw_partials(c, runtime_max, self.gen)
        want = ref.reference_dispatch(ids, payloads, c.num_experts, runtime_max)
        static_partials.copy_(self.mine(partials, want, runtime_max))
        self.poison(static_out)
        recv, counts, out = step()  # eager: loads what the capture needs, checked like any round
        self.finish_step()
        check_dispatch(c, rank, recv, counts, want, runtime_max, global_scale)
        assert ref.bitwise_equal(out.cpu(), expected_out(c, partials, want, rank)), "combine output differs (eager)"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            recv, counts, out = step()
        for replay in range(REPLAYS):
            ids, payloads, global_scale = draw_inputs(c, tokens, self.gen)
            partials = draw_partials(c, runtime_max, self.gen)
            want = ref.reference_dispatch(ids, payloads, c.num_experts, runtime_max)
            static_ids.copy_(ids[rank])
            for static, new in zip(static_payloads, payloads[rank]):
                static.copy_(new)
            if global_scale is not None:
                kwargs["global_scale"].fill_(global_scale)
            static_partials.copy_(self.mine(partials, want, runtime_max))
            self.poison(out, *recv)
            graph.replay()
            self.finish_step()
            check_dispatch(c, rank, recv, counts, want, runtime_max, global_scale)
            assert ref.bitwise_equal(out.cpu(), expected_out(c, partials, want, rank)), f"combine, replay {replay}"
        del graph

    def run(self) -> None:
        try:
            if self.case.graph:
                self.graph_case()
            else:
                for tokens, runtime_max in self.case.rounds:
                    self.eager_round(tokens, runtime_max)
        finally:
            self.a2a.destroy()


def run_suite(group, comm, *, transport: str = "nvlink", device: str = "cuda", cases: Optional[int] = None,
              seconds: Optional[float] = None, seed: Optional[int] = None, **limits) -> int:
    """Draws and runs cases until ``cases`` (default FLASHINFER_A2A_TEST_RANDOM_CASES) or ``seconds`` (default
    FLASHINFER_A2A_TEST_RANDOM_SECONDS, counted from the end of the idle case, decided on rank 0 for every rank) run
    out; fails if fewer than ``min(MIN_CASES, cases)`` ran; returns how many ran, and reports it (rank 0: printed,
    and appended to FLASHINFER_A2A_TEST_RANDOM_REPORT where set). ``limits``: ``max_hidden`` / ``max_tokens`` of
    :func:`draw_case`."""
    cases = int(os.environ.get("FLASHINFER_A2A_TEST_RANDOM_CASES", CASES)) if cases is None else cases
    seconds = float(os.environ.get("FLASHINFER_A2A_TEST_RANDOM_SECONDS", SECONDS)) if seconds is None else seconds
    if seed is None:
        seed = int(os.environ["FLASHINFER_A2A_TEST_SEED"]) if "FLASHINFER_A2A_TEST_SEED" in os.environ \
            else shared_seed(comm)
    layout = f"{comm.size} ranks{' sharing one GPU' if SHARED_GPU and device == 'cuda' else ''}, {transport} " \
             f"transport on {device}"
    if comm.rank == 0:
        print(f"randomized: {layout}, seed {seed} (FLASHINFER_A2A_TEST_SEED), up to {cases} cases in {seconds:g} s",
              flush=True)
    cuda = device == "cuda"
    limits["nccl"] = transport == "nccl"

    def run(name: str, case: Case, case_seed: int) -> None:
        if comm.rank == 0:
            print(f"randomized case {name}: {case}", flush=True)
        try:
            Runner(group, comm, case, case_seed, transport, device).run()
        except Exception as exc:
            raise AssertionError(f"rank {comm.rank}, case {name} of seed {seed} ({case}): {exc}") from exc

    # First, every rank idle (runtime_max 0), then one token on the last rank, then idle again: a step of an
    # engine whose data-parallel ranks have no requests.
    idle = (0,) * comm.size
    run("idle", dataclasses.replace(draw_case(random.Random(f"{seed}:idle"), comm.size, cuda=cuda, **limits),
                                    graph=False, rounds=((idle, 0), (idle[:-1] + (1,), 1), (idle, 0))), seed * 1000 - 1)
    start = time.monotonic()  # the library is built and loaded on every rank now
    for index in range(cases):
        go = b"1" if time.monotonic() - start < seconds else b"0"
        if comm.broadcast(go if comm.rank == 0 else None, 0) != b"1":
            break
        run(str(index), draw_case(random.Random(f"{seed}:{index}"), comm.size, cuda=cuda, **limits),
            seed * 1000 + index)
    else:
        index = cases
    if comm.rank == 0:
        print(f"randomized: {index} cases passed in {time.monotonic() - start:.0f} s ({layout})", flush=True)
        if os.environ.get(REPORT_ENV):
            with open(os.environ[REPORT_ENV], "a") as report:
                report.write(f"{layout}: {index}\n")
    least = min(MIN_CASES, cases)
    assert index >= least, (f"randomized: {index} cases ran in {seconds:g} s on {layout}, fewer than {least}: the "
                            f"machine is too slow for FLASHINFER_A2A_TEST_RANDOM_SECONDS")
    return index


def check_randomized(group, comm) -> None:
    """worker.py's check: one process per GPU (or several sharing GPU 0, FLASHINFER_A2A_TEST_SHARED_GPU=1)."""
    run_suite(group, comm)


def check_nccl_gpus(group) -> None:
    """The nccl transport on GPUs (tests/multigpu/nccl_worker.py, an NCCL process group): its kernels, eager and
    replayed from CUDA graphs."""
    from flashinfer_a2a.comm import as_communicator

    run_suite(group, as_communicator(group), transport="nccl")


def check_gloo(rank: int, ep_size: int, device) -> None:
    """The harness on CPU (tests/nccl_workers.spawn_gloo): the nccl transport over gloo, small cases."""
    from flashinfer_a2a.comm import as_communicator

    run_suite(None, as_communicator(None), transport="nccl", device="cpu", cases=GLOO_CASES, seconds=120.0,
              max_hidden=1026, max_tokens=64)


CHECKS = {"gloo": check_gloo}
