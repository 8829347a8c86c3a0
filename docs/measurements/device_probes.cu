// Device probes for what docs/semantics.md states about the GPU's timer ("Timeouts and errors") and about the first
// launches of a graph of simulated ranks ("Simulated ranks").
//
//   nvcc -arch=sm_90a -O3 -std=c++17 -o device_probes docs/measurements/device_probes.cu
//   ./device_probes timer 200   # one thread watches %globaltimer against clock64 for 200 s: steps back, gaps > 1 ms
//   ./device_probes spread 8    # first launches of a graph of 8 independent kernels: spread of their start times
//   ./device_probes             # per-kernel cost of kernel chains in one CUDA graph (1 or 2 "ranks" on streams)
//
// On a freshly started H200: no backward step in 200 s, the largest gap 2.4 ms (other processes' kernels were
// time-sliced in); the 8 kernels started within 1.1 us on every launch, the first included; an empty kernel costs
// 0.97 us in a graph with programmatic dependent launch, a flag exchange between two streams 1.94 us, and a 14 KiB
// copy plus the flag 2.73 us.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>

#define CK(x)                                                                    \
  do {                                                                           \
    cudaError_t e = (x);                                                         \
    if (e != cudaSuccess) {                                                      \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));          \
      exit(1);                                                                   \
    }                                                                            \
  } while (0)

__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

struct TimerLog {
  unsigned long long samples, backward, fwd_over_1ms;
  long long max_back_ns, max_fwd_ns;
  unsigned long long first_event_cycle;
  unsigned long long start_ns, end_ns, cycles;
};

__global__ void TimerKernel(TimerLog* log, unsigned long long run_cycles) {
  const unsigned long long c0 = clock64();
  uint64_t prev = gtimer();
  log->start_ns = prev;
  unsigned long long n = 0, back = 0, fwd = 0, first = 0;
  long long max_back = 0, max_fwd = 0;
  while (true) {
    const uint64_t t = gtimer();
    ++n;
    const long long d = static_cast<long long>(t - prev);
    if (d < 0) {
      ++back;
      if (-d > max_back) max_back = -d;
      if (first == 0) first = clock64() - c0;
    } else if (d > 1000000) {
      ++fwd;
      if (first == 0) first = clock64() - c0;
    }
    if (d > max_fwd) max_fwd = d;
    prev = t;
    if ((n & 1023) == 0 && clock64() - c0 > run_cycles) break;
  }
  log->samples = n;
  log->backward = back;
  log->fwd_over_1ms = fwd;
  log->max_back_ns = max_back;
  log->max_fwd_ns = max_fwd;
  log->first_event_cycle = first;
  log->end_ns = prev;
  log->cycles = clock64() - c0;
}

// ---- latency chains ----
struct Flags {
  uint32_t* flag[2];     // flag[r][src]: epoch src published to r (own line per slot)
  uint32_t* counter[2];  // per-rank epoch counter
  uint8_t* buf[2];       // 64 KiB landing buffer per rank
  const uint8_t* src[2];
};

template <int kMode>
__global__ void Step(Flags f, int rank, int peers, int bytes) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  __shared__ uint32_t s_epoch;
  if (threadIdx.x == 0) s_epoch = *reinterpret_cast<volatile uint32_t*>(f.counter[rank]) + 1;
  __syncthreads();
  const uint32_t epoch = s_epoch;
  if (kMode == 0) {
  } else {
    // copy `bytes` to the peer's buffer
    const int other = peers == 1 ? rank : 1 - rank;
    const uint4* in = reinterpret_cast<const uint4*>(f.src[rank]);
    uint4* out = reinterpret_cast<uint4*>(f.buf[other]);
    for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) out[i] = in[i];
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t* dst = f.flag[other] + 32 * rank;
      if (kMode == 1) {
        asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(dst), "r"(epoch) : "memory");
      } else if (kMode == 2) {
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(dst), "r"(epoch) : "memory");
      } else {
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(dst), "r"(epoch) : "memory");
      }
      const uint32_t* mine = f.flag[rank] + 32 * other;
      uint32_t v;
      do {
        if (kMode == 2) {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory");
        } else {
          asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(mine) : "memory");
        }
      } while (static_cast<int32_t>(v - epoch) < 0);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *f.counter[rank] = epoch;
}

template <int kMode>
void Launch(cudaStream_t s, Flags f, int rank, int peers, int bytes, int threads, bool pdl) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c{};
  c.gridDim = dim3(1);
  c.blockDim = dim3(threads);
  c.stream = s;
  c.attrs = &attr;
  c.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&c, Step<kMode>, f, rank, peers, bytes));
}

void Chain(const char* name, int mode, int peers, int bytes, int threads, bool pdl, int kernels_per_step) {
  const int steps = 300;
  Flags f{};
  for (int r = 0; r < 2; ++r) {
    CK(cudaMalloc(&f.flag[r], 32 * 2 * 4 * 4));
    CK(cudaMemset(f.flag[r], 0, 32 * 2 * 4 * 4));
    CK(cudaMalloc(&f.counter[r], 4));
    CK(cudaMemset(f.counter[r], 0, 4));
    CK(cudaMalloc(&f.buf[r], 1 << 20));
    uint8_t* s;
    CK(cudaMalloc(&s, 1 << 20));
    CK(cudaMemset(s, 1, 1 << 20));
    f.src[r] = s;
  }
  cudaStream_t cap, st[2];
  CK(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
  for (int r = 0; r < 2; ++r) CK(cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking));
  cudaEvent_t fork, join[2], e0, e1;
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (int r = 0; r < 2; ++r) CK(cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming));
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal));
  CK(cudaEventRecord(fork, cap));
  for (int r = 0; r < peers; ++r) CK(cudaStreamWaitEvent(st[r], fork));
  for (int i = 0; i < steps * kernels_per_step; ++i) {
    for (int r = 0; r < peers; ++r) {
      switch (mode) {
        case 0: Launch<0>(st[r], f, r, peers, bytes, threads, pdl); break;
        case 1: Launch<1>(st[r], f, r, peers, bytes, threads, pdl); break;
        case 2: Launch<2>(st[r], f, r, peers, bytes, threads, pdl); break;
        default: Launch<3>(st[r], f, r, peers, bytes, threads, pdl); break;
      }
    }
  }
  for (int r = 0; r < peers; ++r) {
    CK(cudaEventRecord(join[r], st[r]));
    CK(cudaStreamWaitEvent(cap, join[r]));
  }
  CK(cudaStreamEndCapture(cap, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  CK(cudaGraphLaunch(ge, cap));
  CK(cudaStreamSynchronize(cap));
  float best = 1e30f;
  for (int rep = 0; rep < 5; ++rep) {
    CK(cudaEventRecord(e0, cap));
    CK(cudaGraphLaunch(ge, cap));
    CK(cudaEventRecord(e1, cap));
    CK(cudaStreamSynchronize(cap));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (ms < best) best = ms;
  }
  printf("%-44s ranks %d bytes %6d threads %4d pdl %d : %6.2f us per kernel, %6.2f us per step of %d kernels\n",
         name, peers, bytes, threads, pdl ? 1 : 0, best * 1e3 / (steps * kernels_per_step), best * 1e3 / steps,
         kernels_per_step);
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
}

__global__ void StartStamp(unsigned long long* stamps, int r) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) stamps[r] = gtimer();
}

// First launches of a graph of `branches` independent kernels (one per stream): spread of their start times.
void Spread(int branches) {
  unsigned long long* stamps;
  CK(cudaMallocManaged(&stamps, 64 * 8));
  cudaStream_t cap, st[64];
  CK(cudaStreamCreateWithFlags(&cap, cudaStreamNonBlocking));
  for (int r = 0; r < branches; ++r) CK(cudaStreamCreateWithFlags(&st[r], cudaStreamNonBlocking));
  cudaEvent_t fork, join[64];
  CK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  for (int r = 0; r < branches; ++r) CK(cudaEventCreateWithFlags(&join[r], cudaEventDisableTiming));
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(cap, cudaStreamCaptureModeGlobal));
  CK(cudaEventRecord(fork, cap));
  for (int r = 0; r < branches; ++r) {
    CK(cudaStreamWaitEvent(st[r], fork));
    for (int k = 0; k < 4; ++k) StartStamp<<<1, 32, 0, st[r]>>>(stamps, r);  // the last of the four stamps
    CK(cudaEventRecord(join[r], st[r]));
    CK(cudaStreamWaitEvent(cap, join[r]));
  }
  CK(cudaStreamEndCapture(cap, &g));
  cudaGraphExec_t ge;
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int launch = 0; launch < 4; ++launch) {
    timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    CK(cudaGraphLaunch(ge, cap));
    clock_gettime(CLOCK_MONOTONIC, &b);
    CK(cudaStreamSynchronize(cap));
    unsigned long long lo = ~0ull, hi = 0;
    for (int r = 0; r < branches; ++r) {
      if (stamps[r] < lo) lo = stamps[r];
      if (stamps[r] > hi) hi = stamps[r];
    }
    printf("graph of %d branches, launch %d: host call %.1f us, last branch started %.1f us after the first\n",
           branches, launch, (b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) * 1e-3, (hi - lo) * 1e-3);
  }
}

int main(int argc, char** argv) {
  if (argc >= 2 && strcmp(argv[1], "spread") == 0) {
    Spread(argc >= 3 ? atoi(argv[2]) : 8);
    return 0;
  }
  if (argc >= 2 && strcmp(argv[1], "timer") == 0) {
    const double seconds = argc >= 3 ? atof(argv[2]) : 60;
    int clock_khz = 0;
    CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
    TimerLog* log;
    CK(cudaMallocManaged(&log, sizeof(TimerLog)));
    memset(log, 0, sizeof(TimerLog));
    timespec ts0, ts1;
    clock_gettime(CLOCK_REALTIME, &ts0);
    TimerKernel<<<1, 1>>>(log, static_cast<unsigned long long>(seconds * clock_khz * 1e3));
    CK(cudaDeviceSynchronize());
    clock_gettime(CLOCK_REALTIME, &ts1);
    const double host_s = (ts1.tv_sec - ts0.tv_sec) + 1e-9 * (ts1.tv_nsec - ts0.tv_nsec);
    printf("timer probe: %.1f s host realtime, %.3f s globaltimer, %llu cycles (%.1f s at %d kHz), %llu samples\n",
           host_s, (log->end_ns - log->start_ns) * 1e-9, log->cycles, log->cycles / (clock_khz * 1e3), clock_khz,
           log->samples);
    printf("timer probe: backward steps %llu (largest %lld ns), forward gaps > 1 ms %llu (largest gap %lld ns), "
           "first odd sample at cycle %llu\n",
           log->backward, log->max_back_ns, log->fwd_over_1ms, log->max_fwd_ns, log->first_event_cycle);
    return 0;
  }
  Chain("empty kernel", 0, 1, 0, 256, true, 1);
  Chain("empty kernel, no PDL", 0, 1, 0, 256, false, 1);
  Chain("empty kernel", 0, 2, 0, 256, true, 1);
  Chain("self flag st.release.sys", 1, 1, 0, 256, true, 1);
  Chain("self flag st.release.gpu", 2, 1, 0, 256, true, 1);
  Chain("peer flag st.release.sys", 1, 2, 0, 256, true, 1);
  Chain("peer flag st.release.gpu", 2, 2, 0, 256, true, 1);
  Chain("peer flag fence.sys + relaxed", 3, 2, 0, 256, true, 1);
  Chain("peer copy 14.7KB + flag sys", 1, 2, 14336 + 64, 512, true, 1);
  Chain("peer copy 14.7KB + flag sys", 1, 2, 14336 + 64, 256, true, 1);
  Chain("peer copy 14.7KB + flag gpu", 2, 2, 14336 + 64, 512, true, 1);
  return 0;
}
