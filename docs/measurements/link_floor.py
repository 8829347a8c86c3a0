"""The floor under a dispatch + combine step on this host's links, measured without this package (cupy, one process
driving every visible GPU, peer access on, every GPU busy at once as in a step):

- **peer stores**: each GPU stores a buffer into each of 1, 2, ... P - 1 peers at once with 16-byte SM stores (what a
  dispatch does); bytes leaving each GPU per microsecond;
- **peer loads**: each GPU loads a buffer from each of 1 ... P - 1 peers at once and writes one local sum (what the
  pulled combine does); bytes entering each GPU per microsecond;
- **the same stores by other engines** (Hopper on), at the largest size: TMA bulk copies through shared memory and
  the copy engine (``cudaMemcpyPeerAsync``), to tell the links' rate from the SM stores';
- **what the bytes add**: the same store and load kernels, a CUDA graph of them back to back on every GPU at once,
  at a step's remote bytes per peer and at none: the difference per kernel is the time those bytes add to a kernel
  that moves them, free of launch gaps (what a step's rows add to its fixed cost);
- **one-way flag latency**: half the round trip of a flag stored with ``st.release.sys`` into a peer's memory and
  seen by a spinning ``ld.acquire.sys``, GPU 0 with each other GPU;
- **handshake kernel**: a kernel of one block that signals every peer and waits for every peer's signal, captured
  back to back in a CUDA graph on every GPU: microseconds per kernel, the fixed cost of one phase (a dispatch or a
  combine waits for its peers once).

    python docs/measurements/link_floor.py --json floor.json          # needs 2+ GPUs with peer access, and cupy
    torchrun --nproc-per-node 2 -m flashinfer_a2a.bench --floor floor.json

The bench's ``--floor`` reads the JSON and prints each row of this package as a multiple of its floor: two
handshake kernels plus the remote bytes of dispatch at the store rate and of combine at the load rate to the step's
number of peers, the best rate measured over the buffer sizes (``flashinfer_a2a.bench.floor``). The sizes default to
a DeepSeek-V3 step's remote bytes per peer at 128, 1024 and 8192 tokens per rank on 2 GPUs: a short transfer, timed
alone, runs below the link's rate (its launch and first round trip are in its time).
"""

import argparse
import json
import os
import re
import sys

import cupy as cp
import numpy as np

KERNELS = r"""
extern "C" __global__ void store_to_peers(const int4* __restrict__ src, const unsigned long long* dsts, int peers,
                                          long n) {
  const long stride = (long)gridDim.x * blockDim.x;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += stride) {
    const int4 v = src[i];
    for (int d = 0; d < peers; ++d) reinterpret_cast<int4*>(dsts[d])[i] = v;
  }
}

extern "C" __global__ void load_from_peers(const unsigned long long* srcs, int peers, int4* __restrict__ dst,
                                           long n) {
  const long stride = (long)gridDim.x * blockDim.x;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += stride) {
    int4 acc = make_int4(0, 0, 0, 0);
    for (int d = 0; d < peers; ++d) {
      const int4 v = reinterpret_cast<const int4*>(srcs[d])[i];
      acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
    }
    dst[i] = acc;
  }
}

// The same stores by the Tensor Memory Accelerator (Hopper on): one thread a block moves chunks of `chunk` bytes
// (a multiple of 16) from global memory into one of kTmaStages shared buffers (cp.async.bulk, completion on an
// mbarrier) and from there to every peer (cp.async.bulk into global memory, a bulk group per chunk). A buffer is
// refilled once the stores that read it have read it, so kTmaStages - 1 loads stay in flight behind the stores.
#define kTmaStages 4
__device__ __forceinline__ unsigned shared_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
extern "C" __global__ void tma_store_to_peers(const char* __restrict__ src, const unsigned long long* dsts,
                                              int peers, long chunks, int chunk) {
#if __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) char buffers[];
  __shared__ __align__(8) unsigned long long full[kTmaStages];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < kTmaStages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(shared_u32(&full[s])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  long mine = 0;  // chunks of this block: blockIdx.x, + gridDim.x, ...
  if (blockIdx.x < chunks) mine = (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x;
  auto load = [&](long i) {
    const int s = i % kTmaStages;
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(shared_u32(&full[s])), "r"(chunk)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(shared_u32(buffers + s * chunk)), "l"(src + (blockIdx.x + i * gridDim.x) * chunk),
                    "r"(chunk), "r"(shared_u32(&full[s])) : "memory");
  };
  for (long i = 0; i < kTmaStages && i < mine; ++i) load(i);
  for (long i = 0; i < mine; ++i) {
    const int s = i % kTmaStages;
    unsigned ready = 0;
    while (!ready) {
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(ready) : "r"(shared_u32(&full[s])), "r"((unsigned)(i / kTmaStages) & 1) : "memory");
    }
    const long offset = (blockIdx.x + i * gridDim.x) * chunk;
    for (int d = 0; d < peers; ++d) {
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(reinterpret_cast<char*>(dsts[d]) + offset), "r"(shared_u32(buffers + s * chunk)),
                      "r"(chunk) : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (i >= 1 && i - 1 + kTmaStages < mine) {  // chunk i - 1's buffer, once its stores have read it
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      load(i - 1 + kTmaStages);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

__device__ __forceinline__ void store_release(unsigned int* p, unsigned int v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned int load_acquire(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Flag ping-pong: the GPU that starts stores i into the peer's flag, then waits for the peer's answer i.
extern "C" __global__ void ping_pong(unsigned int* mine, unsigned int* peer, unsigned int base, int iters,
                                     int starts) {
  for (unsigned int i = base + 1; i <= base + iters; ++i) {
    if (starts) store_release(peer, i);
    while ((int)(load_acquire(mine) - i) < 0) {}
    if (!starts) store_release(peer, i);
  }
}

// One phase's handshake: thread r signals rank r (its slot `me` of rank r's flags) with this kernel's epoch, then
// waits for rank r's signal. The epoch advances in device memory, so graph replays stay in step.
extern "C" __global__ void handshake(const unsigned long long* flags, int me, int ranks, unsigned int* epoch) {
  const unsigned int e = *reinterpret_cast<volatile unsigned int*>(epoch) + 1;
  const int r = threadIdx.x;
  if (r < ranks) {
    store_release(reinterpret_cast<unsigned int*>(flags[r]) + me, e);
    const unsigned int* from = reinterpret_cast<const unsigned int*>(flags[me]) + r;
    while ((int)(load_acquire(from) - e) < 0) {}
  }
  __syncthreads();
  if (threadIdx.x == 0) *epoch = e;
}
"""

# Remote bytes per peer of a DeepSeek-V3 step (hidden 7168 bf16 + int32 ids + fp32 weights, top-8 of 256) at 128,
# 1024 and 8192 tokens per rank on 2 GPUs, rounded to 16 bytes.
DEFAULT_SIZES = (1_843_200, 14_745_600, 117_964_800)
# The sizes whose added time is measured: a DeepSeek-V3 step's remote bytes per peer at 16, 64, 128 and 256 tokens
# per rank on 2 GPUs.
ADDED_SIZES = (230_400, 921_600, 1_843_200, 3_686_400)
# The TMA store path: chunks of one DeepSeek-V3 row (7168 bf16), TMA_STAGES shared buffers of them a block (the
# kernel's kTmaStages), TMA_BLOCKS_PER_SM blocks of one thread's work a multiprocessor.
TMA_CHUNK, TMA_BLOCKS_PER_SM = 14_336, 2
TMA_STAGES = int(re.search(r"#define kTmaStages (\d+)", KERNELS)[1])
# What torchrun, Open MPI and PMI launchers set to the number of ranks.
LAUNCHER_SIZES = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _ptrs(arrays) -> cp.ndarray:
    return cp.asarray(np.array([a.data.ptr for a in arrays], dtype=np.uint64))


class Gpus:
    def __init__(self, max_bytes: int) -> None:
        self.count = cp.cuda.runtime.getDeviceCount()
        if self.count < 2:
            raise SystemExit(f"link_floor.py needs 2 or more GPUs with peer access; {self.count} visible")
        self.dev = []
        for d in range(self.count):
            with cp.cuda.Device(d):
                for peer in range(self.count):
                    if peer != d:
                        if not cp.cuda.runtime.deviceCanAccessPeer(d, peer):
                            raise SystemExit(f"GPU {d} cannot access GPU {peer}: no peer path")
                        cp.cuda.runtime.deviceEnablePeerAccess(peer)
                n = max_bytes // 16 * 16
                self.dev.append({
                    "src": cp.ones(n, dtype=cp.uint8), "dst": cp.zeros(n, dtype=cp.uint8),
                    "inbox": [cp.zeros(n, dtype=cp.uint8) for _ in range(self.count - 1)],
                    "flags": cp.zeros(64, dtype=cp.uint32), "epoch": cp.zeros(1, dtype=cp.uint32),
                    "module": cp.RawModule(code=KERNELS, options=("-std=c++17",)),
                    "stream": cp.cuda.Stream(non_blocking=True),
                    "sms": cp.cuda.runtime.getDeviceProperties(d)["multiProcessorCount"],
                    "name": cp.cuda.runtime.getDeviceProperties(d)["name"].decode(),
                })
        self.ping_base = 0
        self.hopper = cp.cuda.runtime.getDeviceProperties(0)["major"] >= 9  # TMA

    def sync(self) -> None:
        for d in range(self.count):
            cp.cuda.Device(d).synchronize()

    def _timed(self, launch, reps: int, devices) -> list[float]:
        """Microseconds per repetition of launch(d, stream) on each device, all devices at once."""
        events = {}
        self.sync()
        for d in devices:
            with cp.cuda.Device(d):
                stream = self.dev[d]["stream"]
                launch(d, stream)  # warm-up
                events[d] = (cp.cuda.Event(), cp.cuda.Event())
                events[d][0].record(stream)
                for _ in range(reps):
                    launch(d, stream)
                events[d][1].record(stream)
        times = []
        for d in devices:
            with cp.cuda.Device(d):
                events[d][1].synchronize()
                times.append(cp.cuda.get_elapsed_time(*events[d]) * 1e3 / reps)
        return times

    def peers_of(self, d: int, peers: int) -> list:
        """The `peers` GPUs after GPU d (wrapping), which d stores to or loads from."""
        return [(d + k) % self.count for k in range(1, peers + 1)]

    def store_targets(self, d: int, peers: int) -> list:
        """(peer, buffer) for each of peers_of(d, peers): slot (d - peer - 1) of the peer's inbox, so that no two GPUs
        share a buffer."""
        return [(o, self.dev[o]["inbox"][(d - o - 1) % self.count]) for o in self.peers_of(d, peers)]

    def _copy_launch(self, kind: str, peers: int, nbytes: int, blocks_per_sm: int):
        """launch(d, stream) of one `kind` kernel ("store" or "load") moving nbytes to/from each of `peers` peers."""
        n = np.int64(nbytes // 16)
        args = {}  # d: (kernel, its arguments), looked up once rather than at every launch
        for d in range(self.count):
            with cp.cuda.Device(d):
                module = self.dev[d]["module"]
                if kind == "store":
                    targets = [t for _, t in self.store_targets(d, peers)]
                    args[d] = (module.get_function("store_to_peers"),
                               (self.dev[d]["src"], _ptrs(targets), np.int32(peers), n))
                else:
                    sources = [self.dev[o]["src"] for o in self.peers_of(d, peers)]
                    args[d] = (module.get_function("load_from_peers"),
                               (_ptrs(sources), np.int32(peers), self.dev[d]["dst"], n))

        def launch(d, stream):
            kernel, a = args[d]
            kernel((self.dev[d]["sms"] * blocks_per_sm,), (512,), a, stream=stream)

        return launch

    def copy_rate(self, kind: str, peers: int, nbytes: int, blocks_per_sm: int = 2, reps: int = 10) -> float:
        """Bytes per microsecond per GPU (the slowest GPU's) of `kind` ("store" or "load") to/from `peers` peers."""
        us = max(self._timed(self._copy_launch(kind, peers, nbytes, blocks_per_sm), reps, range(self.count)))
        return peers * nbytes / us

    def graph_us(self, launch, devices, kernels: int, replays: int) -> float:
        """Microseconds per launch(d, stream) (the slowest device's), `kernels` of them back to back in a CUDA graph
        on each of `devices` at once: no launch gap between them."""
        graphs = {}
        self.sync()
        for d in devices:
            with cp.cuda.Device(d):
                stream = self.dev[d]["stream"]
                stream.begin_capture()
                for _ in range(kernels):
                    launch(d, stream)
                graphs[d] = stream.end_capture()
        return max(self._timed(lambda d, stream: graphs[d].launch(stream), replays, devices)) / kernels

    def added_us(self, kind: str, peers: int, sizes, blocks_per_sm: int = 2, kernels: int = 40,
                 replays: int = 5) -> dict:
        """{nbytes: microseconds that nbytes per peer add to one `kind` kernel}: graph_us at nbytes minus graph_us of
        the same kernel moving nothing, every GPU at once."""
        def us(nbytes):
            launch = self._copy_launch(kind, peers, nbytes, blocks_per_sm)
            return self.graph_us(launch, range(self.count), kernels, replays)

        empty = us(0)
        return {n: us(n) - empty for n in sizes}

    def engine_rate(self, engine: str, peers: int, nbytes: int, reps: int = 5) -> float:
        """Bytes per microsecond leaving each GPU (the slowest GPU's) for `peers` peers, the same buffers as the
        stores of copy_rate moved by `engine`: "tma" (TMA_BLOCKS_PER_SM blocks a multiprocessor, TMA_CHUNK-byte
        chunks) or "copy_engine" (cudaMemcpyPeerAsync, each peer's copy on a stream of its own, all joined to the
        GPU's stream)."""
        chunks = np.int64(nbytes // TMA_CHUNK)
        targets = {}
        for d in range(self.count):
            targets[d] = self.store_targets(d, peers)
            with cp.cuda.Device(d):
                if engine == "tma":
                    kernel = self.dev[d]["module"].get_function("tma_store_to_peers")
                    kernel.max_dynamic_shared_size_bytes = TMA_STAGES * TMA_CHUNK
                    self.dev[d]["tma_kernel"] = kernel
                    self.dev[d]["tma_args"] = (self.dev[d]["src"], _ptrs([t for _, t in targets[d]]),
                                               np.int32(peers), chunks, np.int32(TMA_CHUNK))
                else:
                    self.dev[d]["peer_streams"] = [cp.cuda.Stream(non_blocking=True) for _ in range(peers)]

        def launch(d, stream):
            if engine == "tma":
                self.dev[d]["tma_kernel"]((self.dev[d]["sms"] * TMA_BLOCKS_PER_SM,), (32,), self.dev[d]["tma_args"],
                                          stream=stream, shared_mem=TMA_STAGES * TMA_CHUNK)
            else:
                start = stream.record()
                for (o, target), side in zip(targets[d], self.dev[d]["peer_streams"]):
                    side.wait_event(start)
                    cp.cuda.runtime.memcpyPeerAsync(target.data.ptr, o, self.dev[d]["src"].data.ptr, d,
                                                    int(chunks) * TMA_CHUNK, side.ptr)
                    stream.wait_event(side.record())

        moved = int(chunks) * TMA_CHUNK
        for d in range(self.count):  # the peers' buffers cleared, so that the check below sees this engine's bytes
            for o, target in targets[d]:
                with cp.cuda.Device(o):
                    target[:moved].fill(0)
        us = max(self._timed(launch, reps, range(self.count)))
        for d in range(self.count):
            for o, target in targets[d]:
                with cp.cuda.Device(o):
                    if int(cp.count_nonzero(target[:moved] != 1)):
                        raise SystemExit(f"{engine}: GPU {d}'s bytes did not all land in GPU {o}")
        return peers * moved / us

    def one_way_us(self, peer: int, iters: int = 2000) -> float:
        """Half the round trip of a release store seen by an acquire spin, GPU 0 <-> `peer`."""
        pair = (0, peer)
        self.sync()
        events = []
        for i, d in enumerate(pair):
            other = pair[1 - i]
            with cp.cuda.Device(d):
                stream = self.dev[d]["stream"]
                kernel = self.dev[d]["module"].get_function("ping_pong")
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(stream)
                kernel((1,), (1,), (self.dev[d]["flags"], self.dev[other]["flags"],
                                    np.uint32(self.ping_base), np.int32(iters), np.int32(i == 0)), stream=stream)
                end.record(stream)
                events.append((start, end))
        self.ping_base += iters
        with cp.cuda.Device(0):
            events[0][1].synchronize()
            us = cp.cuda.get_elapsed_time(*events[0]) * 1e3
        self.sync()
        return us / iters / 2

    def handshake_us(self, ranks: int, kernels: int = 200, replays: int = 5) -> float:
        """Microseconds per handshake kernel among GPUs 0 .. ranks - 1, kernels back to back in a CUDA graph."""
        self.sync()
        handshake = {}
        for d in range(ranks):
            with cp.cuda.Device(d):
                self.dev[d]["flags"][:] = 0
                self.dev[d]["epoch"][:] = 0
                self.dev[d]["table"] = _ptrs([self.dev[r]["flags"][8:] for r in range(ranks)])
                handshake[d] = self.dev[d]["module"].get_function("handshake")

        def launch(d, stream):
            handshake[d]((1,), (32,), (self.dev[d]["table"], np.int32(d), np.int32(ranks), self.dev[d]["epoch"]),
                         stream=stream)

        return self.graph_us(launch, range(ranks), kernels, replays)


def measure(sizes, blocks_per_sm: int, added_sizes=ADDED_SIZES) -> dict:
    gpus = Gpus(max(*sizes, *added_sizes))
    result = {"gpu": gpus.dev[0]["name"], "gpus": gpus.count, "blocks_per_sm": blocks_per_sm,
              "store": {}, "load": {}, "added_us": {"store": {}, "load": {}}, "store_engines": {}, "one_way_us": {},
              "handshake_us": {}}
    for peers in range(1, gpus.count):
        for kind in ("store", "load"):
            result[kind][str(peers)] = {str(n): gpus.copy_rate(kind, peers, n, blocks_per_sm) for n in sizes}
            added = gpus.added_us(kind, peers, added_sizes, blocks_per_sm)
            result["added_us"][kind][str(peers)] = {str(n): us for n, us in added.items()}
        if gpus.hopper:  # the largest size by the other engines: what the links carry whatever moves the bytes
            largest = max(sizes)
            result["store_engines"][str(peers)] = {
                "bytes": largest, "sm": result["store"][str(peers)][str(largest)],
                "tma": gpus.engine_rate("tma", peers, largest),
                "copy_engine": gpus.engine_rate("copy_engine", peers, largest)}
        result["one_way_us"][str(peers)] = gpus.one_way_us(peers)
        result["handshake_us"][str(peers + 1)] = gpus.handshake_us(peers + 1)
    return result


def describe(r: dict) -> str:
    lines = [f"{r['gpus']}x {r['gpu']}, {r['blocks_per_sm']} blocks of 512 threads per multiprocessor"]
    for kind, what in (("store", "peer stores, bytes/us leaving each GPU"),
                       ("load", "peer loads, bytes/us entering each GPU")):
        for peers, rates in r[kind].items():
            text = ", ".join(f"{int(n) / 1e6:.2f} MB/peer {rate:.0f}" for n, rate in rates.items())
            lines.append(f"{what} to {peers} peer(s) at once: {text}")
    for kind, added in r.get("added_us", {}).items():
        for peers, times in added.items():
            text = ", ".join(f"{int(n) / 1e6:.2f} MB/peer +{us:.2f} us ({int(peers) * int(n) / us / 1e3:.0f} GB/s)"
                             for n, us in times.items())
            lines.append(f"what the bytes add to a {kind} kernel ({peers} peer(s), kernels back to back in a graph, "
                         f"against moving nothing): {text}")
    for peers, e in r.get("store_engines", {}).items():
        lines.append(f"stores to {peers} peer(s) at once, {int(e['bytes']) / 1e6:.2f} MB/peer, bytes/us leaving each "
                     f"GPU by engine: SM stores {e['sm']:.0f}, TMA bulk copies {e['tma']:.0f}, copy engine "
                     f"{e['copy_engine']:.0f}")
    lines.append("one-way flag latency GPU 0 -> GPU k: "
                 + ", ".join(f"k={k} {us:.2f} us" for k, us in r["one_way_us"].items()))
    lines.append("handshake kernel (signal + wait every peer), back to back in a graph: "
                 + ", ".join(f"{n} GPUs {us:.2f} us" for n, us in r["handshake_us"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="bytes per peer")
    parser.add_argument("--added-sizes", type=int, nargs="+", default=list(ADDED_SIZES),
                        help="bytes per peer whose added time is measured")
    parser.add_argument("--blocks-per-sm", type=int, default=2, help="blocks of 512 threads per multiprocessor")
    parser.add_argument("--json", help="write the figures here (the bench's --floor reads it)")
    args = parser.parse_args(argv)
    launched = [name for name in LAUNCHER_SIZES if int(os.environ.get(name, "1")) > 1]
    if launched:
        print(f"link_floor.py drives every visible GPU from one process; it was launched as one of several ranks "
              f"({launched[0]}={os.environ[launched[0]]}), whose copies would measure each other's traffic: run "
              f"it with python, not torchrun or mpirun", file=sys.stderr)
        return 2
    result = measure(args.sizes, args.blocks_per_sm, args.added_sizes)
    print(describe(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
