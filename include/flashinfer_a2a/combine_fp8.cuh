// The FP8 wire of combine (bf16|fp16 partials): the quantizing side, the dequantizing sums, and the pushed
// one-kernel combine. Used by the launchers in combine.cuh.
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
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) {
    float x[kQuantLaneElems];
    UnpackLaneElems<T>(raw[u], x);
    lq[u] = QuantizeLane<QuantFormat::kFp8Block>(x, 0.0f);
    if (e0[u] < hidden) StoreLaneValues<QuantFormat::kFp8Block>(dst, e0[u], hidden, true, lq[u]);
  }
  return GatherPieceScales<QuantFormat::kFp8Block>(lq, lane);
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
  const int warp = blockIdx.x * kCombineWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t num_warps = static_cast<int64_t>(gridDim.x) * kCombineWarps;
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
        const bool own = rank == p.ranks.ep_rank;
        if (own) {
          const uint8_t* region = p.input != nullptr ? p.input : p.ranks.Base(rank) + p.combine_offset;
          const uint4* v = reinterpret_cast<const uint4*>(region + (src_block + RouteSlot(e)) * p.row_bytes +
                                                          e0 * sizeof(T));
          loaded[j][0] = v[0];
          if (full) loaded[j][1] = v[1];
          scale[j] = 0.0f;
        } else {
          const uint8_t* row =
              landed ? p.ranks.Base(p.ranks.ep_rank) + p.landing_offset +
                           (static_cast<int64_t>(rank) * p.runtime_max + RouteSlot(e)) * landing_row_bytes
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
  PullItemsFp8<T>(p, HasFatalError(p.ranks.MyMeta()), blockIdx.x * kCombineWarps + threadIdx.x / 32,
                  static_cast<int64_t>(gridDim.x) * kCombineWarps);
}

// The pushed FP8 wire: one kernel whose blocks claim work from a counter in this rank's metadata, one row (or one
// token) per warp. Push items come first, row groups of every owner taken in slot order: a warp quantizes the row
// this rank computed into the owner's landing block for this rank, then releases the row's push flag there (the
// epoch). Reduce items follow, local tokens in order: a warp waits for the flags of its token's remote rows, then
// sums them (SumFp8Elems) while later rows are still being pushed. A warp waits only once every push item is
// claimed, and claimed items always finish, so the peers' waits end without any assumption about scheduling. The
// pushes wait for nothing: an owner's landing block is free once this rank has its dispatch signal, as the owner's
// previous combine finished before that dispatch began. Each rank publishes its combine epoch on entry and the
// last block waits for every peer's, as the pull does: only then may the next dispatch overwrite a peer's
// receive region, even that of a peer that pushed nothing here.
__device__ __forceinline__ uint32_t* PushFlags(const CombineParams& p, int rank, int src) {
  return reinterpret_cast<uint32_t*>(p.ranks.Base(rank) + p.push_flags_offset) +
         static_cast<int64_t>(src) * p.max_num_tokens;
}

template <typename T>
__device__ __forceinline__ void PushFp8Row(const CombineParams& p, int owner, int64_t slot, uint32_t epoch,
                                           int lane) {
  const int pieces = (p.hidden + kQuantPieceElems - 1) / kQuantPieceElems;
  const uint8_t* region = p.input != nullptr ? p.input : p.ranks.Base(p.ranks.ep_rank) + p.combine_offset;
  const uint8_t* src = region + (static_cast<int64_t>(owner) * p.runtime_max + slot) * p.row_bytes;
  uint8_t* dst = p.ranks.Base(owner) + p.landing_offset +
                 (static_cast<int64_t>(p.ranks.ep_rank) * p.runtime_max + slot) * Fp8WireRowBytes(p.hidden);
  for (int piece = 0; piece < pieces; ++piece) QuantizeCombinePieceTo<T>(dst, src, p.hidden, piece, lane);
  __syncwarp();  // the release below covers every lane's stores
  if (lane == 0) StoreReleaseSys(PushFlags(p, owner, p.ranks.ep_rank) + slot, epoch);
}

template <typename T>
__device__ __forceinline__ void ReduceFp8Token(const CombineParams& p, RankMetadata* meta, int64_t t, uint32_t epoch,
                                               int lane) {
  const auto [entry, num_sources] = LoadTokenSources(p, false, t, lane);
  const int rank = RouteRank(entry);
  if (lane < num_sources && rank != p.ranks.ep_rank) {
    const uint32_t* flag = PushFlags(p, p.ranks.ep_rank, rank) + RouteSlot(entry);
    if (!WaitUntil([&] { return EpochReached(LoadAcquireSys(flag), epoch) || HasFatalError(meta); }, p.timeout_ns)) {
      RecordError(meta, ErrorCode::kTimeout, Phase::kCombine, rank, epoch, 0);
    }
  }
  __syncwarp();  // extends the lanes' acquires to the whole warp
  const int pieces = (p.hidden + kFp8PieceElems - 1) / kFp8PieceElems;
  for (int piece = 0; piece < pieces; ++piece) {
    SumFp8Elems<T>(p, t, piece * kFp8PieceElems + lane * kFp8PullElems, entry, num_sources, true);
  }
}

template <typename T>
__global__ void __launch_bounds__(kCombineThreads, 2) CombinePushFp8Kernel(const __grid_constant__ CombineParams p) {
  RankMetadata* meta = p.ranks.MyMeta();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (HasFatalError(meta)) {  // set by earlier kernels only: all blocks agree; zeros out, like the pull
    PullItemsFp8<T>(p, true, blockIdx.x * kCombineWarps + warp, static_cast<int64_t>(gridDim.x) * kCombineWarps);
    return;
  }
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(&meta->combine_epoch) + 1;
  const int me = p.ranks.ep_rank, peers = p.ranks.ep_size - 1;
  __shared__ bool s_publisher;
  __shared__ int s_max_rows;
  __shared__ uint32_t s_item;
  if (threadIdx.x == 0) {
    s_publisher = atomicExch(&meta->combine_published, epoch) != epoch;
    s_max_rows = 0;
  }
  __syncthreads();
  if (s_publisher) PublishCombineEpoch(p, epoch);
  for (int r = threadIdx.x; r < p.ranks.ep_size; r += kCombineThreads) {
    if (r != me) atomicMax(&s_max_rows, p.recv_counts[r]);
  }
  __syncthreads();
  // Item i < push_items: row group i / peers (kCombineWarps slots) of owner (me + 1 + i % peers) % ep_size.
  const int64_t push_items = static_cast<int64_t>(peers) * ((s_max_rows + kCombineWarps - 1) / kCombineWarps);
  const int64_t items = push_items + (p.num_tokens + kCombineWarps - 1) / kCombineWarps;
  while (true) {
    if (threadIdx.x == 0) s_item = atomicAdd(&meta->combine_claim, 1u);
    __syncthreads();
    const int64_t item = s_item;
    __syncthreads();  // every warp has read s_item before the next claim
    if (item >= items) break;
    if (item < push_items) {
      const int owner = (me + 1 + static_cast<int>(item % peers)) % p.ranks.ep_size;
      const int64_t slot = item / peers * kCombineWarps + warp;
      if (slot < p.recv_counts[owner]) PushFp8Row<T>(p, owner, slot, epoch, lane);
    } else {
      const int64_t t = (item - push_items) * kCombineWarps + warp;
      if (t < p.num_tokens) ReduceFp8Token<T>(p, meta, t, epoch, lane);
    }
  }
  if (!ArriveLastBlock(&meta->blocks_done)) return;
  WaitCombinePeers(p, meta, epoch);
  __syncthreads();
  if (threadIdx.x == 0) {
    meta->blocks_done = 0;
    meta->combine_claim = 0;
    meta->combine_epoch = epoch;
  }
}

}  // namespace flashinfer_a2a
