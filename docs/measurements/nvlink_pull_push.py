"""The NVLink ceiling of each combine design, measured without this package: two GPUs of one host move 117.5 MB
(the remote bytes of a DeepSeek-V3 combine at 8192 tokens/rank) to each other at once, with 16-byte SM accesses:

- push: local loads, stores into the peer's memory (what dispatch does);
- pull: loads from the peer's memory, local stores (what combine does);
- pull+add: the pull plus a local row added in fp32, written as bf16 (the shape of combine's work).

    python docs/measurements/nvlink_pull_push.py     # needs 2 GPUs with peer access, and cupy

Prints, per design, the time on each GPU with 1, 2 and 4 blocks of 512 threads per multiprocessor. What it printed
at the release is in docs/benchmarks.md ("Where the time goes").
"""

import cupy as cp
import numpy as np

KERNELS = r"""
#include <cuda_bf16.h>
extern "C" __global__ void copy(const int4* src, int4* dst, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) dst[i] = src[i];
}
extern "C" __global__ void add(const int4* a, const int4* b, int4* dst, long n) {
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    int4 x = a[i], y = b[i], z;
    const __nv_bfloat16* px = reinterpret_cast<const __nv_bfloat16*>(&x);
    const __nv_bfloat16* py = reinterpret_cast<const __nv_bfloat16*>(&y);
    __nv_bfloat16* pz = reinterpret_cast<__nv_bfloat16*>(&z);
    for (int e = 0; e < 8; ++e) pz[e] = __float2bfloat16_rn(__bfloat162float(px[e]) + __bfloat162float(py[e]));
    dst[i] = z;
  }
}
"""
NBYTES = 117_504_000
REPS = 20


def ptr(array) -> np.uint64:
    return np.uint64(array.data.ptr)


def setup():
    gpus = []
    for dev in (0, 1):
        with cp.cuda.Device(dev):
            cp.cuda.runtime.deviceEnablePeerAccess(1 - dev)
            gpus.append({
                "bufs": {name: cp.zeros(NBYTES, dtype=cp.uint8) for name in ("a", "b", "out")},
                "module": cp.RawModule(code=KERNELS, options=("-std=c++17",)),
                "stream": cp.cuda.Stream(non_blocking=True),
                "sms": cp.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"],
            })
    return gpus


def measure(gpus, kind: str, blocks_per_sm: int) -> list[float]:
    n = np.int64(NBYTES // 16)
    launches = []
    for dev, gpu in enumerate(gpus):
        me, peer = gpu["bufs"], gpus[1 - dev]["bufs"]
        if kind == "push":
            name, args = "copy", (ptr(me["a"]), ptr(peer["b"]), n)
        elif kind == "pull":
            name, args = "copy", (ptr(peer["a"]), ptr(me["out"]), n)
        else:
            name, args = "add", (ptr(peer["a"]), ptr(me["b"]), ptr(me["out"]), n)
        with cp.cuda.Device(dev):  # events belong to the device they are created on
            launches.append((dev, gpu, gpu["module"].get_function(name), args, cp.cuda.Event(), cp.cuda.Event()))
    for dev in (0, 1):
        cp.cuda.Device(dev).synchronize()
    for dev, gpu, kernel, args, start, end in launches:  # both GPUs run at once
        with cp.cuda.Device(dev):
            grid, stream = (gpu["sms"] * blocks_per_sm,), gpu["stream"]
            kernel(grid, (512,), args, stream=stream)  # warm-up
            start.record(stream)
            for _ in range(REPS):
                kernel(grid, (512,), args, stream=stream)
            end.record(stream)
    times = []
    for dev, gpu, kernel, args, start, end in launches:
        with cp.cuda.Device(dev):
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / REPS)
    return times


def main():
    gpus = setup()
    for kind in ("push", "pull", "pull+add"):
        for blocks_per_sm in (1, 2, 4):
            times = measure(gpus, kind, blocks_per_sm)
            text = ", ".join(f"gpu{d} {us:.1f} us {NBYTES / us / 1e3:.0f} GB/s" for d, us in enumerate(times))
            print(f"{kind:9s} {blocks_per_sm} blocks/SM: {text}")


if __name__ == "__main__":
    main()
