"""``--overlap``: dual-batch overlap, timed. Each rank splits its step into two micro-batches A and B of ``tokens``
tokens, each on a workspace of its own, and runs a bf16 GEMM of the expert shape (``[tokens, hidden] x [hidden,
2048]``) per micro-batch. Four loops, each timed like the pair (bench.timing; slowest rank, median over samples):

- ``a2a``: the two micro-batches' dispatch and combine, whole calls, no GEMM;
- ``gemm``: the two GEMMs alone;
- ``serial``: dispatch A, GEMM A, combine A, dispatch B, GEMM B, combine B (whole calls: nothing overlaps);
- ``overlap``: send A, send B, receive A, GEMM A (B's dispatch in flight), combine-send A, receive B, GEMM B (A's
  combine in flight), combine-send B, combine-receive A, combine-receive B.

``overlap`` is reported against ``a2a + gemm`` (1.0: no overlap at all) and against ``max(a2a, gemm)`` (1.0: the
shorter one hidden entirely). With ``--num-sms`` each budget is timed too. On simulated ranks every rank's kernels
and GEMMs share one GPU, so the GEMMs of all ranks run at once; across processes each rank has its GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import torch

from .. import config
from .. import functional as F
from ..library import ops
from ..library.constants import SPLIT_RECV, SPLIT_SEND
from ..library.errors import check_error
from ..moe_alltoall import MoeAlltoAll
from ..testing.simulate import SimulatedRanks
from .args import DTYPES, BenchArgs
from .impls import dispatch_row_bytes, make_case, routing_payload_bytes
from .report import describe_run
from .session import Session
from .timing import RankSteps, time_loop

GEMM_N = 2048
LOOPS = ("a2a", "gemm", "serial", "overlap")


class _MicroBatch:
    """One micro-batch's workspace (simulated ranks or this process's MoeAlltoAll) and its calls per rank: whole
    and split dispatch and combine, zero copy (the expert outputs already sit in the combine input)."""

    def __init__(self, args: BenchArgs, session: Session, dtype: torch.dtype, num_sms: int, index: int) -> None:
        self.session, self.num_experts, self.num_sms, self.dtype = session, args.shape.num_experts, num_sms, dtype
        max_tokens = max(args.tokens)
        self.hidden = args.shape.hidden
        if session.simulated:
            config = F.WorkspaceConfig(ep_size=session.ep_size, max_num_tokens=max_tokens,
                                       dispatch_bytes_per_token=dispatch_row_bytes(args, dtype),
                                       combine_bytes_per_token=self.hidden * dtype.itemsize, top_k=args.shape.top_k)
            self.sim, self.moe = SimulatedRanks(config, session.device), None
        else:
            self.sim = None
            self.moe = MoeAlltoAll(session.group, max_num_tokens=max_tokens, top_k=args.shape.top_k,
                                   num_experts=args.shape.num_experts, hidden_size=self.hidden, dtype=dtype,
                                   extra_dispatch_bytes_per_token=routing_payload_bytes(args),
                                   device=session.device.index, num_sms=num_sms or None,
                                   namespace=f"overlap-micro-batch-{index}")  # a workspace each

    @property
    def workspace(self) -> torch.Tensor:
        return self.sim.workspace if self.sim is not None else self.moe.workspace

    def calls(self, rank: int, ids: torch.Tensor, payloads: Sequence[torch.Tensor]) -> dict[str, Callable]:
        tokens = ids.shape[0]
        out = torch.empty(tokens, self.hidden, dtype=self.dtype, device=self.session.device)
        if self.moe is not None:
            moe = self.moe
            return {
                "dispatch": lambda: moe.dispatch(ids, payloads, tokens),
                "combine": lambda: moe.combine(out=out),
                "dispatch_send": lambda: moe.dispatch_send(ids, payloads, tokens),
                "dispatch_recv": moe.dispatch_recv,
                "combine_send": lambda: moe.combine_send(),
                "combine_recv": lambda: moe.combine_recv(out=out),
            }
        # Simulated ranks: the calls MoeAlltoAll makes (a counts tensor made once, no receive views needed here).
        sim, num_sms, timeout = self.sim, self.num_sms, config.timeout_or_default(None)
        counts = torch.empty(sim.ep_size, dtype=torch.int32, device=self.session.device)
        no_rows = torch.empty(0, self.hidden, dtype=self.dtype, device=self.session.device)

        def dispatch(phase=0):
            F.dispatch_counts(sim.workspace, rank, sim.config, ids, payloads, tokens, self.num_experts,
                              recv_counts=counts, timeout_s=timeout, num_sms=num_sms or sim.dispatch_sms,
                              phase=phase)

        def combine(phase=0):
            F.combine(sim.workspace, rank, sim.config, counts, 0 if phase == SPLIT_SEND else tokens, tokens,
                      out=no_rows if phase == SPLIT_SEND else out, timeout_s=timeout, num_sms=num_sms, phase=phase)

        def dispatch_recv():
            ops.dispatch_recv(sim.workspace, counts, rank, *sim.config.sizes(), tokens, timeout)

        return {"dispatch": dispatch, "combine": combine, "dispatch_send": lambda: dispatch(SPLIT_SEND),
                "dispatch_recv": dispatch_recv, "combine_send": lambda: combine(SPLIT_SEND),
                "combine_recv": lambda: combine(SPLIT_RECV)}

    def fill_combine_input(self, rank: int, tokens: int) -> None:
        if self.sim is not None:
            self.sim.combine_input(rank, tokens, self.hidden, self.dtype).normal_()
        else:
            self.moe.combine_input(self.hidden, self.dtype).normal_()

    def close(self) -> None:
        if self.moe is not None:
            self.moe.destroy()


def _loops(a: dict[str, Callable], b: dict[str, Callable], gemm_a: Callable, gemm_b: Callable) -> dict[str, Callable]:
    def a2a():
        a["dispatch"](), a["combine"](), b["dispatch"](), b["combine"]()

    def gemm():
        gemm_a(), gemm_b()

    def serial():
        a["dispatch"](), gemm_a(), a["combine"](), b["dispatch"](), gemm_b(), b["combine"]()

    def overlap():
        a["dispatch_send"](), b["dispatch_send"](), a["dispatch_recv"](), gemm_a(), a["combine_send"]()
        b["dispatch_recv"](), gemm_b(), b["combine_send"](), a["combine_recv"](), b["combine_recv"]()

    return {"a2a": a2a, "gemm": gemm, "serial": serial, "overlap": overlap}


def run_overlap(args: BenchArgs, session: Session, progress: Callable[[str], None]) -> list[dict[str, Any]]:
    """Times the four loops for every dtype, token count and SM budget; returns one record per combination."""
    records = []
    for dtype_name in args.dtypes:
        dtype = DTYPES[dtype_name]
        for num_sms in (0, *args.num_sms):
            batches = [_MicroBatch(args, session, dtype, num_sms, index) for index in range(2)]
            try:
                for tokens in args.tokens:
                    progress(f"overlap: tokens/rank {tokens}, {dtype_name}, num_sms {num_sms or 'all'}")
                    records.append(_time_case(args, session, batches, dtype, dtype_name, tokens, num_sms))
            finally:
                for batch in batches:
                    batch.close()
    return records


def _time_case(args: BenchArgs, session: Session, batches: Sequence[_MicroBatch], dtype: torch.dtype,
               dtype_name: str, tokens: int, num_sms: int) -> dict[str, Any]:
    cases = [make_case(args, session, tokens, dtype, args.routings[0], args.seed + 7919 * m) for m in range(2)]
    weight = torch.randn(args.shape.hidden, GEMM_N, device=session.device).to(torch.bfloat16)
    steps: dict[str, list[RankSteps]] = {loop: [] for loop in LOOPS}
    ranks = list(cases[0].payloads)
    rank_calls = []
    for rank in ranks:
        stream = batches[0].sim.streams[rank] if session.simulated else None
        calls = []
        for batch, case in zip(batches, cases):
            payloads = case.payloads[rank]
            ids = payloads[1] if len(payloads) > 1 else case.topk_ids[rank].to(session.device)
            calls.append(batch.calls(rank, ids, payloads))
        rank_calls.append(calls)
        x = [torch.randn(tokens, args.shape.hidden, device=session.device).to(torch.bfloat16) for _ in range(2)]
        y = [torch.empty(tokens, GEMM_N, dtype=torch.bfloat16, device=session.device) for _ in range(2)]
        gemms = [lambda m=m, x=x, y=y: torch.matmul(x[m], weight, out=y[m]) for m in range(2)]
        # cuBLAS makes its handle and loads its kernels on a stream's first GEMM: that must not happen inside a
        # graph capture, nor (lazy module loading may synchronize the device) while a rank spins on a peer.
        torch.cuda.synchronize()  # the inputs above were made on the current stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for gemm in gemms:
                gemm()
        torch.cuda.synchronize()
        for loop, fn in _loops(calls[0], calls[1], *gemms).items():
            steps[loop].append(RankSteps(fn, lambda: None, stream))
    # One untimed round of whole calls per micro-batch, the combine inputs filled between its dispatch and its
    # combine: every loop then combines them as they are (zero copy), so each times the same work.
    for m, batch in enumerate(batches):
        for phase in ("dispatch", "fill", "combine"):
            for k, (rank, s) in enumerate(zip(ranks, steps["a2a"])):
                with s.on_stream():
                    if phase == "fill":
                        batch.fill_combine_input(rank, tokens)
                    else:
                        rank_calls[k][m][phase]()
    torch.cuda.synchronize()
    record: dict[str, Any] = {"tokens": tokens, "dtype": dtype_name, "num_sms": num_sms, "modes": {}}
    for mode in args.modes:
        times = {}
        for loop in LOOPS:
            graph = mode == "graph"
            t = time_loop(steps[loop], args.iters, args.warmup, graph, session.barrier, split=False,
                          group=args.pair_group if graph else 1)
            worst = torch.cat([torch.tensor(v) for v in session.gather(t.gpu_us[..., 0].tolist())]).max(0).values
            times[loop] = float(worst.median())
            for batch in batches:
                for rank in ranks:
                    check_error(batch.workspace, rank)
        times["overlap_over_sum"] = times["overlap"] / (times["a2a"] + times["gemm"])
        times["overlap_over_max"] = times["overlap"] / max(times["a2a"], times["gemm"])
        record["modes"][mode] = times
    return record


def format_overlap_table(meta: dict[str, Any], records: list[dict[str, Any]]) -> str:
    lines = [
        f"dual-batch overlap, {describe_run(meta)}; GEMM [tokens, hidden] x [hidden, {GEMM_N}] bf16 per micro-batch; "
        "two micro-batches of `tokens` per rank",
        "us per step, slowest rank, median over iterations; overlap/sum: 1.0 = nothing hidden; overlap/max: 1.0 = "
        "the shorter part hidden entirely",
        "",
        f"{'tokens':>6} {'dtype':>5} {'num_sms':>7} {'mode':>5} | {'a2a':>8} {'gemm':>8} {'serial':>8} "
        f"{'overlap':>8} | {'ovl/sum':>7} {'ovl/max':>7}",
    ]
    for r in records:
        for mode, t in r["modes"].items():
            lines.append(f"{r['tokens']:>6} {r['dtype']:>5} {r['num_sms'] or 'all':>7} {mode:>5} | "
                         f"{t['a2a']:8.1f} {t['gemm']:8.1f} {t['serial']:8.1f} {t['overlap']:8.1f} | "
                         f"{t['overlap_over_sum']:7.2f} {t['overlap_over_max']:7.2f}")
    return "\n".join(lines)
