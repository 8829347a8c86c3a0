// Combine: every rank publishes its experts' partial outputs in its own workspace; each token's owner pulls the
// partials of the ranks it sent the token to and sums them in increasing rank order, in fp32.
//
// Two kernels, because a kernel whose blocks all spin on peers could hold every multiprocessor while a peer
// simulated on the same GPU still needs one to publish:
//  1. CombinePublishKernel: copies the caller's partials into this rank's combine region (skipped when the expert
//     side wrote them there: zero copy); the last block to finish releases this rank's epoch to every peer, then
//     waits (bounded) until every peer has published — after which no peer still reads this epoch's dispatch data.
//  2. CombinePullKernel: one warp per (token, 32-vector piece of hidden); loads every source first, then adds.
// Over the FP8 wire (bf16|fp16), the publish kernel quantizes the rows for other ranks into FP8 values and fp32
// block scales over the front of their rows, and CombinePullFp8Kernel dequantizes them while summing. When every
// rank has a GPU of its own and the combine region has room for landing rows, CombinePushFp8Kernel instead pushes
// the quantized rows into their owners' workspaces and sums them as they land (see there).
// When every rank has a GPU of its own, the partials are already in place (zero copy) and the pull is small,
// CombineFusedKernel does both in one launch: one block publishes, every block waits for the peers, then pulls.
// Spinning blocks can then only delay this GPU's own work, which needs nothing from them.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "float_convert.cuh"
#include "protocol.cuh"
#include "quant_dispatch.cuh"

namespace flashinfer_a2a {

constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;

struct CombineParams {
  Ranks ranks;
  int32_t num_tokens;   // local tokens of the matching dispatch
  int32_t runtime_max;  // runtime_max_tokens_per_rank of the matching dispatch
  int32_t route_stride; // columns of the routing record
  int64_t routing_offset;
  int64_t combine_offset;      // combine region within every rank's workspace
  int64_t row_bytes;           // hidden * element bytes
  const uint8_t* input;        // [ep_size, runtime_max, hidden] to publish; null when already in the region
  int32_t input_vec_bytes;     // vector width for copying `input`
  const int32_t* recv_counts;  // [ep_size] valid rows per source block of `input`
  void* output;                // [num_tokens, hidden]
  uint64_t timeout_ns;
  bool fp8_wire;  // partials for other ranks travel as FP8 with a scale per 128 elements (bf16|fp16 only)
  bool fp16;      // fp16 partials, else bf16 (fp8_wire only)
  int32_t hidden;
  // Pushed FP8 wire (fp8_wire, one GPU per rank): each rank lands the rows it computed in their owners' workspaces.
  bool push;
  int64_t landing_offset;     // [ep_size (source), runtime_max, Fp8WireRowBytes(hidden)] in every workspace
  int64_t push_flags_offset;  // [ep_size (source), max_num_tokens] uint32 in every workspace
  int32_t max_num_tokens;
};

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
      uint8_t* dst = region + row * p.row_bytes;
      const uint32_t word = QuantizeCombinePiece<T>(dst, p.input + row * p.row_bytes, p.hidden, piece, lane);
      const int col = piece * kScalesPerPiece + lane;
      if (lane < kScalesPerPiece && col < cols) reinterpret_cast<uint32_t*>(dst + p.hidden)[col] = word;
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

template <int kVec>
__device__ __forceinline__ void CopyRow(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  using Vec = typename VecOf<kVec>::Type;
  for (int64_t off = lane * kVec; off < bytes; off += 32 * kVec) {
    *reinterpret_cast<Vec*>(dst + off) = *reinterpret_cast<const Vec*>(src + off);
  }
}

__device__ __forceinline__ void CopyRowAnyWidth(uint8_t* dst, const uint8_t* src, int64_t bytes, int vec, int lane) {
  switch (vec) {
    case 16: CopyRow<16>(dst, src, bytes, lane); break;
    case 8: CopyRow<8>(dst, src, bytes, lane); break;
    case 4: CopyRow<4>(dst, src, bytes, lane); break;
    case 2: CopyRow<2>(dst, src, bytes, lane); break;
    default: CopyRow<1>(dst, src, bytes, lane); break;
  }
}

// Tells every peer that this rank's combine input for `epoch` is in place (the block's threads share the stores).
__device__ __forceinline__ void PublishCombineEpoch(const CombineParams& p, uint32_t epoch) {
  for (int r = threadIdx.x; r < p.ranks.ep_size; r += kCombineThreads) {
    StoreReleaseSys(&p.ranks.Meta(r)->combine_signal[p.ranks.ep_rank], epoch);
  }
}

// Waits (bounded) until every peer has published `epoch`, recording a timeout per missing peer. Returns whether
// one of this thread's peers timed out; the acquires cover only this thread until a barrier extends them.
__device__ __forceinline__ bool WaitCombinePeers(const CombineParams& p, RankMetadata* meta, uint32_t epoch) {
  bool timed_out = false;
  for (int src = threadIdx.x; src < p.ranks.ep_size; src += kCombineThreads) {
    if (!WaitUntil([&] { return EpochReached(LoadAcquireSys(&meta->combine_signal[src]), epoch); },
                   p.timeout_ns)) {
      RecordError(meta, ErrorCode::kTimeout, Phase::kCombine, src, epoch, 0);
      timed_out = true;
    }
  }
  return timed_out;
}

__global__ void __launch_bounds__(kCombineThreads, 2) CombinePublishKernel(const __grid_constant__ CombineParams p) {
  const int ep_size = p.ranks.ep_size;
  RankMetadata* meta = p.ranks.MyMeta();
  if (HasFatalError(meta)) return;  // set by earlier kernels only: all blocks agree
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(&meta->combine_epoch) + 1;

  if (p.fp8_wire) {
    __shared__ float s_scales[kCombineWarps][kFp8WireMaxCols];
    if (p.fp16) {
      QuantizeRowsFp8<__half>(p, s_scales[threadIdx.x / 32]);
    } else {
      QuantizeRowsFp8<__nv_bfloat16>(p, s_scales[threadIdx.x / 32]);
    }
  } else if (p.input != nullptr) {
    const int warp = blockIdx.x * kCombineWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
    uint8_t* region = p.ranks.Base(p.ranks.ep_rank) + p.combine_offset;
    const int64_t rows = static_cast<int64_t>(ep_size) * p.runtime_max;
    for (int64_t row = warp; row < rows; row += static_cast<int64_t>(gridDim.x) * kCombineWarps) {
      if (row % p.runtime_max >= p.recv_counts[row / p.runtime_max]) continue;
      CopyRowAnyWidth(region + row * p.row_bytes, p.input + row * p.row_bytes, p.row_bytes, p.input_vec_bytes, lane);
    }
  }

  if (!ArriveLastBlock(&meta->blocks_done)) return;
  PublishCombineEpoch(p, epoch);
  WaitCombinePeers(p, meta, epoch);
  __syncthreads();
  if (threadIdx.x == 0) {
    meta->blocks_done = 0;
    meta->combine_epoch = epoch;
  }
}

constexpr int kCombineLoadBatch = 8;  // partials loaded before the first add: up to 8 NVLink reads in flight

// The pull of every (token, piece) item with index = first_item (mod item_stride), by warps.
// The ranks local token t went to, for a pull: lane j holds the j-th (rank, slot) entry of the routing record (-1
// past the last, or everywhere once the combine failed); `count` entries in all.
struct TokenSources {
  int32_t entry;
  int count;
};

__device__ __forceinline__ TokenSources LoadTokenSources(const CombineParams& p, bool failed, int64_t t, int lane) {
  const int32_t* routing = reinterpret_cast<const int32_t*>(p.ranks.Base(p.ranks.ep_rank) + p.routing_offset);
  const int32_t entry = (!failed && lane < p.route_stride) ? routing[t * p.route_stride + lane] : -1;
  return {entry, CountRoutes(entry, p.ranks.ep_size, p.runtime_max)};
}

template <typename T, int kVec>
__device__ __forceinline__ void PullItems(const CombineParams& p, bool failed, int64_t first_item,
                                          int64_t item_stride) {
  using Vec = typename VecOf<kVec>::Type;
  constexpr int kElems = kVec / sizeof(T);
  const int lane = threadIdx.x % 32;
  const int64_t piece_bytes = 32 * kVec;
  const int pieces = static_cast<int>((p.row_bytes + piece_bytes - 1) / piece_bytes);
  const int64_t items = static_cast<int64_t>(p.num_tokens) * pieces;
  const int64_t src_block = static_cast<int64_t>(p.ranks.ep_rank) * p.runtime_max;

  for (int64_t item = first_item; item < items; item += item_stride) {
    const int64_t t = item / pieces;
    const int64_t off = (item % pieces) * piece_bytes + lane * kVec;
    const auto [entry, num_sources] = LoadTokenSources(p, failed, t, lane);
    const bool active = off < p.row_bytes;  // the row's last piece may not need every lane

    float acc[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[e] = 0.0f;
    for (int j0 = 0; j0 < num_sources; j0 += kCombineLoadBatch) {
      Vec loaded[kCombineLoadBatch];
#pragma unroll
      for (int j = 0; j < kCombineLoadBatch; ++j) {
        const int32_t e = __shfl_sync(0xffffffffu, entry, (j0 + j) & 31);
        if (active && j0 + j < num_sources) {
          const int rank = RouteRank(e);
          const int64_t slot = RouteSlot(e);
          const uint8_t* src =
              p.ranks.Base(rank) + p.combine_offset + (src_block + slot) * p.row_bytes + off;
          loaded[j] = *reinterpret_cast<const Vec*>(src);
        }
      }
#pragma unroll
      for (int j = 0; j < kCombineLoadBatch; ++j) {
        if (active && j0 + j < num_sources) {
          const T* v = reinterpret_cast<const T*>(&loaded[j]);
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[e] += FloatConvert<T>::ToFloat(v[e]);
        }
      }
    }
    if (!active) continue;
    Vec out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < kElems; ++e) o[e] = FloatConvert<T>::FromFloat(acc[e]);
    *reinterpret_cast<Vec*>(static_cast<uint8_t*>(p.output) + t * p.row_bytes + off) = out;
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
        const uint8_t* row;
        if (own) {
          const uint8_t* region = p.input != nullptr ? p.input : p.ranks.Base(rank) + p.combine_offset;
          row = region + (src_block + RouteSlot(e)) * p.row_bytes;
        } else if (landed) {
          row = p.ranks.Base(p.ranks.ep_rank) + p.landing_offset +
                (static_cast<int64_t>(rank) * p.runtime_max + RouteSlot(e)) * landing_row_bytes;
        } else {
          row = p.ranks.Base(rank) + p.combine_offset + (src_block + RouteSlot(e)) * p.row_bytes;
        }
        if (own) {
          const uint4* v = reinterpret_cast<const uint4*>(row + e0 * sizeof(T));
          loaded[j][0] = v[0];
          if (full) loaded[j][1] = v[1];
          scale[j] = 0.0f;
        } else {
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
  const int cols = (p.hidden + quant::kFp8Block - 1) / quant::kFp8Block;
  constexpr int kScalesPerPiece = kQuantPieceElems / quant::kFp8Block;
  const uint8_t* region = p.input != nullptr ? p.input : p.ranks.Base(p.ranks.ep_rank) + p.combine_offset;
  const uint8_t* src = region + (static_cast<int64_t>(owner) * p.runtime_max + slot) * p.row_bytes;
  uint8_t* dst = p.ranks.Base(owner) + p.landing_offset +
                 (static_cast<int64_t>(p.ranks.ep_rank) * p.runtime_max + slot) * Fp8WireRowBytes(p.hidden);
  for (int piece = 0; piece < pieces; ++piece) {
    const uint32_t word = QuantizeCombinePiece<T>(dst, src, p.hidden, piece, lane);
    const int col = piece * kScalesPerPiece + lane;
    if (lane < kScalesPerPiece && col < cols) reinterpret_cast<uint32_t*>(dst + p.hidden)[col] = word;
  }
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

template <typename T, int kVec>
__global__ void __launch_bounds__(kCombineThreads) CombinePullKernel(const __grid_constant__ CombineParams p) {
  PullItems<T, kVec>(p, HasFatalError(p.ranks.MyMeta()), blockIdx.x * kCombineWarps + threadIdx.x / 32,
                     static_cast<int64_t>(gridDim.x) * kCombineWarps);
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kCombineThreads) CombineFusedKernel(const __grid_constant__ CombineParams p) {
  RankMetadata* meta = p.ranks.MyMeta();
  const int64_t first_item = blockIdx.x * kCombineWarps + threadIdx.x / 32;
  const int64_t item_stride = static_cast<int64_t>(gridDim.x) * kCombineWarps;
  if (HasFatalError(meta)) {  // set by earlier kernels only: all blocks agree; zeros out, like the pull
    PullItems<T, kVec>(p, true, first_item, item_stride);
    return;
  }
  const uint32_t epoch = *reinterpret_cast<volatile uint32_t*>(&meta->combine_epoch) + 1;
  // Whichever block runs first claims the epoch and publishes it: no block waits for another to be scheduled. The
  // partials were written by earlier kernels: the release covers them.
  __shared__ bool s_publisher;
  if (threadIdx.x == 0) s_publisher = atomicExch(&meta->combine_published, epoch) != epoch;
  __syncthreads();
  if (s_publisher) PublishCombineEpoch(p, epoch);
  // The barrier extends the acquires to the whole block: the peers' partials are visible to every warp.
  const bool failed = __syncthreads_or(WaitCombinePeers(p, meta, epoch)) != 0;
  PullItems<T, kVec>(p, failed, first_item, item_stride);
  // Every block has read the epoch once all have counted themselves: the last advances it. Only this GPU reads the
  // counter and the epoch, so device scope is enough.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&meta->blocks_done, 1u) == gridDim.x - 1) {
      meta->blocks_done = 0;
      meta->combine_epoch = epoch;
    }
  }
}

enum class FloatType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Calls fn.template operator()<T, kVec>() for the element type and vector width.
template <typename Fn>
inline cudaError_t DispatchPullKernel(FloatType type, int vec_bytes, Fn&& fn) {
  switch (type) {
    case FloatType::kBFloat16:
      switch (vec_bytes) {
        case 16: return fn.template operator()<__nv_bfloat16, 16>();
        case 8: return fn.template operator()<__nv_bfloat16, 8>();
        case 4: return fn.template operator()<__nv_bfloat16, 4>();
        default: return fn.template operator()<__nv_bfloat16, 2>();
      }
    case FloatType::kFloat16:
      switch (vec_bytes) {
        case 16: return fn.template operator()<__half, 16>();
        case 8: return fn.template operator()<__half, 8>();
        case 4: return fn.template operator()<__half, 4>();
        default: return fn.template operator()<__half, 2>();
      }
    default:
      switch (vec_bytes) {
        case 16: return fn.template operator()<float, 16>();
        case 8: return fn.template operator()<float, 8>();
        default: return fn.template operator()<float, 4>();
      }
  }
}

struct PullLauncher {
  const CombineParams& p;
  int blocks;
  bool fused;
  cudaStream_t stream;
  template <typename T, int kVec>
  cudaError_t operator()() const {
    if (fused) {
      CombineFusedKernel<T, kVec><<<blocks, kCombineThreads, 0, stream>>>(p);
    } else {
      CombinePullKernel<T, kVec><<<blocks, kCombineThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  }
};

struct PullPreloader {
  template <typename T, int kVec>
  cudaError_t operator()() const {
    cudaFuncAttributes attr;
    cudaError_t err = cudaFuncGetAttributes(&attr, CombinePullKernel<T, kVec>);
    return err == cudaSuccess ? cudaFuncGetAttributes(&attr, CombineFusedKernel<T, kVec>) : err;
  }
};

// pull_vec_bytes: vector width of the pull (16 down to one element), dividing row_bytes. one_gpu_per_rank: no two
// ranks share a GPU, so a zero-copy combine may run as one kernel whose blocks all wait for the peers.
inline cudaError_t LaunchCombine(const CombineParams& p, FloatType type, int pull_vec_bytes, int num_sms,
                                 bool one_gpu_per_rank, cudaStream_t stream) {
  if (p.push) {  // a block per work item at most: row groups of every peer's slots, then token groups
    const int64_t groups =
        static_cast<int64_t>(p.ranks.ep_size - 1) * ((p.runtime_max + kCombineWarps - 1) / kCombineWarps) +
        (p.num_tokens + kCombineWarps - 1) / kCombineWarps;
    const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_sms * 2, groups)));
    if (p.fp16) {
      CombinePushFp8Kernel<__half><<<blocks, kCombineThreads, 0, stream>>>(p);
    } else {
      CombinePushFp8Kernel<__nv_bfloat16><<<blocks, kCombineThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  }
  if (p.fp8_wire) pull_vec_bytes = kFp8PullElems * 2;  // bf16|fp16, 16 elements a lane
  const int64_t pieces = (p.row_bytes + 32 * pull_vec_bytes - 1) / (32 * pull_vec_bytes);
  const int64_t warps = static_cast<int64_t>(p.num_tokens) * pieces;
  const int pull_blocks = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(num_sms * 8, (warps + kCombineWarps - 1) / kCombineWarps)));
  // One kernel only while the pull fits in one wave: a larger grid spends more on every block waiting and counting
  // itself than the second launch costs (measured on 2x H200: 1.9 us saved at 1 token, 1.3 us lost at 1024).
  if (one_gpu_per_rank && p.input == nullptr && !p.fp8_wire && pull_blocks <= num_sms) {
    return DispatchPullKernel(type, pull_vec_bytes, PullLauncher{p, pull_blocks, true, stream});
  }
  // Zero copy needs one block (the signal); a copy gets a warp per row (per piece of a row when quantizing from a
  // partials tensor), up to two blocks per multiprocessor.
  const int64_t items = static_cast<int64_t>(p.ranks.ep_size) * p.runtime_max *
                        (p.fp8_wire && p.input != nullptr ? (p.hidden + kQuantPieceElems - 1) / kQuantPieceElems : 1);
  const int64_t copy_blocks = std::min<int64_t>(num_sms * 2, (items + kCombineWarps - 1) / kCombineWarps);
  const bool copies = p.input != nullptr || p.fp8_wire;
  const int publish_blocks = copies ? static_cast<int>(std::max<int64_t>(copy_blocks, 1)) : 1;
  CombinePublishKernel<<<publish_blocks, kCombineThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_tokens == 0) return err;
  if (p.fp8_wire) {
    if (p.fp16) {
      CombinePullFp8Kernel<__half><<<pull_blocks, kCombineThreads, 0, stream>>>(p);
    } else {
      CombinePullFp8Kernel<__nv_bfloat16><<<pull_blocks, kCombineThreads, 0, stream>>>(p);
    }
    return cudaGetLastError();
  }
  return DispatchPullKernel(type, pull_vec_bytes, PullLauncher{p, pull_blocks, false, stream});
}

inline cudaError_t GetCombineKernelAttributes() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, CombinePublishKernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePullFp8Kernel<__half>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePullFp8Kernel<__nv_bfloat16>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePushFp8Kernel<__half>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePushFp8Kernel<__nv_bfloat16>);
  for (FloatType type : {FloatType::kFloat32, FloatType::kBFloat16, FloatType::kFloat16}) {
    for (int vec : {16, 8, 4, 2}) {
      if (err == cudaSuccess) err = DispatchPullKernel(type, vec, PullPreloader{});
    }
  }
  return err;
}

}  // namespace flashinfer_a2a
