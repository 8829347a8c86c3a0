// What the combine kernels share: their parameters, a warp's row copy, the epoch handshake with the peers, the
// routing preamble of a token's sum and the sum of plain (unquantized) rows (see combine.cuh for the kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "float_convert.cuh"
#include "protocol.cuh"

namespace flashinfer_a2a {

constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;
// The one-kernel combine's blocks grow up to this many threads when its grid is capped (FusedCombineFor).
constexpr int kFusedCombineMaxThreads = 1024;
// The one-kernel combine over the FP8 wire: blocks of kCombineWarps up to this many warps (FusedFp8CombineFor).
constexpr int kFusedFp8MaxWarps = 16;
constexpr int kReduceChunkBytes = 4096;  // output bytes of one reduce item of the pushed combine
// The one-kernel combine lets every block publish while that makes at most this many signal stores (blocks x ranks).
constexpr int kCombinePublishAllStores = 128;

// What one combine launch sequence does: all of it, the send (copy and publish this rank's partials, no wait) or the
// receive (wait for the peers' partials, then sum). Values are shared with Python (flashinfer_a2a.split_phase).
enum class CombinePhase : int32_t { kBoth = 0, kSend = 1, kRecv = 2 };

struct CombineParams {
  Ranks ranks;
  CombinePhase phase;
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
  // Pushed combine (one GPU per rank, see combine_push.cuh): each rank lands the rows it computed in their owners'
  // workspaces, as they are or (fp8_wire) quantized.
  bool push;
  int64_t landing_offset;     // [ep_size (source), runtime_max, landing row] in every workspace (LandingRowBytes)
  int64_t push_flags_offset;  // [ep_size (source), max_num_tokens] uint32 in every workspace
  int32_t max_num_tokens;
};

// Where this rank's partials are: the caller's tensor, or its own combine region (zero copy).
__device__ __forceinline__ const uint8_t* OwnPartials(const CombineParams& p) {
  return p.input != nullptr ? p.input : p.ranks.Base(p.ranks.ep_rank) + p.combine_offset;
}

// Rank `owner`'s landing row (of `row_bytes`) for the partial rank `src` computed for owner's token slot `slot`.
__device__ __forceinline__ uint8_t* LandingRow(const CombineParams& p, int owner, int src, int64_t slot,
                                               int64_t row_bytes) {
  return p.ranks.Base(owner) + p.landing_offset + (static_cast<int64_t>(src) * p.runtime_max + slot) * row_bytes;
}

// One warp copies a row of `bytes` (a multiple of kVec), kVec bytes a lane, with kBatch loads in flight before
// their stores: the publish kernel's copy into the combine region and the pushed combine's rows.
template <int kVec>
__device__ __forceinline__ void CopyRow(uint8_t* dst, const uint8_t* src, int64_t bytes, int lane) {
  using Vec = typename VecOf<kVec>::Type;
  constexpr int kBatch = 4;
  const int64_t n = bytes / kVec;
  const Vec* in = reinterpret_cast<const Vec*>(src);
  Vec* out = reinterpret_cast<Vec*>(dst);
  for (int64_t i0 = lane; i0 < n; i0 += 32 * kBatch) {
    Vec v[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (i0 + 32 * j < n) v[j] = in[i0 + 32 * j];
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (i0 + 32 * j < n) out[i0 + 32 * j] = v[j];
    }
  }
}

// Tells every peer that this rank's combine input for `epoch` is in place and that this rank reads no more of the
// epoch's dispatch rows (the block's threads share the stores). That input lies in this rank's own memory, whose L2
// serves every reader, the peers' loads over NVLink included, and every row of it is performed at GPU scope by now:
// - rows written, and dispatch rows read, by earlier kernels: they completed before this kernel passed
//   WaitPriorKernels;
// - rows this kernel copied or quantized: every block counted itself in with a GPU-scope release, or a grid of one
//   block fenced (ArriveLastBlock), before the last block signals.
// So the signal is a relaxed store, as NCCL posts a step that covers no store of its own: a release (or an
// acquire-release count at system scope before it) adds MEMBAR.SYS, about 1.5 us on H100 with nothing outstanding.
// 2 H100s, pair of the slowest rank (the pulled one-kernel combine), release -> relaxed: 1 token 12.0 -> 10.6 us, 16
// tokens 13.1 -> 11.6, 64 tokens 17.1 -> 15.7, 128 tokens 23.0 -> 21.5, 1024 tokens 99.7 -> 98.4. One block
// releasing for the grid instead of every block was no faster (the cost is the barrier's own, not contention), nor
// was fence.release.sys (the same MEMBAR.SYS).
// Inactive ranks are neither told nor waited for.
__device__ __forceinline__ void PublishCombineEpoch(const CombineParams& p, uint32_t epoch, const RankMask& inactive) {
  for (int r = threadIdx.x; r < p.ranks.ep_size; r += blockDim.x) {
    if (!inactive.Has(r)) StoreRelaxedSys(&p.ranks.Meta(r)->combine_signal[p.ranks.ep_rank], epoch);
  }
}

// Waits (bounded) until every peer has published `epoch`, recording a timeout per missing peer. Returns whether
// one of this thread's peers timed out; the acquires cover only this thread until a barrier extends them.
__device__ __forceinline__ bool WaitCombinePeers(const CombineParams& p, RankMetadata* meta, uint32_t epoch,
                                                 const RankMask& inactive) {
  bool timed_out = false;
  for (int src = threadIdx.x; src < p.ranks.ep_size; src += blockDim.x) {
    if (inactive.Has(src)) continue;
    if (!WaitUntil([&] { return EpochReached(LoadAcquireSys(&meta->combine_signal[src]), epoch); },
                   p.timeout_ns)) {
      RecordError(meta, ErrorCode::kTimeout, Phase::kCombine, src, epoch, 0);
      timed_out = true;
    }
  }
  return timed_out;
}

// The ranks local token t went to, for a pull: lane j holds the j-th (rank, slot) entry of the routing record (-1
// past the last, or everywhere once the combine failed); `count` entries in all.
struct TokenSources {
  int32_t entry;
  int count;
};

// Lane j's entry alone: counting the entries waits for the load, so a prefetch takes only this.
__device__ __forceinline__ int32_t LoadRouteEntry(const CombineParams& p, bool failed, int64_t t, int lane) {
  const int32_t* routing = reinterpret_cast<const int32_t*>(p.ranks.Base(p.ranks.ep_rank) + p.routing_offset);
  return (!failed && lane < p.route_stride) ? routing[t * p.route_stride + lane] : -1;
}

__device__ __forceinline__ TokenSources LoadTokenSources(const CombineParams& p, bool failed, int64_t t, int lane) {
  const int32_t entry = LoadRouteEntry(p, failed, t, lane);
  return {entry, CountRoutes(entry, p.ranks.ep_size, p.runtime_max)};
}

constexpr int kCombineLoadBatch = 8;  // partials loaded before the first add: up to 8 NVLink reads in flight

// Bytes of one pull item: a warp's 32 lanes times kVecs vectors of kVec bytes. A wide item (kVecs 2, 16-byte
// vectors only) halves the items of a large pull, so that each warp has fewer of them in turn (PullVecsFor).
template <int kVec, int kVecs>
constexpr int64_t kPullItemBytes = int64_t{32} * kVec * kVecs;

// One lane's kVecs vectors of kVec bytes, from byte offset `off` of token t's row 32 * kVec bytes apart, of the
// sum over its `num_sources` routes (lane j of `entry` holds the j-th), added in increasing rank order in fp32.
// This rank's own partial is read from the caller's partials (or the combine region when zero copy); a remote one
// from that rank's combine region (pulled) or from this rank's landing block for that rank (`landed`: pushed).
// 8 vectors a lane are loaded before their adds (8 sources, or 4 of a wide item). Lanes past the row's end only
// take part in shuffles.
template <typename T, int kVec, int kVecs = 1>
__device__ __forceinline__ void SumPlainElems(const CombineParams& p, int64_t t, int64_t off, int32_t entry,
                                              int num_sources, bool landed) {
  using Vec = typename VecOf<kVec>::Type;
  constexpr int kElems = kVec / sizeof(T);
  constexpr int kBatch = kCombineLoadBatch / kVecs;
  const int64_t src_block = static_cast<int64_t>(p.ranks.ep_rank) * p.runtime_max;
  bool active[kVecs];
  float acc[kVecs][kElems];
#pragma unroll
  for (int u = 0; u < kVecs; ++u) {
    active[u] = off + u * 32 * kVec < p.row_bytes;
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[u][e] = 0.0f;
  }
  for (int j0 = 0; j0 < num_sources; j0 += kBatch) {
    Vec loaded[kBatch][kVecs];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int32_t e = __shfl_sync(0xffffffffu, entry, (j0 + j) & 31);
      if (active[0] && j0 + j < num_sources) {
        const int rank = RouteRank(e);
        const uint8_t* row;
        if (rank == p.ranks.ep_rank) {
          row = OwnPartials(p) + (src_block + RouteSlot(e)) * p.row_bytes;
        } else if (landed) {
          row = LandingRow(p, p.ranks.ep_rank, rank, RouteSlot(e), p.row_bytes);
        } else {
          row = p.ranks.Base(rank) + p.combine_offset + (src_block + RouteSlot(e)) * p.row_bytes;
        }
#pragma unroll
        for (int u = 0; u < kVecs; ++u) {
          if (active[u]) loaded[j][u] = *reinterpret_cast<const Vec*>(row + off + u * 32 * kVec);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      if (j0 + j >= num_sources) continue;
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        if (!active[u]) continue;
        const T* v = reinterpret_cast<const T*>(&loaded[j][u]);
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[u][e] += FloatConvert<T>::ToFloat(v[e]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < kVecs; ++u) {
    if (!active[u]) continue;
    Vec out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < kElems; ++e) o[e] = FloatConvert<T>::FromFloat(acc[u][e]);
    *reinterpret_cast<Vec*>(static_cast<uint8_t*>(p.output) + t * p.row_bytes + off + u * 32 * kVec) = out;
  }
}

// Lane k's routing entry of the token of the pull's item `item` (-1 past the record or the items): loaded by the
// one-kernel combine before it waits for the peers, so that the load is not on the critical path.
template <int kVec, int kVecs>
__device__ __forceinline__ int32_t PrefetchRoute(const CombineParams& p, int64_t item, int lane) {
  constexpr int64_t kItem = kPullItemBytes<kVec, kVecs>;
  const int pieces = static_cast<int>((p.row_bytes + kItem - 1) / kItem);
  if (item >= static_cast<int64_t>(p.num_tokens) * pieces || lane >= p.route_stride) return -1;
  const int32_t* routing = reinterpret_cast<const int32_t*>(p.ranks.Base(p.ranks.ep_rank) + p.routing_offset);
  return routing[item / pieces * p.route_stride + lane];
}

// The pull of every (token, kPullItemBytes) item with index = first_item (mod item_stride), a warp per item.
// `first_entry`: the first item's routing entry when prefetched (PrefetchRoute), else null. Each item's routing
// entry is loaded while the previous item's partials are summed, so a warp with several items waits for one round
// trip per item, not two.
template <typename T, int kVec, int kVecs = 1>
__device__ __forceinline__ void PullItems(const CombineParams& p, bool failed, int64_t first_item,
                                          int64_t item_stride, const int32_t* first_entry = nullptr) {
  constexpr int64_t kItem = kPullItemBytes<kVec, kVecs>;
  const int lane = threadIdx.x % 32;
  const int pieces = static_cast<int>((p.row_bytes + kItem - 1) / kItem);
  const int64_t items = static_cast<int64_t>(p.num_tokens) * pieces;
  if (first_item >= items) return;
  int32_t next = first_entry == nullptr ? LoadRouteEntry(p, failed, first_item / pieces, lane)
                 : failed                ? -1
                                         : *first_entry;
  for (int64_t item = first_item; item < items; item += item_stride) {
    const int32_t entry = next;
    if (item + item_stride < items) next = LoadRouteEntry(p, failed, (item + item_stride) / pieces, lane);
    SumPlainElems<T, kVec, kVecs>(p, item / pieces, (item % pieces) * kItem + lane * kVec, entry,
                                  CountRoutes(entry, p.ranks.ep_size, p.runtime_max), false);
  }
}

}  // namespace flashinfer_a2a
