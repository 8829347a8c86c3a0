"""Per-iteration GPU times of a dispatch/combine loop, under CUDA-graph replay or eager launches.

Each iteration of each rank records events on the rank's stream: before dispatch, between dispatch and combine
(``split``), and the next iteration's first event (or a final one) closes it. In graph mode every iteration
(warm-up included) is captured into one graph with the events as graph nodes, so replay runs them back to back
with no host work in between and ranks in other processes fall into step during the warm-up iterations, which are
dropped. The graph is replayed ``GRAPH_REPLAYS`` times and the last replay is timed: the first launch of a graph
also uploads it. An event node is not free: it ends the programmatic overlap of the kernels around it, and on
simulated ranks (one graph branch per rank) the branches' event nodes add up. On one H200 at 1 token, an event
between every iteration (``--pair-group 1``) read 14.4 us per pair with 2 simulated ranks and 30.0 with 4, where
events every 25 iterations read 9.5 and 13.8 (one replay timed). So the pair is timed in a second run whose events
enclose groups of ``--pair-group`` iterations (``GRAPH_PAIR_GROUP`` by default), each group giving one sample: its
mean iteration. Larger groups change little (docs/benchmarks.md, "Clock").
Eager mode launches the same loops from Python, an event per iteration; its split run also records the host time of
each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Optional, Sequence

import torch

PHASES = ("dispatch", "combine")
#: Iterations per timed group of a graph-mode pair run (see the module docstring).
GRAPH_PAIR_GROUP = 25
#: Replays of each captured loop; the last is timed. A graph's first launch also uploads it to the GPU: on one H200
#: the first replay read 0.5-1.4 us a pair more than the second (2 and 4 simulated ranks, 1 to 128 tokens).
GRAPH_REPLAYS = 2


@dataclasses.dataclass
class RankSteps:
    """One rank's phases: ``dispatch()`` then ``combine()``, launched on ``stream`` (None: the current stream)."""

    dispatch: Callable[[], object]
    combine: Callable[[], object]
    stream: Optional[torch.cuda.Stream] = None

    def on_stream(self):
        """Context making the rank's stream current (nothing to do without one of its own)."""
        return contextlib.nullcontext() if self.stream is None else torch.cuda.stream(self.stream)


@dataclasses.dataclass
class Timings:
    gpu_us: torch.Tensor  # [ranks here, iters, len(PHASES)] float64
    host_us: Optional[torch.Tensor]  # eager split runs: [ranks here, iters, len(PHASES)] host time of each call


def whole_groups(iterations: int, group: int) -> int:
    """``iterations`` rounded up to a multiple of ``group``."""
    return -(-iterations // group) * group


def _rank_events(total: int, group: int, per_iter: int, make: Callable[[], Any]) -> list[list]:
    """One rank's events: ``per_iter`` at the start of every ``group``-th iteration (none in between), then one
    that closes the last iteration."""
    return [[make() for _ in range(per_iter if i % group == 0 else 0)] for i in range(total)] + [[make()]]


def _launch_iteration(ranks: Sequence[RankSteps], events, host: Optional[list], i: int) -> None:
    """Iteration i; events[k][i] holds rank k's events before each timed phase (one: the whole pair; none: inside
    a group of iterations timed together). Nothing but the calls runs between the events of a rank without its own
    stream (eager mode in a process per rank)."""
    for j, phase in enumerate(PHASES):
        for k, steps in enumerate(ranks):
            with steps.on_stream():
                if j < len(events[k][i]):
                    events[k][i][j].record()
                call = getattr(steps, phase)
                if host is None:
                    call()
                else:
                    start = time.perf_counter()
                    call()
                    host[k][i][j] = time.perf_counter() - start


def _close(ranks: Sequence[RankSteps], events, total: int) -> None:
    for k, steps in enumerate(ranks):
        with steps.on_stream():
            events[k][total][0].record()


def _elapsed(events, skip: int) -> torch.Tensor:
    """``[ranks, samples, events per sample]`` us between consecutive events (the last closes the last sample),
    without the first ``skip`` samples."""
    times = []
    for per_rank in events:
        flat = [ev for iteration in per_rank for ev in iteration]
        gaps = [flat[n].elapsed_time(flat[n + 1]) * 1e3 for n in range(len(flat) - 1)]
        times.append(gaps)
    per_iter = len(events[0][0])
    result = torch.tensor(times, dtype=torch.float64).view(len(events), -1, per_iter)
    return result[:, skip:]


def time_loop(ranks: Sequence[RankSteps], iters: int, warmup: int, graph: bool,
              barrier: Callable[[], None], split: bool = True, group: int = 1) -> Timings:
    """Runs ``warmup + iters`` iterations of every rank in ``ranks`` (the ranks of this process) and returns the
    times of the last ``iters``: per phase when ``split``, else of the whole pair. ``barrier`` lines the processes
    up before the timed launches. ``group`` > 1 (whole pairs only): one sample per ``group`` iterations, their mean;
    ``warmup`` and ``iters`` are rounded up to whole groups."""
    if group < 1 or (split and group > 1):
        raise ValueError(f"group={group}: expected 1, or more for a run of whole pairs (split=False)")
    warmup, iters = whole_groups(warmup, group), whole_groups(iters, group)
    total = warmup + iters
    per_iter = len(PHASES) if split else 1
    events = [_rank_events(total, group, per_iter, lambda: torch.cuda.Event(enable_timing=True, external=graph))
              for _ in ranks]
    if graph:
        side = [torch.cuda.Stream() if steps.stream is None else steps.stream for steps in ranks]
        captured = [dataclasses.replace(steps, stream=s) for steps, s in zip(ranks, side)]
        g = torch.cuda.CUDAGraph()
        capture = torch.cuda.Stream()
        with torch.cuda.graph(g, stream=capture):
            for s in side:
                s.wait_stream(capture)
            for i in range(total):
                _launch_iteration(captured, events, None, i)
            _close(captured, events, total)
            for s in side:
                capture.wait_stream(s)
        for _ in range(GRAPH_REPLAYS):  # the events keep the last replay's times
            torch.cuda.synchronize()
            barrier()
            g.replay()
        torch.cuda.synchronize()
        result = Timings(_elapsed(events, warmup // group) / group, None)
        del g
        return result
    host = [[[0.0] * len(PHASES) for _ in range(total)] for _ in ranks] if split else None
    torch.cuda.synchronize()
    barrier()
    for i in range(total):
        _launch_iteration(ranks, events, host, i)
    _close(ranks, events, total)
    torch.cuda.synchronize()
    host_us = None if host is None else torch.tensor(host, dtype=torch.float64)[:, warmup:] * 1e6
    return Timings(_elapsed(events, warmup // group) / group, host_us)


def summarize(gpu_us: torch.Tensor, pair_us: Optional[torch.Tensor] = None) -> dict[str, dict[str, float]]:
    """Statistics of ``[ranks, iters, phases]`` times (all ranks of the run) for dispatch, combine and the pair
    (``pair_us`` ``[ranks, samples]`` when timed on its own, else the sum of the phases).

    ``median``: over every rank and sample (an iteration, or a group of them: see :func:`time_loop`). ``max_rank``:
    median over samples of the slowest rank's time. ``p99`` and ``max``: of the slowest rank's time per sample.
    ``over_2x``: samples whose slowest rank took more than twice ``max_rank``.
    """
    series = {phase: gpu_us[..., j] for j, phase in enumerate(PHASES)}
    series["pair"] = gpu_us.sum(-1) if pair_us is None else pair_us
    stats = {}
    for name, t in series.items():
        worst = t.max(0).values
        max_rank = float(worst.median())
        stats[name] = {
            "median": float(t.flatten().median()),
            "max_rank": max_rank,
            "p99": float(torch.quantile(worst, 0.99)),
            "max": float(worst.max()),
            "over_2x": int((worst > 2 * max_rank).sum()),
        }
    return stats
