"""Do simulated ranks need a CUDA work queue each? One child process per setting of CUDA_DEVICE_MAX_CONNECTIONS
(CUDA reads it once, at initialization) runs ``ep_size`` ranks on their own streams, eagerly or captured in one CUDA
graph, with a short timeout, and prints one JSON line: which ranks recorded an error, and whether every received
count and combined row equals the reference.

The ranks are launched by hand, each on a stream of its own, as SimulatedRanks does.
``python -m tests.gpu.connections_probe`` prints the whole table (about 4 minutes on one H100). On one H100
(2026-11-25) every row ran without error with a single queue, 2 and 4 ranks, eager and in a graph, and with 8 ranks
in a graph on 4 queues: sharing a queue does not serialize the ranks' kernels (docs/semantics.md, "Simulated ranks").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import flashinfer_a2a as fa
from flashinfer_a2a import reference as ref
from flashinfer_a2a.functional import empty_workspace
from flashinfer_a2a.library.errors import A2AError

HIDDEN, TOP_K, TOKENS = 1024, 4, 64
DEVICE = "cuda"


def _inputs(ep_size: int, gen: torch.Generator):
    num_experts = 4 * ep_size
    ids = [torch.randint(0, num_experts, (TOKENS, TOP_K), generator=gen) for _ in range(ep_size)]
    xs = [torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(ep_size)]
    partials = [torch.randn(ep_size, TOKENS, HIDDEN, generator=gen).to(torch.bfloat16) for _ in range(ep_size)]
    return num_experts, ids, xs, partials


def child(ep_size: int, mode: str, replays: int, timeout_s: float, seed: int) -> dict:
    """Runs dispatch + combine of every rank (eager: ``replays`` times; graph: captured once, replayed)."""
    config = fa.WorkspaceConfig(ep_size=ep_size, max_num_tokens=TOKENS, top_k=TOP_K,
                                dispatch_bytes_per_token=HIDDEN * 2, combine_bytes_per_token=HIDDEN * 2)
    workspace = empty_workspace(ep_size, config.bytes_per_rank, DEVICE)
    for rank in range(ep_size):
        fa.initialize(workspace, rank, config)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in range(ep_size)]
    static_ids = [torch.zeros(TOKENS, TOP_K, dtype=torch.int64, device=DEVICE) for _ in range(ep_size)]
    static_x = [torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16, device=DEVICE) for _ in range(ep_size)]
    static_p = [torch.zeros(ep_size, TOKENS, HIDDEN, dtype=torch.bfloat16, device=DEVICE) for _ in range(ep_size)]
    num_experts = 4 * ep_size

    def step():
        current = torch.cuda.current_stream()
        counts, outs = [], []
        for rank in range(ep_size):  # every rank's dispatch first: a rank's combine waits for all dispatches
            streams[rank].wait_stream(current)
            with torch.cuda.stream(streams[rank]):
                _, c = fa.dispatch(workspace, rank, config, static_ids[rank], [static_x[rank]], TOKENS, num_experts,
                                   timeout_s=timeout_s)
                counts.append(c)
        for rank in range(ep_size):
            with torch.cuda.stream(streams[rank]):
                outs.append(fa.combine(workspace, rank, config, counts[rank], TOKENS, TOKENS, static_p[rank],
                                       timeout_s=timeout_s))
        for rank in range(ep_size):
            current.wait_stream(streams[rank])
        return counts, outs

    graph = None
    if mode == "graph":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_counts, static_outs = step()
    gen = torch.Generator().manual_seed(seed)
    result = {"ep_size": ep_size, "mode": mode, "connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
              "errors": [], "wrong": [], "first_bad_call": None}
    start = time.monotonic()
    for call in range(replays):
        _, ids, xs, partials = _inputs(ep_size, gen)
        for rank in range(ep_size):
            static_ids[rank].copy_(ids[rank])
            static_x[rank].copy_(xs[rank])
            static_p[rank].copy_(partials[rank])
        if graph is not None:
            for out in static_outs:
                out.fill_(float("nan"))
            graph.replay()
            counts, outs = static_counts, static_outs
        else:
            counts, outs = step()
        torch.cuda.synchronize()
        want = ref.reference_dispatch(ids, [[x] for x in xs], num_experts, TOKENS)
        combined = ref.reference_combine(partials, want)
        for rank in range(ep_size):
            try:
                fa.check_error(workspace, rank)
            except A2AError as e:
                result["errors"].append(f"call {call} rank {rank}: {str(e).splitlines()[0][:160]}")
            if not (torch.equal(counts[rank].cpu(), want.recv_counts[rank])
                    and ref.bitwise_equal(outs[rank].cpu(), combined[rank])):
                result["wrong"].append(f"call {call} rank {rank}")
        if (result["errors"] or result["wrong"]) and result["first_bad_call"] is None:
            result["first_bad_call"] = call
            break  # the epochs are out of step from here on: later calls say nothing new
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def run_child(connections: int | None, ep_size: int, mode: str, replays: int = 5, timeout_s: float = 0.5,
              seed: int = 0) -> dict:
    """One fresh process with CUDA_DEVICE_MAX_CONNECTIONS=connections (None: unset); its JSON result."""
    env = dict(os.environ)
    env.pop("CUDA_DEVICE_MAX_CONNECTIONS", None)
    if connections is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(connections)
    cmd = [sys.executable, "-m", "tests.gpu.connections_probe", "--child", str(ep_size), mode, str(replays),
           str(timeout_s), str(seed)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"ep_size": ep_size, "mode": mode, "connections": connections, "crashed": proc.returncode,
                "stderr": proc.stderr[-2000:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        ep_size, mode, replays, timeout_s, seed = args.child[:5]
        print(json.dumps(child(int(ep_size), mode, int(replays), float(timeout_s), int(seed))), flush=True)
        return
    # One queue (the hypothesis: every call times out) and a queue per rank (every call right), 2 and 4 ranks, eager
    # and in one graph; 8 ranks in one graph with too few, just enough and plenty of queues; then CUDA's default
    # (8 queues for 9 streams) in fresh processes, where the rare first-replay timeouts were seen.
    table = [(c, ep, mode, 0) for c in (1, 32) for ep in (2, 4) for mode in ("eager", "graph")]
    table += [(c, 8, "graph", 0) for c in (4, 9, 32)]
    table += [(None, 8, "graph", seed) for seed in range(6)]
    for connections, ep_size, mode, seed in table:
        print(json.dumps(run_child(connections, ep_size, mode, seed=seed)), flush=True)


if __name__ == "__main__":
    main()
