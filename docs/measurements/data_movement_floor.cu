// The data movement of one dispatch + combine step of simulated ranks, alone: no epochs, no flags, no waiting, one
// kernel for every rank's share, all multiprocessors. One of the probes of docs/benchmarks.md, "Where the time goes".
//
//   nvcc -arch=sm_90a -O3 -std=c++17 -o data_movement_floor docs/measurements/data_movement_floor.cu
//   ./data_movement_floor            # 2 and 4 ranks at 1, 16, 64 and 128 tokens per rank
//   ./data_movement_floor 4 64       # one setting
//
// DeepSeek-V3 rows (7168 bf16), top-8 of 256 experts drawn uniformly, experts split evenly over the ranks. The
// copy stores each (source rank, token) row into the dispatch region of every distinct rank of its experts, at the
// slot the dispatch would give it (a warp loads 2 KiB of the row, then stores it to each target). The pull sums, for
// every (rank, token), the partial rows of the ranks it went to in fp32 and stores the bf16 sum (a warp per 512 B
// or 1 KiB piece, 2 KiB of loads issued before their adds). "One row per token" copies each token to a single
// peer instead: the bytes a step would move if tokens went to one rank each. Every stored row is checked after its
// timing (the program stops at a wrong one). Each figure is the median of 7 replays of a CUDA graph of 200
// launches, per launch, less the same for an empty kernel.
//
// One H200, 2026-11-25, two runs, 4 ranks at 64 tokens (948 rows to targets, 13.6 MB): copy 4.4-4.5 us, pull
// 4.3-4.4 us (512 B pieces) or 3.7 us (1 KiB), copy then pull 8.8-8.9 us; one row per token: copy 1.8-1.9 us.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CK(x)                                                              \
  do {                                                                     \
    cudaError_t e_ = (x);                                                  \
    if (e_ != cudaSuccess) {                                               \
      printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));   \
      exit(1);                                                             \
    }                                                                      \
  } while (0)

constexpr int kMaxRanks = 8, kHidden = 7168, kRow = kHidden * 2, kTopK = 8, kExperts = 256, kIters = 200;

// Where one (source rank, token) row goes: `n` ranks, and its slot in each.
struct Targets {
  int n;
  int rank[kMaxRanks];
  int slot[kMaxRanks];
};

struct Shape {
  int ranks, tokens;
  // Row (dst, src, slot) of a region laid out [ranks (owner), ranks (source), tokens (slot)].
  __host__ __device__ int64_t Row(int dst, int src, int slot) const {
    return (static_cast<int64_t>(dst) * ranks + src) * tokens + slot;
  }
};

__global__ void Empty() {}

// Lane j of the warp holds the j-th target (rank, slot) of a row; returns how many targets the row has.
__device__ __forceinline__ int LoadTargets(const Targets* targets, int row, int lane, int2& mine) {
  const int n = targets[row].n;
  mine = lane < n ? make_int2(targets[row].rank[lane], targets[row].slot[lane]) : make_int2(0, 0);
  return n;
}

// A warp per (row, 2 KiB piece): 4 vectors of 16 B a lane loaded, then stored to each target.
__global__ void __launch_bounds__(512) Copy(Shape s, const uint8_t* in, uint8_t* region, const Targets* targets) {
  constexpr int kVectors = 4, kPiece = 32 * kVectors * 16, kPieces = (kRow + kPiece - 1) / kPiece;
  const int lane = threadIdx.x % 32;
  const int items = s.ranks * s.tokens * kPieces;
  for (int item = (blockIdx.x * blockDim.x + threadIdx.x) / 32; item < items; item += gridDim.x * blockDim.x / 32) {
    const int row = item / kPieces, begin = item % kPieces * kPiece;
    int4 v[kVectors];
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int off = begin + (u * 32 + lane) * 16;
      if (off < kRow) v[u] = *reinterpret_cast<const int4*>(in + static_cast<int64_t>(row) * kRow + off);
    }
    int2 mine;
    const int n = LoadTargets(targets, row, lane, mine);
    for (int j = 0; j < n; ++j) {
      const int rank = __shfl_sync(0xffffffffu, mine.x, j), slot = __shfl_sync(0xffffffffu, mine.y, j);
      uint8_t* dst = region + s.Row(rank, row / s.tokens, slot) * kRow;
#pragma unroll
      for (int u = 0; u < kVectors; ++u) {
        const int off = begin + (u * 32 + lane) * 16;
        if (off < kRow) *reinterpret_cast<int4*>(dst + off) = v[u];
      }
    }
  }
}

// A warp per (row, piece of kVectors x 512 B): 2 KiB of partials in flight (the vectors of 4 targets, or of 2 with
// 1 KiB pieces: within the 64 registers a thread of a 1024-thread block has), then summed in fp32.
template <int kVectors>
__global__ void __launch_bounds__(1024) Pull(Shape s, const uint8_t* region, uint8_t* out, const Targets* targets) {
  constexpr int kPiece = 32 * kVectors * 16, kPieces = (kRow + kPiece - 1) / kPiece, kBatch = 4 / kVectors;
  const int lane = threadIdx.x % 32;
  const int items = s.ranks * s.tokens * kPieces;
  for (int item = (blockIdx.x * blockDim.x + threadIdx.x) / 32; item < items; item += gridDim.x * blockDim.x / 32) {
    const int row = item / kPieces, begin = item % kPieces * kPiece;
    int2 mine;
    const int n = LoadTargets(targets, row, lane, mine);
    float sum[kVectors][8] = {};
    for (int j0 = 0; j0 < n; j0 += kBatch) {
      int4 v[kBatch][kVectors];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        const int rank = __shfl_sync(0xffffffffu, mine.x, (j0 + j) & 31);
        const int slot = __shfl_sync(0xffffffffu, mine.y, (j0 + j) & 31);
        if (j0 + j >= n) break;
        const uint8_t* src = region + s.Row(rank, row / s.tokens, slot) * kRow;
#pragma unroll
        for (int u = 0; u < kVectors; ++u) {
          const int off = begin + (u * 32 + lane) * 16;
          if (off < kRow) v[j][u] = *reinterpret_cast<const int4*>(src + off);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j0 + j >= n) break;
#pragma unroll
        for (int u = 0; u < kVectors; ++u) {
          const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&v[j][u]);
#pragma unroll
          for (int e = 0; e < 8; ++e) sum[u][e] += __bfloat162float(x[e]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kVectors; ++u) {
      const int off = begin + (u * 32 + lane) * 16;
      if (off >= kRow) continue;
      int4 w;
      __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(&w);
#pragma unroll
      for (int e = 0; e < 8; ++e) y[e] = __float2bfloat16(sum[u][e]);
      *reinterpret_cast<int4*>(out + static_cast<int64_t>(row) * kRow + off) = w;
    }
  }
}

// Median over 7 replays of a graph of kIters launches, in us per launch.
template <typename Launch>
float PerLaunchUs(Launch launch, cudaStream_t stream) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kIters; ++i) launch();
  CK(cudaStreamEndCapture(stream, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  std::vector<float> us;
  for (int replay = 0; replay < 10; ++replay) {
    CK(cudaEventRecord(start, stream));
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaEventRecord(stop, stream));
    CK(cudaEventSynchronize(stop));
    float ms;
    CK(cudaEventElapsedTime(&ms, start, stop));
    if (replay >= 3) us.push_back(ms * 1000.0f / kIters);  // the first replays warm up
  }
  std::sort(us.begin(), us.end());
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return us[us.size() / 2];
}

// Each (source, token) row's targets: the distinct ranks of kTopK experts drawn without replacement, or (one_peer)
// only the next rank.
std::vector<Targets> DrawTargets(const Shape& s, bool one_peer, std::mt19937& rng) {
  std::vector<Targets> all(s.ranks * s.tokens);
  std::vector<int> experts(kExperts);
  for (int src = 0; src < s.ranks; ++src) {
    int next_slot[kMaxRanks] = {};
    for (int token = 0; token < s.tokens; ++token) {
      bool hit[kMaxRanks] = {};
      if (one_peer) {
        hit[(src + 1) % s.ranks] = true;
      } else {
        for (int e = 0; e < kExperts; ++e) experts[e] = e;
        std::shuffle(experts.begin(), experts.end(), rng);
        for (int k = 0; k < kTopK; ++k) hit[experts[k] / (kExperts / s.ranks)] = true;
      }
      Targets& t = all[src * s.tokens + token];
      t.n = 0;
      for (int r = 0; r < s.ranks; ++r) {
        if (!hit[r]) continue;
        t.rank[t.n] = r;
        t.slot[t.n++] = next_slot[r]++;
      }
    }
  }
  return all;
}

// Every target row of the dispatch region holds the source row (all bytes 0x3c).
bool CopiesLanded(const Shape& s, const std::vector<Targets>& targets, const uint8_t* region) {
  std::vector<uint8_t> host(static_cast<size_t>(s.ranks) * s.ranks * s.tokens * kRow);
  CK(cudaMemcpy(host.data(), region, host.size(), cudaMemcpyDeviceToHost));
  for (size_t row = 0; row < targets.size(); ++row) {
    for (int j = 0; j < targets[row].n; ++j) {
      const uint8_t* got = host.data() + s.Row(targets[row].rank[j], row / s.tokens, targets[row].slot[j]) * kRow;
      if (std::any_of(got, got + kRow, [](uint8_t b) { return b != 0x3c; })) return false;
    }
  }
  return true;
}

// Every element of every output row is the sum of its row's targets' partials (each element bf16 0x3c3c).
bool SumsRight(const Shape& s, const std::vector<Targets>& targets, const uint8_t* out) {
  std::vector<__nv_bfloat16> host(targets.size() * kHidden);
  CK(cudaMemcpy(host.data(), out, host.size() * 2, cudaMemcpyDeviceToHost));
  const float part = __bfloat162float(__ushort_as_bfloat16(0x3c3c));
  for (size_t row = 0; row < targets.size(); ++row) {
    float sum = 0.0f;
    for (int j = 0; j < targets[row].n; ++j) sum += part;
    const float want = __bfloat162float(__float2bfloat16(sum));
    for (int e = 0; e < kHidden; ++e) {
      if (__bfloat162float(host[row * kHidden + e]) != want) return false;
    }
  }
  return true;
}

void Measure(const Shape& s, int sms, float empty_us, cudaStream_t stream) {
  std::mt19937 rng(1000 * s.ranks + s.tokens);
  const int64_t rows = static_cast<int64_t>(s.ranks) * s.tokens;
  uint8_t *in, *dispatch_region, *combine_region, *out;
  Targets *routed, *one_peer;
  CK(cudaMalloc(&in, rows * kRow));
  CK(cudaMalloc(&dispatch_region, rows * s.ranks * kRow));
  CK(cudaMalloc(&combine_region, rows * s.ranks * kRow));
  CK(cudaMalloc(&out, rows * kRow));
  CK(cudaMemset(in, 0x3c, rows * kRow));  // every bf16 element 0x3c3c (about 0.0115)
  CK(cudaMemset(combine_region, 0x3c, rows * s.ranks * kRow));
  CK(cudaMemset(dispatch_region, 0, rows * s.ranks * kRow));
  const std::vector<Targets> drawn = DrawTargets(s, false, rng), single = DrawTargets(s, true, rng);
  int64_t moved = 0;
  for (const Targets& t : drawn) moved += t.n;
  CK(cudaMalloc(&routed, drawn.size() * sizeof(Targets)));
  CK(cudaMalloc(&one_peer, single.size() * sizeof(Targets)));
  CK(cudaMemcpy(routed, drawn.data(), drawn.size() * sizeof(Targets), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(one_peer, single.data(), single.size() * sizeof(Targets), cudaMemcpyHostToDevice));

  const float copy = PerLaunchUs([&] { Copy<<<sms, 512, 0, stream>>>(s, in, dispatch_region, routed); }, stream);
  const float pull1 = PerLaunchUs([&] { Pull<1><<<sms, 1024, 0, stream>>>(s, combine_region, out, routed); }, stream);
  const bool copied = CopiesLanded(s, drawn, dispatch_region);
  const bool summed1 = SumsRight(s, drawn, out);
  CK(cudaMemset(out, 0, rows * kRow));
  const float pull2 = PerLaunchUs([&] { Pull<2><<<sms, 1024, 0, stream>>>(s, combine_region, out, routed); }, stream);
  if (!copied || !summed1 || !SumsRight(s, drawn, out)) {
    printf("%d ranks x %d tokens: WRONG rows (copy %d, pull 512 B %d, pull 1 KiB %d)\n", s.ranks, s.tokens, copied,
           summed1, SumsRight(s, drawn, out));
    exit(1);
  }
  const float both = PerLaunchUs([&] {
    Copy<<<sms, 512, 0, stream>>>(s, in, dispatch_region, routed);
    Pull<1><<<sms, 1024, 0, stream>>>(s, combine_region, out, routed);
  }, stream);
  const float once = PerLaunchUs([&] { Copy<<<sms, 512, 0, stream>>>(s, in, dispatch_region, one_peer); }, stream);
  printf("%d ranks x %3d tokens | %5lld rows to targets (%5.1f MB) | copy %5.2f | pull 512 B %5.2f, 1 KiB %5.2f | "
         "copy then pull %5.2f | one row per token: copy %5.2f (%4.1f MB)\n",
         s.ranks, s.tokens, static_cast<long long>(moved), moved * kRow / 1e6, copy - empty_us, pull1 - empty_us,
         pull2 - empty_us, both - 2 * empty_us, once - empty_us, rows * kRow / 1e6);
  CK(cudaFree(in));
  CK(cudaFree(dispatch_region));
  CK(cudaFree(combine_region));
  CK(cudaFree(out));
  CK(cudaFree(routed));
  CK(cudaFree(one_peer));
}

int main(int argc, char** argv) {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const float empty_us = PerLaunchUs([&] { Empty<<<1, 32, 0, stream>>>(); }, stream);
  printf("%d multiprocessors; an empty kernel costs %.2f us per launch in a graph (taken off every figure, us)\n",
         sms, empty_us);
  if (argc == 3) {
    const Shape s{atoi(argv[1]), atoi(argv[2])};
    if (s.ranks < 1 || s.ranks > kMaxRanks || kExperts % s.ranks != 0 || s.tokens < 1) {
      printf("usage: %s [RANKS (1, 2, 4 or 8) TOKENS_PER_RANK]\n", argv[0]);
      return 2;
    }
    Measure(s, sms, empty_us, stream);
    return 0;
  }
  for (int ranks : {2, 4}) {
    for (int tokens : {1, 16, 64, 128}) Measure(Shape{ranks, tokens}, sms, empty_us, stream);
  }
  return 0;
}
