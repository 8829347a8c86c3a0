"""``--overlap``: dual-batch overlap, timed. Each rank splits its step into two micro-batches A and B of ``tokens``
tokens, each on a workspace of its own, and runs a compute stage per micro-batch between its dispatch and its
combine (:mod:`.experts`): ``experts``, the received tokens' routed experts (grouped GEMMs of DeepSeek-V3's shape,
bf16 runs with the routing payloads only), and ``dense``, one GEMM. Loops, each timed like the pair (bench.timing;
slowest rank, median over samples):

- ``a2a``: the two micro-batches' dispatch and combine, whole calls, no compute (once per token count and budget);
- ``compute``: the two stages alone;
- ``serial``: dispatch A, stage A, combine A, dispatch B, stage B, combine B (whole calls: nothing overlaps);
- ``interleaved``: send A, send B, receive A, stage A (B's dispatch in flight), combine-send A, receive B, stage B
  (A's combine in flight), combine-send B, combine-receive A, combine-receive B; the halves on a communication
  stream (:mod:`flashinfer_a2a.transports.overlap`), so the transfers run beside the stages.

``interleaved`` is reported against ``max(a2a, compute)`` (1.0: the shorter part hidden entirely) and against the
sum (1.0: nothing hidden). With ``--num-sms`` each budget is timed too: the all-to-all's kernels get that many
multiprocessors (the GEMMs may take any, or with ``--gemm-carveout`` only the others: torch's experimental SM
carve-out, where this torch has it), and the a2a alone is also reported against the whole GPU's (``a2a/whole``). On
simulated ranks every rank's kernels and stages share one GPU; across processes each rank has its own.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from .. import config
from .. import functional as F
from .. import split_phase as sp
from ..library.errors import check_error
from ..moe_alltoall import MoeAlltoAll
from ..testing.simulate import SimulatedRanks
from ..transports import overlap as comm_streams
from .args import DTYPES, BenchArgs
from .experts import (DENSE_N, INTERMEDIATE, STAGE_EXPERTS, ExpertStage, ExpertWeights, dense_stage,
                      grouped_mm_works, local_experts)
from .impls import dispatch_row_bytes, make_case, routing_payload_bytes
from .report import describe_run
from .session import Session
from .timing import RankSteps, time_loop

LOOPS = ("a2a", "compute", "serial", "interleaved")
STAGES = ("experts", "dense")


class _MicroBatch:
    """One micro-batch's workspace (simulated ranks, or this process's MoeAlltoAll with ``comm_stream=True``) and
    its calls per rank: whole and split dispatch and combine, zero copy (the stage writes the combine input)."""

    def __init__(self, args: BenchArgs, session: Session, dtype: torch.dtype, num_sms: int, index: int,
                 streams: Sequence[Optional[comm_streams.CommStream]]) -> None:
        self.session, self.num_experts, self.num_sms, self.dtype = session, args.shape.num_experts, num_sms, dtype
        self.streams = streams  # simulated ranks: each rank's communication stream
        max_tokens = max(args.tokens)
        self.hidden = args.shape.hidden
        if session.simulated:
            config_ = F.WorkspaceConfig(ep_size=session.ep_size, max_num_tokens=max_tokens,
                                        dispatch_bytes_per_token=dispatch_row_bytes(args, dtype),
                                        combine_bytes_per_token=self.hidden * dtype.itemsize, top_k=args.shape.top_k)
            self.sim, self.moe = SimulatedRanks(config_, session.device), None
        else:
            self.sim = None
            self.moe = MoeAlltoAll(session.group, max_num_tokens=max_tokens, top_k=args.shape.top_k,
                                   num_experts=args.shape.num_experts, hidden_size=self.hidden, dtype=dtype,
                                   extra_dispatch_bytes_per_token=routing_payload_bytes(args),
                                   device=session.device.index, num_sms=num_sms or None, comm_stream=True,
                                   namespace=f"overlap-micro-batch-{index}")  # a workspace each

    @property
    def workspace(self) -> torch.Tensor:
        return self.sim.workspace if self.sim is not None else self.moe.workspace

    def calls(self, rank: int, ids: torch.Tensor, payloads: Sequence[torch.Tensor]) -> dict[str, Callable]:
        """``dispatch``, ``combine`` (whole) and ``dispatch_send``, ``dispatch_recv``, ``combine_send``,
        ``combine_recv`` (on the communication stream); ``dispatch`` returns ``(recv_payloads, recv_counts)``."""
        tokens = ids.shape[0]
        out = torch.empty(tokens, self.hidden, dtype=self.dtype, device=self.session.device)
        if self.moe is not None:
            moe = self.moe
            return {
                "dispatch": lambda: moe.dispatch(ids, payloads, tokens),
                "combine": lambda: moe.combine(out=out),
                "dispatch_send": lambda: moe.dispatch_send(ids, payloads, tokens),
                "dispatch_recv": moe.dispatch_recv,
                "combine_send": lambda: moe.combine_send(out=out),
                "combine_recv": moe.combine_recv,
            }
        # Simulated ranks: the functional calls MoeAlltoAll makes, one counts tensor, this rank's stream.
        sim, stream, timeout = self.sim, self.streams[rank], config.timeout_or_default(None)
        ws, cfg, num_sms = sim.workspace, sim.config, self.num_sms
        counts = torch.empty(sim.ep_size, dtype=torch.int32, device=self.session.device)
        common = dict(timeout_s=timeout, num_sms=num_sms)

        def dispatch():
            F.dispatch_counts(ws, rank, cfg, ids, payloads, tokens, self.num_experts, recv_counts=counts,
                              timeout_s=timeout, num_sms=num_sms or sim.dispatch_sms)
            return F.recv_views(ws, rank, cfg, tokens, payloads), counts

        return {
            "dispatch": dispatch,
            "combine": lambda: F.combine(ws, rank, cfg, counts, tokens, tokens, out=out, **common),
            "dispatch_send": lambda: sp.dispatch_send(ws, rank, cfg, ids, payloads, tokens, self.num_experts,
                                                      recv_counts=counts, timeout_s=timeout,
                                                      num_sms=num_sms or sim.dispatch_sms, comm_stream=stream),
            "dispatch_recv": lambda: sp.dispatch_recv(ws, rank, cfg, counts, tokens, comm_stream=stream),
            "combine_send": lambda: sp.combine_send(ws, rank, cfg, counts, tokens, hidden=self.hidden,
                                                    dtype=self.dtype, out=out, comm_stream=stream, **common),
            "combine_recv": lambda: sp.combine_recv(ws, rank, cfg, counts, tokens, tokens, out=out,
                                                    comm_stream=stream),
        }

    def combine_input(self, rank: int, tokens: int) -> torch.Tensor:
        """The zero-copy combine input of the dispatch just made."""
        if self.sim is not None:
            return self.sim.combine_input(rank, tokens, self.hidden, self.dtype)
        return self.moe.combine_input(self.hidden, self.dtype)

    def close(self) -> None:
        if self.moe is not None:
            self.moe.destroy()


def _loops(a: dict[str, Callable], b: dict[str, Callable], stage_a: Callable, stage_b: Callable
           ) -> dict[str, Callable]:
    def a2a():
        a["dispatch"](), a["combine"](), b["dispatch"](), b["combine"]()

    def compute():
        stage_a(), stage_b()

    def serial():
        a["dispatch"](), stage_a(), a["combine"](), b["dispatch"](), stage_b(), b["combine"]()

    def interleaved():
        a["dispatch_send"](), b["dispatch_send"](), a["dispatch_recv"](), stage_a(), a["combine_send"]()
        b["dispatch_recv"](), stage_b(), b["combine_send"](), a["combine_recv"](), b["combine_recv"]()

    return {"a2a": a2a, "compute": compute, "serial": serial, "interleaved": interleaved}


@contextlib.contextmanager
def gemm_carveout(num_sms: int) -> Iterator[bool]:
    """Leaves ``num_sms`` multiprocessors out of the GEMMs launched (or captured) inside (torch's experimental
    carve-out: cuBLASLt's SM count target, ``torch._grouped_mm``'s grid); yields whether it could."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if not num_sms or setter is None:
        yield False
        return
    previous = torch._C._get_sm_carveout_experimental()
    setter(num_sms)
    try:
        yield True
    finally:
        setter(previous)


def run_overlap(args: BenchArgs, session: Session, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Times the loops for every dtype, SM budget, token count and stage; returns one record per combination."""
    ranks = list(range(session.ep_size)) if session.simulated else [session.rank]
    grouped = grouped_mm_works(session.device)
    experts = local_experts(args.shape.num_experts, session.ep_size)
    weights = (ExpertWeights.random(experts, args.shape.hidden, session.device, args.seed + 1)
               if args.routing_payloads else None)
    # Simulated ranks: a communication stream per rank, shared by the micro-batches as MoeAlltoAll's are.
    streams = ([comm_streams.for_stream(torch.cuda.Stream(session.device, priority=comm_streams.PRIORITY))
                for _ in ranks] if session.simulated else [None])
    records = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        stage_weights = weights if dtype == torch.bfloat16 else None  # the experts' GEMMs are bf16
        stages = [s for s in STAGES if s == "dense" or stage_weights is not None]
        for num_sms in (0, *args.num_sms):
            batches = [_MicroBatch(args, session, dtype, num_sms, index, streams) for index in range(2)]
            try:
                for tokens in args.tokens:
                    progress(f"overlap: tokens/rank {tokens}, {dtype_name}, num_sms {num_sms or 'all'}")
                    case = _Case(args, session, batches, ranks, dtype, tokens, stage_weights, grouped)
                    for record in case.time(stages, num_sms):
                        record.update(dtype=dtype_name, local_experts=experts,
                                      experts_gemm="torch._grouped_mm" if grouped else "torch.mm per expert")
                        records.append(record)
            finally:
                for batch in batches:
                    batch.close()
    relate_budgets(records)
    return records


class _Case:
    """One token count: both micro-batches' inputs, every rank's calls and stages, one untimed round made."""

    def __init__(self, args: BenchArgs, session: Session, batches: Sequence[_MicroBatch], ranks: Sequence[int],
                 dtype: torch.dtype, tokens: int, weights: Optional[ExpertWeights], grouped: bool) -> None:
        self.args, self.session, self.batches, self.ranks, self.tokens = args, session, batches, ranks, tokens
        cases = [make_case(args, session, tokens, dtype, args.routings[0], args.seed + 7919 * m) for m in range(2)]
        self.streams = [batches[0].sim.streams[r] if session.simulated else None for r in ranks]
        self.calls = []  # [rank][micro-batch] -> calls
        for rank in ranks:
            calls = []
            for batch, case in zip(batches, cases):
                payloads = case.payloads[rank]
                ids = payloads[1] if len(payloads) > 1 else case.topk_ids[rank].to(session.device)
                calls.append(batch.calls(rank, ids, payloads))
            self.calls.append(calls)
        self.stages: dict[str, list[list[Callable]]] = {"experts": [], "dense": []}  # [rank][micro-batch]
        dense_weight = None
        for k, rank in enumerate(ranks):
            dense = []
            for m in range(2):
                step, dense_weight = dense_stage(tokens, args.shape.hidden, session.device,
                                                 args.seed + 31 * rank + m, dense_weight)
                dense.append(step)
            self.stages["dense"].append(dense)
            with self._on(k):  # cuBLAS makes its handle and loads its kernels on a stream's first GEMM: not while
                for step in dense:  # a rank spins on a peer, nor inside a graph capture
                    step()
        torch.cuda.synchronize()
        self._first_round(weights, grouped)

    def _on(self, k: int):
        stream = self.streams[k]
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def _each_rank(self, fn: Callable[[int, int], Any]) -> list[Any]:
        """``fn(k, rank)`` on each rank's stream, then a device sync (nothing here may wait on a peer launched
        later: kernels load and GEMM handles are made between the phases)."""
        results = []
        for k, rank in enumerate(self.ranks):
            with self._on(k):
                results.append(fn(k, rank))
        torch.cuda.synchronize()
        return results

    def _first_round(self, weights: Optional[ExpertWeights], grouped: bool) -> None:
        """One untimed round of whole calls per micro-batch, the stage run between each dispatch and its combine:
        builds the ``experts`` stages on the received rows (their kernels loaded, their pair counts read) and leaves
        every combine input written, so the ``a2a`` loop combines what a stage wrote."""
        experts: list[list[Callable]] = [[] for _ in self.ranks]
        for m, batch in enumerate(self.batches):
            received = self._each_rank(lambda k, rank: self.calls[k][m]["dispatch"]())

            def stage(k: int, rank: int) -> None:
                combine_input = batch.combine_input(rank, self.tokens)
                if weights is None:  # no ids or weights dispatched: the combine input is all there is
                    combine_input.normal_()
                    return
                (recv_x, recv_ids, recv_weights), counts = received[k]
                experts[k].append(ExpertStage(recv_x, recv_ids, recv_weights, counts, combine_input, rank,
                                              self.args.shape.num_experts, weights, grouped))
                experts[k][-1]()

            self._each_rank(stage)
            self._each_rank(lambda k, rank: self.calls[k][m]["combine"]())
        if weights is not None:
            self.stages["experts"] = experts

    def time(self, stages: Sequence[str], num_sms: int) -> list[dict[str, Any]]:
        """The ``a2a`` loop once, then the others per stage; one record per stage."""
        args = self.args
        records = []
        a2a: dict[str, float] = {}
        for stage in stages:
            record: dict[str, Any] = {"tokens": self.tokens, "num_sms": num_sms, "stage": stage, "modes": {}}
            steps: dict[str, list[RankSteps]] = {loop: [] for loop in LOOPS}
            for k in range(len(self.ranks)):
                for loop, fn in _loops(*self.calls[k], *self.stages[stage][k]).items():
                    steps[loop].append(RankSteps(fn, lambda: None, self.streams[k]))
            for mode in args.modes:
                times = {}
                for loop in LOOPS:
                    if loop == "a2a" and mode in a2a:
                        times[loop] = a2a[mode]
                        continue
                    carve = num_sms if loop == "interleaved" and args.gemm_carveout else 0
                    with gemm_carveout(carve) as carved:
                        times[loop] = self._time(steps[loop], mode)
                    if loop == "interleaved":
                        record["gemm_carveout"] = carved
                a2a[mode] = times["a2a"]
                times["interleaved_over_max"] = times["interleaved"] / max(times["a2a"], times["compute"])
                times["interleaved_over_sum"] = times["interleaved"] / (times["a2a"] + times["compute"])
                record["modes"][mode] = times
            records.append(record)
        return records

    def _time(self, steps: Sequence[RankSteps], mode: str) -> float:
        graph = mode == "graph"
        t = time_loop(steps, self.args.iters, self.args.warmup, graph, self.session.barrier, split=False,
                      group=self.args.pair_group if graph else 1)
        worst = torch.cat([torch.tensor(v) for v in self.session.gather(t.gpu_us[..., 0].tolist())]).max(0).values
        for batch in self.batches:
            for rank in self.ranks:
                check_error(batch.workspace, rank)
        return float(worst.median())


def relate_budgets(records: list[dict[str, Any]]) -> None:
    """Adds ``a2a_over_whole`` to each budget's times: its a2a alone over the whole GPU's (same dtype, tokens,
    stage and mode)."""
    whole = {(r["dtype"], r["tokens"], r["stage"], mode): t["a2a"]
             for r in records if not r["num_sms"] for mode, t in r["modes"].items()}
    for r in records:
        for mode, t in r["modes"].items():
            base = whole.get((r["dtype"], r["tokens"], r["stage"], mode))
            if r["num_sms"] and base:
                t["a2a_over_whole"] = t["a2a"] / base


def format_overlap_table(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    hidden = meta["shape"]["hidden"]
    first = records[0] if records else {}
    carve = any(r.get("gemm_carveout") for r in records)
    lines = [
        f"dual-batch overlap, {describe_run(meta)}; two micro-batches of `tokens` per rank, the interleaved loop's "
        "split halves on a communication stream",
        f"stages per micro-batch: experts = {first.get('local_experts', '?')} expert groups per rank "
        f"({STAGE_EXPERTS} over all ranks), gate-up [pairs, {hidden}] x [{hidden}, {2 * INTERMEDIATE}] and down "
        f"[pairs, {INTERMEDIATE}] x [{INTERMEDIATE}, {hidden}] bf16 ({first.get('experts_gemm', '?')}); "
        f"dense = [tokens, {hidden}] x [{hidden}, {DENSE_N}] bf16",
        "us per step, slowest rank, median over iterations; ilv/max: 1.0 = the shorter part hidden entirely; ilv/sum: "
        "1.0 = nothing hidden; a2a/whole: the a2a alone under the budget over the whole GPU's"
        + ("; under a budget the interleaved GEMMs leave its multiprocessors free" if carve else ""),
        "",
        f"{'tokens':>6} {'dtype':>5} {'num_sms':>7} {'stage':>7} {'mode':>5} | {'a2a':>8} {'compute':>8} "
        f"{'serial':>8} {'interlv':>8} | {'ilv/max':>7} {'ilv/sum':>7} {'a2a/whole':>9}",
    ]
    for r in records:
        for mode, t in r["modes"].items():
            ratio = f"{t['a2a_over_whole']:9.2f}" if "a2a_over_whole" in t else f"{'-':>9}"
            lines.append(f"{r['tokens']:>6} {r['dtype']:>5} {r['num_sms'] or 'all':>7} {r['stage']:>7} {mode:>5} | "
                         f"{t['a2a']:8.1f} {t['compute']:8.1f} {t['serial']:8.1f} {t['interleaved']:8.1f} | "
                         f"{t['interleaved_over_max']:7.2f} {t['interleaved_over_sum']:7.2f} {ratio}")
    return "\n".join(lines)
