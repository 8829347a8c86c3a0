"""Where a dispatch + combine step spends its time, from timestamps the kernels take of themselves.

    python docs/measurements/stage_times.py      # one GPU; builds a stamped copy of the kernels (about a minute)
    python docs/measurements/stage_times.py --ranks 2 4 --tokens 1 64 128
    torchrun --nproc-per-node 2 docs/measurements/stage_times.py --tokens 1 64 128   # a GPU per rank (NVLink)

Copies the package into a temporary directory, inserts ``%globaltimer`` stamps (thread 0 of the dispatch block that
waits for the peers, and of the one-kernel combine's first block) at the stage boundaries, builds that copy in a
cache of its own and runs ``--steps`` steps (30) of simulated ranks (or, under torchrun, of this process's rank) in
one CUDA graph, replayed 20 times, with no event between steps. Prints per simulated-rank count and token count the
step period (rank 0's dispatch start to the next, within a replay: median and mean) and the median time of each
stage. Every block also folds into the step's record the earliest start of a dispatch block and the latest end of
the stages all blocks go through (copy, arrival, the combine's wait and pull), which gives a timeline of the step
from its first dispatch block's start. Blocks start early (programmatic dependent launch) and wait for the kernel
before them, so that start lies inside the previous combine: the timeline shows where the previous step ends. A
combine too large for one kernel is not stamped. The stamps cost a few instructions (and one barrier) each; the
package itself is left untouched. What it printed at the release is in docs/benchmarks.md ("Where the time goes").
"""

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRACE_BYTES = 8192  # the stamps go to the end of each rank's workspace, unused at these token counts

HELPERS = """
__device__ __forceinline__ uint64_t* StageStamps() { __shared__ uint64_t s[32]; return s; }
#define STAMP(i) do { if (threadIdx.x == 0) StageStamps()[i] = GlobalTimerNs(); } while (0)
__device__ __forceinline__ void FlushStamps(const Ranks& r, uint32_t epoch, int first, int n) {
  if (threadIdx.x != 0) return;
  uint64_t* out = reinterpret_cast<uint64_t*>(r.Base(r.ep_rank) + r.bytes_per_rank - %d) + (epoch %% 32) * 32;
  for (int i = first; i < first + n; ++i) out[i] = StageStamps()[i];
  out[first + 15] = epoch;
  if (first == 0) {  // the next epoch's cross-block words (below), which its blocks fold their times into
    uint64_t* next = out - (epoch %% 32) * 32 + ((epoch + 1) %% 32) * 32;
    next[8] = ~0ull;
    next[9] = next[10] = next[11] = next[12] = 0;
  }
}
// Word w of this epoch's record, which every block folds a time into (the earliest, or the latest).
__device__ __forceinline__ unsigned long long* TraceWord(const Ranks& r, uint32_t epoch, int w) {
  return reinterpret_cast<unsigned long long*>(r.Base(r.ep_rank) + r.bytes_per_rank - %d) + (epoch %% 32) * 32 + w;
}
__device__ __forceinline__ void FoldTime(const Ranks& r, uint32_t epoch, int w, uint64_t t, bool earliest) {
  if (threadIdx.x != 0) return;
  const auto time = static_cast<unsigned long long>(t);
  if (earliest) {
    atomicMin(TraceWord(r, epoch, w), time);
  } else {
    atomicMax(TraceWord(r, epoch, w), time);
  }
}
#define EARLIEST(w, t) FoldTime(p.ranks, epoch, w, t, true)
#define LATEST(w) FoldTime(p.ranks, epoch, w, GlobalTimerNs(), false)
""" % (TRACE_BYTES, TRACE_BYTES)

# (header, anchor, text inserted before it, text inserted after it); every anchor must occur exactly once.
EDITS = [
    ("protocol.cuh", "}  // namespace flashinfer_a2a\n", HELPERS, ""),
    ("dispatch.cuh", "DispatchKernel(const __grid_constant__ DispatchParams p) {\n", "", "  STAMP(0);\n"),
    ("dispatch.cuh", "  __syncthreads();  // also publishes the partition's rank table\n", "", "  STAMP(1);\n"),
    ("dispatch.cuh", "    if (t < t1) mask = TokenRanks(ids, t, p.top_k, part, own ? meta : nullptr, epoch, inactive);\n", "",
     "    if (threadIdx.x == 0 && mask.words[0] == 0x7fffffffu) StageStamps()[31] = 1;  // waits for the ids\n"
     "    STAMP(2);\n"),
    ("dispatch.cuh", "  RouteChunk<IdT>(p, part, epoch, start.inactive, t0, t1, s_base, s_chunk, s_warp, s_ballot);\n", "",
     "  STAMP(3);\n  EARLIEST(8, StageStamps()[0]);\n"),
    ("dispatch.cuh", "  // Step 3: every block arrives at every rank",
     "  STAMP(4);\n  __syncthreads();\n  LATEST(9);\n", ""),
    ("dispatch.cuh", "  if (p.phase != DispatchPhase::kSend) ReceiveDispatchCounts(p, meta, epoch, p.call_layout, start.inactive);\n"
     "  __syncthreads();\n", "", "  STAMP(6);\n  FlushStamps(p.ranks, epoch, 0, 7);\n"),
    ("combine.cuh", "CombineFusedKernel(const __grid_constant__ CombineParams p) {\n", "", "  STAMP(16);\n"),
    ("combine.cuh",
     "  const int32_t first_entry = PrefetchRoute<kVec, kVecs>(p, first_item, threadIdx.x % 32);  // own record\n",
     "", "  if (threadIdx.x == 0 && epoch == 0x7fffffffu) StageStamps()[31] = 1;  // waits for the epoch\n"
     "  STAMP(17);\n"),
    ("combine.cuh", "  if (publishes) PublishCombineEpoch(p, epoch, start.inactive);\n", "", "  STAMP(18);\n"),
    ("combine.cuh", "  const bool failed = __syncthreads_or(WaitCombinePeers(p, meta, epoch, start.inactive)) != 0;\n", "",
     "  STAMP(19);\n  LATEST(12);\n"),
    ("combine.cuh", "  PullItems<T, kVec, kVecs>(p, failed, first_item, item_stride, &first_entry);\n", "",
     "  __syncthreads();\n  STAMP(20);\n  LATEST(11);\n"
     "  if (blockIdx.x == 0) FlushStamps(p.ranks, epoch, 16, 5);\n"),
]
# (header, text, replacement): where a stamp goes inside a statement (after the count that elects the waiting block,
# in every block). Every text must occur exactly once.
REPLACE = [
    ("dispatch.cuh", "  if (!CountLastBlock</*kAcqRel=*/false>(&meta->blocks_done)) return;\n",
     "  const bool last_block = CountLastBlock</*kAcqRel=*/false>(&meta->blocks_done);\n  LATEST(10);\n"
     "  if (!last_block) return;\n  STAMP(5);\n"),
]
# The timeline: (label, word), times from the earliest dispatch block's start (word 8). Words 0-6 are the waiting
# dispatch block's stamps, 16-20 the combine's first block's, 8-12 folded over every block.
TIMELINE = [("last copy", 9), ("last arrival", 10), ("peers' counts", 6),
            ("combine: peers seen", 19), ("every block's", 12), ("last pull", 11)]
DISPATCH = ["start", "table+epoch", "ids", "route", "copy", "arrive", "peers"]
COMBINE = ["start", "epoch", "publish", "peers", "pull"]


def stamped_copy(dest: pathlib.Path) -> None:
    for part in ("flashinfer_a2a", "include", "csrc"):
        # Without prebuilt libraries (_aot/), which would load in place of the stamped build.
        shutil.copytree(ROOT / part, dest / part, ignore=shutil.ignore_patterns("__pycache__", "_aot"))
    headers = dest / "include" / "flashinfer_a2a"
    # An edit is a replacement of its anchor by the anchor with the stamps around it.
    edits = [(name, anchor, before + anchor + after) for name, anchor, before, after in EDITS] + REPLACE
    for name, text, replacement in edits:
        path = headers / name
        source = path.read_text()
        if source.count(text) != 1:
            raise SystemExit(f"{name}: {text.strip()[:60]!r} occurs {source.count(text)} times; the kernels changed "
                             "since this script was written")
        path.write_text(source.replace(text, replacement))


def copy_env(copy: pathlib.Path, environ) -> dict[str, str]:
    """The environment the stamped copy runs in: its package first on the path, a build cache of its own, and no
    setting that would load a prebuilt library in place of the stamped build (it would stamp nothing) or refuse to
    build it."""
    env = dict(environ, PYTHONPATH=f"{copy}{os.pathsep}{environ.get('PYTHONPATH', '')}",
               FLASHINFER_A2A_CACHE_DIR=str(copy / "cache"))
    for name in ("FLASHINFER_A2A_AOT_DIR", "FLASHINFER_A2A_DISABLE_JIT"):
        if env.pop(name, None) is not None:
            print(f"stage_times: {name} ignored (the stamped copy is built from source)", file=sys.stderr)
    return env


def measure(sess, ranks: int, tokens: int, steps: int = 30, replays: int = 20) -> None:
    import torch

    from flashinfer_a2a.bench.args import parse_args
    from flashinfer_a2a.bench.impls import A2A, make_case

    args = parse_args(["--sim-ranks", str(ranks), "--tokens", "256", "--quant", "none", "--no-baselines"])
    own = slice(None) if sess.simulated else slice(sess.rank, sess.rank + 1)  # real ranks: read only our own row
    a2a = A2A(args, sess, torch.bfloat16)
    case = make_case(args, sess, tokens, torch.bfloat16, "uniform", 1)
    rank_steps = a2a.steps(case)
    graph, capture = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(graph, stream=capture):
        for s in rank_steps:  # simulated ranks have a stream each; a real rank runs on the capture stream
            if s.stream is not None:
                s.stream.wait_stream(capture)
        for _ in range(steps):
            for phase in ("dispatch", "combine"):
                for s in rank_steps:
                    with s.on_stream():
                        getattr(s, phase)()
        for s in rank_steps:
            if s.stream is not None:
                capture.wait_stream(s.stream)
    samples = []  # per replay: epoch -> per rank the 32 words
    for replay in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        if replay >= 2:
            words = [w.clone().view(torch.int64).view(32, 32).tolist() for w in a2a.workspace[own, -TRACE_BYTES:]]
            by_epoch = {}
            for slot in range(32):
                if len({w[slot][15] for w in words} | {w[slot][31] for w in words}) == 1:
                    by_epoch[words[0][slot][15]] = [w[slot] for w in words]
            last = max(by_epoch, default=0)  # this replay's steps only: slots of the one before span a host gap
            samples.append({e: row for e, row in by_epoch.items() if e > last - steps})
    a2a.check(case)
    lines = sess.gather(_report(samples, 1 if not sess.simulated else ranks, sess.rank))
    if sess.is_root:
        where = f"{ranks} simulated ranks" if sess.simulated else f"{sess.ep_size} GPUs"
        for rank_lines in lines:
            if rank_lines is None:  # only the one-kernel combine is stamped
                print(f"{where}, {tokens} tokens: no stamped steps (the combine ran as two kernels)")
                break
            header, stages = rank_lines
            if rank_lines is lines[0]:
                print(f"{where}, {tokens} tokens, {steps} steps a graph: {header}")
            print("\n".join(stages))
    sess.barrier()


def _report(samples: list[dict], ranks: int, first_rank: int):
    """(header, a line per rank) of the stamped steps, or None when none was stamped."""
    rows = [row for by_epoch in samples for row in by_epoch.values()]
    if not rows:
        return None
    periods = [by_epoch[e + 1][0][0] - row[0][0] for by_epoch in samples for e, row in by_epoch.items()
               if e + 1 in by_epoch]
    period, mean = statistics.median(periods) / 1e3, statistics.fmean(periods) / 1e3
    header = f"{len(rows)} stamped, period {period:.2f} us (mean {mean:.2f})"
    stages = []
    for r in range(ranks):
        def stage(a: int, b: int) -> float:
            return statistics.median(row[r][b] - row[r][a] for row in rows) / 1e3
        dispatch = " ".join(f"{DISPATCH[i]} {stage(i - 1, i):.2f}" for i in range(1, len(DISPATCH)))
        combine = " ".join(f"{COMBINE[i]} {stage(15 + i, 16 + i):.2f}" for i in range(1, len(COMBINE)))
        stages.append(f"  rank {first_rank + r} us | period {period:.2f} | dispatch: {dispatch} | "
                      f"to combine {stage(6, 16):.2f} | combine: {combine}")
        marks = " ".join(f"{label} {stage(8, w):.2f}" for label, w in TIMELINE)
        stages.append(f"    from the first dispatch block's start: route {stage(8, 3):.2f} {marks} | next step's "
                      f"first block {period:.2f}")
    return header, stages


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4], help="simulated rank counts")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1], help="tokens per rank (at most 256)")
    parser.add_argument("--steps", type=int, default=30, help="steps captured in the graph (>= 2)")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)  # inside the stamped copy
    args = parser.parse_args(argv)
    if not all(1 <= t <= 256 for t in args.tokens):
        parser.error(f"--tokens must lie in 1..256, got {args.tokens}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    return args


if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    if args.run:
        import flashinfer_a2a

        if not pathlib.Path(flashinfer_a2a.__file__).resolve().is_relative_to(pathlib.Path.cwd().resolve()):
            raise SystemExit(f"imported {flashinfer_a2a.__file__}, not the stamped copy in {pathlib.Path.cwd()}")
        from flashinfer_a2a.bench import session

        if session.launched_world_size() > 1:  # a GPU per rank: one session, this process's rank
            sess = session.start(1)
            for tokens in args.tokens:
                measure(sess, sess.ep_size, tokens, args.steps)
            sess.close()
            sys.exit(0)
        for ranks in args.ranks:
            sess = session.start(ranks)
            for tokens in args.tokens:
                measure(sess, ranks, tokens, args.steps)
            sess.close()
        sys.exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp)
        stamped_copy(copy)
        env = copy_env(copy, os.environ)
        sys.exit(subprocess.call([sys.executable, str(pathlib.Path(__file__).resolve()), "--run", *sys.argv[1:]],
                                 cwd=tmp, env=env))
