"""``python -m flashinfer_a2a.bench``: runs every case, prints the table, writes JSON and PNG."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from ..library import ops as library
from .args import DTYPES, BenchArgs, parse_args
from .impls import (A2A, Case, combine_row_bytes, dispatch_row_bytes, make_case, nccl_a2a_steps, nccl_ag_rs_steps,
                    variants)
from . import floor
from .report import add_derived, format_table, output_paths, write_json, write_plot
from .session import Session, start
from .timing import PHASES, RankSteps, summarize, time_loop

NO_GPU_MESSAGE = (
    "flashinfer_a2a.bench needs an NVIDIA GPU (Hopper or Blackwell) and this process sees none "
    "(torch.cuda.is_available() is False). Run it on a GPU machine: alone for simulated ranks on one GPU, or under "
    "torchrun/mpirun with one process per GPU."
)


def _all_ranks(session: Session, times: torch.Tensor) -> torch.Tensor:
    """Every process's ``[ranks here, ...]`` times, concatenated along the ranks."""
    return torch.cat([torch.tensor(t) for t in session.gather(times.tolist())])


def _time_impl(session: Session, args: BenchArgs, make_steps: Callable[[], Sequence[RankSteps]],
               check: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Times one implementation in every mode; a failure on any rank becomes an ``error`` entry on all ranks."""
    results: dict[str, Any] = {}
    try:
        steps = make_steps()
        error = None
    except Exception as exc:  # reported in the table; other implementations still run
        steps, error = None, f"set-up failed: {type(exc).__name__}: {exc}"
    for mode in args.modes:
        if error is None:
            graph = mode == "graph"
            try:
                timings = time_loop(steps, args.iters, args.warmup, graph, session.barrier)
                pair = time_loop(steps, args.iters, args.warmup, graph, session.barrier, split=False,
                                 group=args.pair_group if graph else 1)
                check()
            except Exception as exc:
                timings, error_here = None, f"{mode} run failed: {type(exc).__name__}: {exc}"
            else:
                error_here = None
        else:
            timings, error_here = None, error
        errors = [e for e in session.gather(error_here) if e is not None]
        if errors:
            results[mode] = {"error": errors[0].splitlines()[0][:200]}
            continue
        stats: dict[str, Any] = summarize(_all_ranks(session, timings.gpu_us),
                                          _all_ranks(session, pair.gpu_us[..., 0]))
        if timings.host_us is not None:
            host = _all_ranks(session, timings.host_us)
            stats["host_us"] = {phase: float(host[..., j].flatten().median()) for j, phase in enumerate(PHASES)}
        results[mode] = stats
    return results


def _run_case(args: BenchArgs, session: Session, ours: Sequence[A2A], case: Case,
              link_floor: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    impls: dict[str, Any] = {}
    impl_bytes: dict[str, Any] = {}
    for a2a in ours:
        impls[a2a.variant.name] = _time_impl(session, args, lambda: a2a.steps(case), lambda: a2a.check(case))
        rows = (dispatch_row_bytes(args, case.dtype, a2a.variant), combine_row_bytes(args, case.dtype, a2a.variant))
        impl_bytes[a2a.variant.name] = {p: case.traffic.mean_bytes(row) for p, row in zip(PHASES, rows)}
    if args.baselines and not session.simulated:
        impls["nccl_a2a"] = _time_impl(session, args, lambda: [nccl_a2a_steps(session, case)])
        impls["nccl_ag_rs"] = _time_impl(session, args, lambda: [nccl_ag_rs_steps(session, case)])
    hidden_bytes = args.shape.hidden * case.dtype.itemsize
    result = {
        "tokens": case.tokens,
        "dtype": next(name for name, d in DTYPES.items() if d == case.dtype),
        "routing": case.routing,
        "row_bytes": {"dispatch": dispatch_row_bytes(args, case.dtype), "combine": hidden_bytes},
        "bytes": {"dispatch": case.traffic.mean_bytes(dispatch_row_bytes(args, case.dtype)),
                  "combine": case.traffic.mean_bytes(hidden_bytes)},
        "impl_bytes": impl_bytes,
        "impls": impls,
    }
    if link_floor is not None and session.ep_size > 1:
        result["floor_us"] = floor.pair_floor_us(link_floor, session.ep_size, result["bytes"]["dispatch"]["remote"],
                                                 result["bytes"]["combine"]["remote"])
    add_derived(result)
    return result


def _launch_prefix(session: Session) -> str:
    if session.launcher == "torchrun":
        return f"torchrun --nproc-per-node {session.ep_size} "
    if session.launcher == "mpirun":
        return f"mpirun -n {session.ep_size} python "
    return "python "


def _meta(args: BenchArgs, session: Session, argv: Sequence[str]) -> dict[str, Any]:
    return {
        "command": _launch_prefix(session) + " ".join(["-m flashinfer_a2a.bench", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(session.device),
        "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "launcher": session.launcher,
        "ep_size": session.ep_size,
        "model": args.model,
        "shape": dataclasses.asdict(args.shape),
        "payloads": "hidden, top-k ids (int32), top-k weights (fp32)" if args.routing_payloads else "hidden",
        "iters": args.iters,
        "warmup": args.warmup,
        "args": {k: v for k, v in dataclasses.asdict(args).items() if k != "shape"},
    }


def _main_overlap(args: BenchArgs, session: Session, progress: Callable[[str], None], argv: Sequence[str]) -> int:
    """``--overlap``: the dual-batch overlap study (flashinfer_a2a.bench.overlap) instead of the table."""
    from .overlap import format_overlap_table, run_overlap

    try:
        records = run_overlap(args, session, progress)
        meta = _meta(args, session, argv)
    finally:
        session.close()
    if session.is_root:
        print(format_overlap_table(meta, records))
        json_path = os.path.join(os.path.dirname(output_paths(args.output_dir)[0]), "overlap.json")
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "overlap": records}, f, indent=1)
        print(f"wrote {json_path}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    link_floor = floor.load(args.floor)  # a bad file fails before any GPU work
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 1
    session = start(args.sim_ranks)
    if link_floor is not None and session.ep_size > 1:
        floor.check_ranks(link_floor, session.ep_size)  # before the library loads and any case runs
    progress = (lambda text: None) if args.quiet or not session.is_root else (
        lambda text: print(text, file=sys.stderr, flush=True))
    # Loaded before the first case, with a word first: a first run compiles the library here (minutes; the JIT
    # prints a line when it starts and when it ends, and a rank that waits for another's build says so).
    progress("loading flashinfer_a2a's CUDA library (a first run compiles it)")
    library.load()
    if args.overlap:
        return _main_overlap(args, session, progress, argv)
    plan = [(dtype, tokens, routing) for dtype in args.dtypes for tokens in args.tokens for routing in args.routings]
    cases: list[dict[str, Any]] = []
    start_time = time.monotonic()
    try:
        for dtype_name in args.dtypes:
            ours: list[A2A] = []
            try:
                for variant in variants(args, DTYPES[dtype_name], session.simulated):
                    ours.append(A2A(args, session, DTYPES[dtype_name], variant))
                for tokens in args.tokens:
                    for routing in args.routings:
                        index = len(cases)
                        progress(f"[{index + 1}/{len(plan)}] tokens/rank {tokens}, {dtype_name}, {routing} routing "
                                 f"({time.monotonic() - start_time:.0f} s)")
                        case = make_case(args, session, tokens, DTYPES[dtype_name], routing, args.seed + index)
                        cases.append(_run_case(args, session, ours, case, link_floor))
            finally:
                for a2a in ours:
                    a2a.close()
        meta = _meta(args, session, argv)
        if link_floor is not None:
            meta["floor"] = link_floor
    finally:
        session.close()
    if not session.is_root:
        return 0
    print(format_table(meta, cases))
    json_path, png_path = output_paths(args.output_dir)
    write_json(json_path, meta, cases)
    why_not = write_plot(png_path, meta, cases)
    print(f"wrote {json_path}" + (f" and {png_path}" if why_not is None else f" (no plot: {why_not})"))
    failed = failed_rows(cases)
    if failed:
        print(f"flashinfer_a2a.bench: {len(failed)} timed row(s) failed, first {failed[0]} (see the table)",
              file=sys.stderr)
        return 1
    return 0


def failed_rows(cases: list[dict[str, Any]]) -> list[str]:
    """``"<tokens> <impl> <mode>: <error>"`` for each row that set up or ran with an error."""
    return [f"{case['tokens']} {impl} {mode}: {stats['error']}" for case in cases
            for impl, modes in case["impls"].items() for mode, stats in modes.items() if "error" in stats]
