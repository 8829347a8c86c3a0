"""Per-iteration GPU times of a dispatch/combine loop, under CUDA-graph replay or eager launches.

Each iteration of each rank records events on the rank's stream: before dispatch, between dispatch and combine
(``split``), and the next iteration's first event (or a final one) closes it. In graph mode every iteration
(warm-up included) is captured into one graph with the events as graph nodes, so replay runs them back to back
with no host work in between and ranks in other processes fall into step during the warm-up iterations, which are
dropped. An event node costs about 1.5 us of GPU time on H200, so the pair is timed in a second run with only the
iteration-boundary events. Eager mode launches the same loops from Python; its split run also records the host
time of each call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Optional, Sequence

import torch

PHASES = ("dispatch", "combine")


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


def _launch_iteration(ranks: Sequence[RankSteps], events, host: Optional[list], i: int) -> None:
    """Iteration i; events[k][i] holds rank k's events before each timed phase (one: the whole pair). Nothing but
    the calls runs between the events of a rank without its own stream (eager mode in a process per rank)."""
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
    """``[ranks, iters, events per iteration]`` us between consecutive events (the last closes the last iteration)."""
    times = []
    for per_rank in events:
        flat = [ev for iteration in per_rank for ev in iteration]
        gaps = [flat[n].elapsed_time(flat[n + 1]) * 1e3 for n in range(len(flat) - 1)]
        times.append(gaps)
    per_iter = len(events[0][0])
    result = torch.tensor(times, dtype=torch.float64).view(len(events), -1, per_iter)
    return result[:, skip:]


def time_loop(ranks: Sequence[RankSteps], iters: int, warmup: int, graph: bool,
              barrier: Callable[[], None], split: bool = True) -> Timings:
    """Runs ``warmup + iters`` iterations of every rank in ``ranks`` (the ranks of this process) and returns the
    times of the last ``iters``: per phase when ``split``, else of the whole pair. ``barrier`` lines the processes
    up before the timed launches."""
    total = warmup + iters
    per_iter = len(PHASES) if split else 1
    events = [[[torch.cuda.Event(enable_timing=True, external=graph) for _ in range(per_iter)]
               for _ in range(total)] + [[torch.cuda.Event(enable_timing=True, external=graph)]] for _ in ranks]
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
        torch.cuda.synchronize()
        barrier()
        g.replay()
        torch.cuda.synchronize()
        result = Timings(_elapsed(events, warmup), None)
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
    return Timings(_elapsed(events, warmup), host_us)


def summarize(gpu_us: torch.Tensor, pair_us: Optional[torch.Tensor] = None) -> dict[str, dict[str, float]]:
    """Statistics of ``[ranks, iters, phases]`` times (all ranks of the run) for dispatch, combine and the pair
    (``pair_us`` ``[ranks, iters]`` when timed on its own, else the sum of the phases).

    ``median``: over every rank and iteration. ``max_rank``: median over iterations of the slowest rank's time.
    ``p99`` and ``max``: of the slowest rank's time per iteration. ``over_2x``: iterations whose slowest rank took
    more than twice ``max_rank``.
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
