// The FP8 wire of combine (bf16|fp16 partials): the quantizing side, the dequantizing sums, and the wire of the
// pushed combine (Fp8Wire, see combine_push.cuh). Used by the launchers in combine.cuh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "combine_common.cuh"
#include "float_convert.cuh"
#include "quant_dispatch.cuh"

namespace flashinfer_a2a {

// The FP8 wire of combine: a partial row of `hidden` elements becomes hidden E4M3 bytes followed by one fp32 scale
// per 128 elements, written over the front of the row (whose bf16|fp16 bytes are twice as many).
constexpr int kFp8WireMaxCols = 256;  // hidden <= 32768: the scales of a row wait in shared memory

// Quantizes piece `piece` (kQuantPieceElems elements) of one partial row into its FP8 wire row and returns the
// piece's scales gathered (lane j < 8: column piece * 8 + j). src may be dst (in place): every lane loads before any
// lane stores, and the stores (values at half the byte offset of their elements) only cover bytes of this piece and
// earlier ones, which the caller must have quantized first. hidden % 8 == 0; rows 16-byte aligned.
template <typename T>
__device__ __forceinline__ uint32_t QuantizeCombinePiece(uint8_t* dst, const uint8_t* src, int hidden, int piece,
                                                         int lane) {
  const T* in = reinterpret_cast<const T*>(src);
  uint4 raw[kQuantRounds];
  int e0[kQuantRounds];
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) {
    e0[u] = piece * kQuantPieceElems + (u * 32 + lane) * kQuantLaneElems;
    raw[u] = LoadLaneElems<T>(in, e0[u], hidden, true);
  }
  __syncwarp();
  LaneQuant lq[kQuantRounds];
  const uint32_t scales = QuantizeRounds<T, QuantFormat::kFp8Block>(raw, lane, lq);
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) {
    if (e0[u] < hidden) StoreLaneValues<QuantFormat::kFp8Block>(dst, e0[u], hidden, true, lq[u]);
  }
  return scales;
}

// QuantizeCombinePiece into another row (dst != src): the piece's scales go straight to their columns.
template <typename T>
__device__ __forceinline__ void QuantizeCombinePieceTo(uint8_t* dst, const uint8_t* src, int hidden, int piece,
                                                       int lane) {
  constexpr int kScalesPerPiece = kQuantPieceElems / quant::kFp8Block;
  const uint32_t word = QuantizeCombinePiece<T>(dst, src, hidden, piece, lane);
  const int col = piece * kScalesPerPiece + lane;
  if (lane < kScalesPerPiece && col < (hidden + quant::kFp8Block - 1) / quant::kFp8Block) {
    reinterpret_cast<uint32_t*>(dst + hidden)[col] = word;
  }
}

// The owner side of the FP8 wire: quantizes the valid rows this rank computed for other ranks (its own rows cross
// no link; the pull reads them where they are). From a separate partials tensor any warp takes any piece; in place
// (zero copy) a warp takes a whole row, its pieces in order, the scales waiting in shared memory until the row's
// values are written.
template <typename T>
__device__ __forceinline__ void QuantizeRowsFp8(const CombineParams& p, float* warp_scales) {
  const int block_warps = blockDim.x / 32;
  const int warp = blockIdx.x * block_warps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * block_warps;
  const int pieces = (p.hidden + kQuantPieceElems - 1) / kQuantPieceElems;
  const int cols = (p.hidden + quant::kFp8Block - 1) / quant::kFp8Block;
  constexpr int kScalesPerPiece = kQuantPieceElems / quant::kFp8Block;
  uint8_t* region = p.ranks.Base(p.ranks.ep_rank) + p.combine_offset;
  const int64_t rows = static_cast<int64_t>(p.ranks.ep_size) * p.runtime_max;
  auto skip = [&](int64_t row) {
    const int src = static_cast<int>(row / p.runtime_max);
    return src == p.ranks.ep_rank || row % p.runtime_max >= p.recv_counts[src];
  };
  if (p.input != nullptr) {
    for (int64_t item = warp; item < rows * pieces; item += num_warps) {
      const int64_t row = item / pieces;
      const int piece = static_cast<int>(item % pieces);
      if (skip(row)) continue;
      QuantizeCombinePieceTo<T>(region + row * p.row_bytes, p.input + row * p.row_bytes, p.hidden, piece, lane);
    }
    return;
  }
  for (int64_t row = warp; row < rows; row += num_warps) {
    if (skip(row)) continue;
    uint8_t* dst = region + row * p.row_bytes;
    for (int piece = 0; piece < pieces; ++piece) {
      const uint32_t word = QuantizeCombinePiece<T>(dst, dst, p.hidden, piece, lane);
      const int col = piece * kScalesPerPiece + lane;
      if (lane < kScalesPerPiece && col < cols) warp_scales[col] = __uint_as_float(word);
    }
    __syncwarp();
    for (int c = lane; c < cols; c += 32) reinterpret_cast<float*>(dst + p.hidden)[c] = warp_scales[c];
    __syncwarp();  // the scales are read before the next row overwrites them
  }
}

constexpr int kFp8PullElems = 16;  // per lane: one 16-byte load of FP8 values, two of bf16|fp16
constexpr int kFp8PullBatch = 4;   // sources loaded before the first add

// One lane's 16 elements (8 at the row's end) of token t over the FP8 wire, from element e0: each remote source
// dequantized (q * scale in fp32, one rounding), this rank's own partial taken as is (from the caller's partials,
// or the combine region when zero copy), added in increasing rank order. A remote row is in that rank's combine
// region (pulled) or in this rank's landing block for that rank (`landed`: pushed). hidden % 8 == 0.
template <typename T>
__device__ __forceinline__ void SumFp8Elems(const CombineParams& p, int64_t t, int64_t e0, int32_t entry,
                                            int num_sources, bool landed) {
  constexpr int kHalf = kFp8PullElems / 2;
  const int64_t src_block = static_cast<int64_t>(p.ranks.ep_rank) * p.runtime_max;
  const int64_t landing_row_bytes = Fp8WireRowBytes(p.hidden);
  const bool active = e0 < p.hidden;
  const bool full = e0 + kFp8PullElems <= p.hidden;

  float acc[kFp8PullElems];
#pragma unroll
  for (int e = 0; e < kFp8PullElems; ++e) acc[e] = 0.0f;
  for (int j0 = 0; j0 < num_sources; j0 += kFp8PullBatch) {
    uint4 loaded[kFp8PullBatch][2];  // FP8: [0] holds 16 values; own rank: 8 elements in each
    float scale[kFp8PullBatch];      // 0 marks this rank's own partial (an FP8 block scale is never 0)
#pragma unroll
    for (int j = 0; j < kFp8PullBatch; ++j) {
      const int32_t e = __shfl_sync(0xffffffffu, entry, (j0 + j) & 31);
      if (active && j0 + j < num_sources) {
        const int rank = RouteRank(e);
        if (rank == p.ranks.ep_rank) {
          const uint4* v = reinterpret_cast<const uint4*>(OwnPartials(p) + (src_block + RouteSlot(e)) * p.row_bytes +
                                                          e0 * sizeof(T));
          loaded[j][0] = v[0];
          if (full) loaded[j][1] = v[1];
          scale[j] = 0.0f;
        } else {
          const uint8_t* row =
              landed ? LandingRow(p, p.ranks.ep_rank, rank, RouteSlot(e), landing_row_bytes)
                     : p.ranks.Base(rank) + p.combine_offset + (src_block + RouteSlot(e)) * p.row_bytes;
          loaded[j][0] = full ? *reinterpret_cast<const uint4*>(row + e0)
                              : make_uint4(reinterpret_cast<const uint2*>(row + e0)->x,
                                           reinterpret_cast<const uint2*>(row + e0)->y, 0, 0);
          scale[j] = reinterpret_cast<const float*>(row + p.hidden)[e0 / quant::kFp8Block];
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kFp8PullBatch; ++j) {
      if (!active || j0 + j >= num_sources) continue;
      if (scale[j] == 0.0f) {
        const T* lo = reinterpret_cast<const T*>(&loaded[j][0]);
        const T* hi = reinterpret_cast<const T*>(&loaded[j][1]);
#pragma unroll
        for (int e = 0; e < kHalf; ++e) {
          acc[e] += FloatConvert<T>::ToFloat(lo[e]);
          acc[kHalf + e] += full ? FloatConvert<T>::ToFloat(hi[e]) : 0.0f;
        }
      } else {
        const uint8_t* q = reinterpret_cast<const uint8_t*>(&loaded[j][0]);
#pragma unroll
        for (int e = 0; e < kFp8PullElems; ++e) acc[e] += __fmul_rn(quant::FromE4m3(q[e]), scale[j]);
      }
    }
  }
  if (!active) return;
  uint4 out[2];
  T* o = reinterpret_cast<T*>(out);
#pragma unroll
  for (int e = 0; e < kFp8PullElems; ++e) o[e] = FloatConvert<T>::FromFloat(acc[e]);
  uint4* dst = reinterpret_cast<uint4*>(static_cast<uint8_t*>(p.output) + (t * p.hidden + e0) * sizeof(T));
  dst[0] = out[0];
  if (full) dst[1] = out[1];
}

constexpr int kFp8PieceElems = 32 * kFp8PullElems;  // a warp's share of a row in the FP8-wire sums

// PullItems over the FP8 wire: a warp per (token, 512 elements).
template <typename T>
__device__ __forceinline__ void PullItemsFp8(const CombineParams& p, bool failed, int64_t first_item,
                                             int64_t item_stride) {
  const int lane = threadIdx.x % 32;
  const int pieces = (p.hidden + kFp8PieceElems - 1) / kFp8PieceElems;
  const int64_t items = static_cast<int64_t>(p.num_tokens) * pieces;
  for (int64_t item = first_item; item < items; item += item_stride) {
    const int64_t t = item / pieces;
    const auto [entry, num_sources] = LoadTokenSources(p, failed, t, lane);
    SumFp8Elems<T>(p, t, (item % pieces) * kFp8PieceElems + lane * kFp8PullElems, entry, num_sources, false);
  }
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads) CombinePullFp8Kernel(const __grid_constant__ CombineParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  PullItemsFp8<T>(p, HasFatalError(p.ranks.MyMeta()), blockIdx.x * kCombineWarps + threadIdx.x / 32,
                  static_cast<int64_t>(gridDim.x) * kCombineWarps);
}

// The FP8 wire of a pushed combine (combine_push.cuh): a row lands in its owner's workspace quantized, as
// Fp8WireRowBytes(hidden) bytes; the owner dequantizes it while summing.
template <typename T>
struct Fp8Wire {
  // Pushers per block (see PlainWire): quantizing makes a push dearer, so half the warps push (2xH200, 8192 tokens:
  // 230 us with 4 of 8 warps, 266 with 2, 263 with 6).
  static constexpr int kPushWarps = kCombineWarps / 2;
  static constexpr int kChunkPieces = kReduceChunkBytes / (kFp8PieceElems * sizeof(T));

  __device__ static int64_t LandingRowBytes(const CombineParams& p) { return Fp8WireRowBytes(p.hidden); }
  __host__ __device__ static int Chunks(const CombineParams& p) {
    return (p.hidden + kChunkPieces * kFp8PieceElems - 1) / (kChunkPieces * kFp8PieceElems);
  }

  __device__ static void Push(const CombineParams& p, uint8_t* dst, const uint8_t* src, int lane) {
    const int pieces = (p.hidden + kQuantPieceElems - 1) / kQuantPieceElems;
    for (int piece = 0; piece < pieces; ++piece) QuantizeCombinePieceTo<T>(dst, src, p.hidden, piece, lane);
  }

  __device__ static void Sum(const CombineParams& p, int64_t t, int chunk, int32_t entry, int num_sources, int lane) {
    for (int piece = chunk * kChunkPieces; piece < (chunk + 1) * kChunkPieces; ++piece) {
      if (piece * kFp8PieceElems >= p.hidden) break;
      SumFp8Elems<T>(p, t, piece * kFp8PieceElems + lane * kFp8PullElems, entry, num_sources, true);
    }
  }

  // Zeros out (failed: every route dropped).
  __device__ static void WriteZeros(const CombineParams& p, int64_t first_item, int64_t item_stride) {
    PullItemsFp8<T>(p, true, first_item, item_stride);
  }
};

}  // namespace flashinfer_a2a
