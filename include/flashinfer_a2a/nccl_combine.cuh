// The nccl transport's combine, around its all-to-all of the [ep_size, runtime_max, row] combine wire:
//  - before it, over the FP8 wire, NcclCombineWireKernel quantizes the valid rows this rank computed for the other
//    ranks (QuantizeCombinePieceTo, the NVLink combine's code: the same bytes): values, then an fp32 scale per 128
//    elements, each row Fp8WireRowBytes(hidden) bytes;
//  - after it, NcclSumKernel sums each local token's rows in increasing rank order in fp32 and rounds once to the
//    output's type (DESIGN.md §2). Rank d's row for token t is at slot "tokens before t sent to d" of block d; a
//    block of the kernel finds those slots from this rank's mask planes (its send buffer's, nccl_wire.cuh) as the
//    select does, then warps sum (token, piece) items with the NVLink combine's own sums (SumPlainElems,
//    SumFp8Elems): the rows after the all-to-all are laid out as a pushed combine's landing block, [source rank,
//    runtime_max, row], so they are that combine's bits.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "combine_fp8.cuh"
#include "nccl_wire.cuh"

namespace flashinfer_a2a {

constexpr int kNcclSumThreads = 256;
constexpr int kNcclSumWarps = kNcclSumThreads / 32;
constexpr int kNcclSumTokens = kNcclSumThreads;  // a block's chunk of tokens: one per thread while routing
constexpr int kNcclMaxRoutes = kMaxTopK;          // distinct ranks of one token: at most its top_k
// Blocks a multiprocessor holds of NcclSumKernel: registers capped for 4 of the plain sums (one H100, 8192 tokens,
// hidden 7168, bf16 rows of 2 ranks 145.8 -> 131.4 us, 4 ranks 195.9 -> 190.1); the FP8-wire sum keeps its 72 a
// thread and 3 blocks (capped for 4 it took 110.2 -> 131.5 us and 143.8 -> 178.5).
constexpr int NcclSumBlocksPerSm(bool fp8_wire) { return fp8_wire ? 3 : 4; }

struct NcclCombineParams {
  // The sum's view (SumPlainElems, SumFp8Elems): the rows returned by the all-to-all as the landing block of a
  // pushed combine (ranks.workspace, with bytes_per_rank and landing_offset 0), this rank's partials as its input
  // (OwnPartials: its own rows, exact over the FP8 wire), out, the hidden size, row bytes, runtime_max, num_tokens;
  // recv_counts: the rows of each block NcclCombineWireKernel quantizes.
  CombineParams c;
  int64_t wire_row_bytes;  // of the combine wire: c.row_bytes, or Fp8WireRowBytes(hidden)
  uint8_t* wire;           // NcclCombineWireKernel: [ep_size, runtime_max, wire_row_bytes]
  const uint8_t* mask;     // NcclSumKernel: this rank's mask planes (its dispatch's send buffer)
  int64_t plane_stride;
  int32_t splits;  // blocks sharing one chunk of tokens
};

template <typename T>
__global__ void __launch_bounds__(kNcclSumThreads) NcclCombineWireKernel(const __grid_constant__ NcclCombineParams p) {
  WaitPriorKernels();
  const CombineParams& c = p.c;
  const int lane = threadIdx.x % 32;
  const int pieces = (c.hidden + kQuantPieceElems - 1) / kQuantPieceElems;
  const int64_t items = static_cast<int64_t>(c.ranks.ep_size) * c.runtime_max * pieces;
  for (int64_t item = blockIdx.x * kNcclSumWarps + threadIdx.x / 32; item < items;
       item += static_cast<int64_t>(gridDim.x) * kNcclSumWarps) {
    const int64_t row = item / pieces;
    const int src = static_cast<int>(row / c.runtime_max);
    if (src == c.ranks.ep_rank || row % c.runtime_max >= c.recv_counts[src]) continue;  // never read by its owner
    QuantizeCombinePieceTo<T>(p.wire + row * p.wire_row_bytes, c.input + row * c.row_bytes, c.hidden,
                              static_cast<int>(item % pieces), lane);
  }
}

// The routes of the chunk's tokens t0.. (one per thread): entry k of token t0 + i, in s_entry[k][i], is the k-th
// rank d the token went to (increasing) with its slot in block d, packed as a dispatch routing entry; s_num[i] says
// how many. The slot counts the tokens before t0 sent to d (every block counts them itself) and those of the chunk
// (a ballot per rank and warp).
__device__ __forceinline__ void RouteChunkTokens(const NcclCombineParams& p, int64_t t0,
                                                 int32_t (*s_entry)[kNcclSumTokens + 1], uint8_t* s_num,
                                                 int32_t (*s_prefix)[kMaxRanks], int32_t* s_base) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ep_size = p.c.ranks.ep_size;
  const int planes = (ep_size + 7) / 8;
  for (int d = threadIdx.x; d < ep_size; d += kNcclSumThreads) s_base[d] = 0;
  __syncthreads();
  for (int j = 0; j < planes; ++j) {
    CountPlaneBits(p.mask + j * p.plane_stride, t0, 0, min(8, ep_size - 8 * j), s_base + 8 * j);
  }
  const int64_t t = t0 + threadIdx.x;
  int k = 0;
  for (int j = 0; j < planes; ++j) {
    const uint32_t byte = t < p.c.num_tokens ? p.mask[j * p.plane_stride + t] : 0u;
    for (int d = 8 * j; d < min(8 * j + 8, ep_size); ++d) {
      const bool has = (byte >> (d - 8 * j)) & 1u;
      const uint32_t ballot = __ballot_sync(0xffffffffu, has);
      if (lane == 0) s_prefix[warp][d] = __popc(ballot);
      if (has && k < kNcclMaxRoutes) {
        s_entry[k++][threadIdx.x] = (d << kRouteSlotBits) | __popc(ballot & LaneMaskLt());  // slot in the warp
      }
    }
  }
  s_num[threadIdx.x] = static_cast<uint8_t>(k);
  __syncthreads();  // s_base complete, s_prefix holds each warp's count
  for (int d = threadIdx.x; d < ep_size; d += kNcclSumThreads) {
    int32_t running = s_base[d];
    for (int w = 0; w < kNcclSumWarps; ++w) {
      const int32_t count = s_prefix[w][d];
      s_prefix[w][d] = running;
      running += count;
    }
  }
  __syncthreads();
  for (int i = 0; i < k; ++i) s_entry[i][threadIdx.x] += s_prefix[warp][RouteRank(s_entry[i][threadIdx.x])];
}

// kFp8: the rows crossed the FP8 wire (kVec unused: 16 elements a lane); else they are the partials' type, summed
// kVec bytes a lane.
template <typename T, int kVec, bool kFp8>
__global__ void __launch_bounds__(kNcclSumThreads, NcclSumBlocksPerSm(kFp8))
    NcclSumKernel(const __grid_constant__ NcclCombineParams p) {
  __shared__ int32_t s_entry[kNcclMaxRoutes][kNcclSumTokens + 1];  // padded: bank-conflict free both ways
  __shared__ uint8_t s_num[kNcclSumTokens];
  __shared__ int32_t s_prefix[kNcclSumWarps][kMaxRanks];
  __shared__ int32_t s_base[kMaxRanks];
  WaitPriorKernels();
  const int split = blockIdx.x % p.splits;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x / p.splits) * kNcclSumTokens;
  RouteChunkTokens(p, t0, s_entry, s_num, s_prefix, s_base);
  __syncthreads();
  const int lane = threadIdx.x % 32;
  constexpr int64_t kPiece = kFp8 ? kFp8PieceElems : 32 * kVec;  // elements (FP8 wire) or bytes a warp sums
  const int64_t pieces = ((kFp8 ? p.c.hidden : p.c.row_bytes) + kPiece - 1) / kPiece;
  const int64_t items = std::min<int64_t>(kNcclSumTokens, p.c.num_tokens - t0) * pieces;
  for (int64_t item = split * kNcclSumWarps + threadIdx.x / 32; item < items;
       item += static_cast<int64_t>(p.splits) * kNcclSumWarps) {
    const int i = static_cast<int>(item / pieces);
    const int num_sources = s_num[i];
    const int32_t entry = lane < num_sources ? s_entry[lane][i] : -1;
    const int64_t at = item % pieces * kPiece;
    if constexpr (kFp8) {
      SumFp8Elems<T>(p.c, t0 + i, at + lane * kFp8PullElems, entry, num_sources, true);
    } else {
      SumPlainElems<T, kVec>(p.c, t0 + i, at + lane * kVec, entry, num_sources, true);
    }
  }
}

// The sum of rows over the FP8 wire (bf16|fp16 partials), or summed vec bytes a lane.
template <typename T>
inline auto NcclSumKernelFor(bool fp8_wire, int vec) -> decltype(&NcclSumKernel<T, 4, false>) {
  if constexpr (sizeof(T) == 2) {
    if (fp8_wire) return NcclSumKernel<T, 16, true>;
    if (vec == 2) return NcclSumKernel<T, 2, false>;
  }
  return vec == 16 ? NcclSumKernel<T, 16, false> : NcclSumKernel<T, 4, false>;
}

// One block per 256 tokens, each chunk split over blocks so that the grid is one wave of resident blocks where the
// chunks allow (while each block keeps an item per warp). A grid of about 4 blocks per multiprocessor ran 1.4 waves
// of the FP8-wire sum (3 blocks fit, by its registers) and the last blocks alone. One H100, 8192 tokens, hidden
// 7168, before -> after: FP8 wire, 2 ranks 129.6 -> 110.4 us, 4 ranks 170.4 -> 143.0; bf16 rows 211.4 -> 145.9 and
// 271.4 -> 195.1.
template <typename T>
inline cudaError_t LaunchNcclSum(NcclCombineParams p, bool fp8_wire, int grid_sms, cudaStream_t stream) {
  const CombineParams& c = p.c;
  if (c.num_tokens == 0) return cudaSuccess;
  const int64_t chunks = CeilDiv(c.num_tokens, kNcclSumTokens);
  // 16, 4 or 2 bytes a lane: a 16-bit row of odd hidden is 2-aligned only; fp32 rows are 4-aligned.
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(c.output) | reinterpret_cast<uintptr_t>(c.input) |
                              reinterpret_cast<uintptr_t>(c.ranks.workspace);
  const int widest = VecBytesFor(c.row_bytes, addresses, 0);
  const int vec = widest >= 16 ? 16 : widest >= 4 ? 4 : 2;
  if (fp8_wire && sizeof(T) != 2) return cudaErrorInvalidValue;  // bf16|fp16 partials only (checked by the entry)
  const auto kernel = NcclSumKernelFor<T>(fp8_wire, vec);
  const int64_t pieces = CeilDiv(c.row_bytes, fp8_wire ? kFp8PieceElems * int64_t{sizeof(T)} : 32 * vec);
  const int64_t most = CeilDiv(std::min<int64_t>(kNcclSumTokens, c.num_tokens) * pieces, kNcclSumWarps);
  const int64_t wave = int64_t{grid_sms} * ResidentBlocksPerSm(kernel, kNcclSumThreads);
  p.splits = static_cast<int32_t>(std::clamp<int64_t>(wave / chunks, 1, most));
  return LaunchAfterPrior(kernel, static_cast<int>(chunks * p.splits), kNcclSumThreads, stream, p);
}

template <typename T>
inline cudaError_t LaunchNcclCombineWire(const NcclCombineParams& p, int grid_sms, cudaStream_t stream) {
  const int64_t items = int64_t{p.c.ranks.ep_size} * p.c.runtime_max * CeilDiv(p.c.hidden, kQuantPieceElems);
  const int64_t wanted = std::max<int64_t>(1, CeilDiv(items, kNcclSumWarps));
  // One wave of its grid-stride loop.
  const int wave = grid_sms * ResidentBlocksPerSm(NcclCombineWireKernel<T>, kNcclSumThreads);
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, wave));
  return LaunchAfterPrior(NcclCombineWireKernel<T>, blocks, kNcclSumThreads, stream, p);
}

}  // namespace flashinfer_a2a
