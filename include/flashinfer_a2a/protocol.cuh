// Device-side protocol pieces shared by the dispatch and combine kernels: addressing a rank's workspace, the error
// record, expert -> rank routing, grid completion and the bounded spin-wait.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ptx.cuh"
#include "wait_clock.cuh"
#include "workspace_layout.cuh"

namespace flashinfer_a2a {

// Where the ranks' workspaces are: row r of a [ep_size, bytes_per_rank] view addresses rank r's workspace, whether
// all rows live on one GPU (simulated ranks) or are peers' memory mapped into this address space.
struct Ranks {
  uint8_t* workspace;
  int64_t bytes_per_rank;
  int32_t ep_rank;
  int32_t ep_size;
  // No other rank runs on this GPU: the kernels let the next kernel of the stream be scheduled early (see
  // StartDependents). Where ranks share a GPU a block waiting to start holds a multiprocessor that a peer may need
  // to finish what this rank waits for, so they never do.
  bool own_gpu = false;

  __device__ __forceinline__ uint8_t* Base(int rank) const { return workspace + rank * bytes_per_rank; }
  __device__ __forceinline__ RankMetadata* Meta(int rank) const {
    return reinterpret_cast<RankMetadata*>(Base(rank));
  }
  __device__ __forceinline__ RankMetadata* MyMeta() const { return Meta(ep_rank); }
};

// Fatal errors leave the ranks out of step until the workspace is re-initialized; an invalid expert id does not.
__host__ __device__ constexpr bool IsFatal(int32_t code) {
  return code == static_cast<int32_t>(ErrorCode::kTimeout) ||
         code == static_cast<int32_t>(ErrorCode::kRuntimeMaxMismatch) ||
         code == static_cast<int32_t>(ErrorCode::kCallLayoutMismatch);
}

// Records the first error on this rank, except that a fatal error replaces a non-fatal one: the record then names
// what stopped the ranks.
__device__ inline void RecordError(RankMetadata* meta, ErrorCode code, Phase phase, int peer, uint32_t epoch,
                                   int64_t detail) {
  const int32_t wanted = static_cast<int32_t>(code);
  int32_t seen = 0;
  while (true) {
    const int32_t prev = atomicCAS(&meta->error.code, seen, wanted);
    if (prev == seen) break;                          // ours
    if (IsFatal(prev) || !IsFatal(wanted)) return;    // keep the earlier record
    seen = prev;                                      // replace a non-fatal record with this fatal one
  }
  meta->error.phase = static_cast<int32_t>(phase);
  meta->error.peer = peer;
  meta->error.epoch = epoch;
  meta->error.detail = detail;
  __threadfence();
}

__device__ __forceinline__ bool HasFatalError(const RankMetadata* meta) {
  return IsFatal(*reinterpret_cast<const volatile int32_t*>(&meta->error.code));
}

// Set of ranks (bit r = rank r), enough words for kMaxRanks.
constexpr int kRankMaskWords = (kMaxRanks + 31) / 32;
// Words are picked with selects, never indexed at run time, so a mask stays in registers.
static_assert(kRankMaskWords == 3, "RankMask::Word picks among three words");
static_assert(sizeof(RankMetadata::inactive_ranks) == kRankMaskWords * sizeof(uint32_t), "one word per 32 ranks");
struct RankMask {
  uint32_t words[kRankMaskWords];
  __device__ __forceinline__ uint32_t Word(int r) const { return r < 32 ? words[0] : r < 64 ? words[1] : words[2]; }
  __device__ __forceinline__ bool Has(int r) const { return (Word(r) >> (r & 31)) & 1u; }
  __device__ __forceinline__ void Add(int r) {
    const uint32_t bit = 1u << (r & 31);
    if (r < 32) {
      words[0] |= bit;
    } else if (r < 64) {
      words[1] |= bit;
    } else {
      words[2] |= bit;
    }
  }
};

// What a kernel reads first: the epoch it runs, whether an earlier fatal error stops it, and the ranks outside the
// active set (read here, not passed in, so that a graph replay follows the set in force). A dispatch (or its send
// half) starts a new epoch, one past the last dispatch's; the receive half of a dispatch and a combine run the epoch
// of the dispatch that ended before them. Every load is issued before any is used.
struct KernelStart {
  uint32_t epoch;
  bool fatal;
  RankMask inactive;
};
__device__ __forceinline__ KernelStart ReadKernelStart(const RankMetadata* meta, bool new_epoch) {
  const volatile uint32_t* words = meta->inactive_ranks;
  const uint32_t last = *reinterpret_cast<const volatile uint32_t*>(&meta->dispatch_epoch);
  const RankMask inactive = {{words[0], words[1], words[2]}};
  return {new_epoch ? last + 1 : last, HasFatalError(meta), inactive};
}

// A word a peer stores as (epoch << 32) | value: read with no ordering, it is this call's exactly when its epoch is.
__device__ __forceinline__ uint64_t Tagged(uint32_t epoch, uint32_t value) {
  return (static_cast<uint64_t>(epoch) << 32) | value;
}
__device__ __forceinline__ uint32_t TagOf(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
__device__ __forceinline__ uint32_t ValueOf(uint64_t word) { return static_cast<uint32_t>(word); }
__device__ __forceinline__ uint64_t LoadVolatile(const uint64_t* addr) {
  return *reinterpret_cast<const volatile uint64_t*>(addr);
}
__device__ __forceinline__ void StoreVolatile(uint64_t* addr, uint64_t value) {
  *reinterpret_cast<volatile uint64_t*>(addr) = value;
}

// Expert -> owning rank for a contiguous partition where the first `num_experts % ep_size` ranks own one extra.
// With a table (shared memory, filled by FillTable) a lookup replaces the integer divisions.
constexpr int kRankTableExperts = 1024;
struct ExpertPartition {
  int32_t num_experts;
  int32_t base;       // num_experts / ep_size (may be 0)
  int32_t remainder;  // num_experts % ep_size
  const uint8_t* table = nullptr;  // expert -> rank, when num_experts <= kRankTableExperts

  __host__ __device__ ExpertPartition(int32_t num_experts_, int32_t ep_size)
      : num_experts(num_experts_), base(num_experts_ / ep_size), remainder(num_experts_ % ep_size) {}

  __device__ __forceinline__ int Divide(int expert) const {
    const int big = remainder * (base + 1);  // experts owned by the ranks with one extra
    return expert < big ? expert / (base + 1) : remainder + (expert - big) / base;
  }

  // Requires 0 <= expert < num_experts.
  __device__ __forceinline__ int RankOf(int expert) const { return table != nullptr ? table[expert] : Divide(expert); }

  // Fills `shared` (kRankTableExperts bytes) with the whole block and points the partition at it; the caller
  // synchronizes the block before the first lookup.
  __device__ __forceinline__ void FillTable(uint8_t* shared) {
    if (num_experts > kRankTableExperts) return;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) shared[e] = static_cast<uint8_t>(Divide(e));
    table = shared;
  }
};
static_assert(kMaxRanks <= 256, "ExpertPartition's table holds ranks as bytes");

// The distinct ranks of token t's top-k experts, less the `inactive` ones (experts there are dropped, not moved). An
// id outside [-1, num_experts) is recorded as an error against this rank (unless meta is null) and skipped: it is
// never routed anywhere.
template <typename IdT>
__device__ __forceinline__ RankMask TokenRanks(const IdT* topk_ids, int64_t t, int top_k, const ExpertPartition& part,
                                               RankMetadata* meta, uint32_t epoch, const RankMask& inactive) {
  RankMask mask = {};
  for (int k = 0; k < top_k; ++k) {
    const int64_t id = static_cast<int64_t>(topk_ids[t * top_k + k]);
    if (id == -1) continue;
    if (id < -1 || id >= part.num_experts) {
      if (meta != nullptr) RecordError(meta, ErrorCode::kInvalidExpertId, Phase::kDispatch, -1, epoch, t * top_k + k);
      continue;
    }
    const int r = part.RankOf(static_cast<int>(id));
    if (!inactive.Has(r)) mask.Add(r);
  }
  return mask;
}

__device__ __forceinline__ int RouteRank(int32_t entry) { return entry >> kRouteSlotBits; }
__device__ __forceinline__ int32_t RouteSlot(int32_t entry) { return entry & ((1 << kRouteSlotBits) - 1); }

// A token's routing entries end at the first -1 (entries after it are left over from earlier dispatches) or at an
// entry that cannot come from a dispatch of this shape: a combine without its dispatch reads nothing outside the
// workspaces.
__device__ __forceinline__ bool RouteEnds(int32_t entry, int ep_size, int runtime_max) {
  return entry < 0 || RouteRank(entry) >= ep_size || RouteSlot(entry) >= runtime_max;
}

// Number of routing entries of a token, with lane k holding entry k (-1 for lanes past the record's width).
__device__ __forceinline__ int CountRoutes(int32_t entry, int ep_size, int runtime_max) {
  const uint32_t ended = __ballot_sync(0xffffffffu, RouteEnds(entry, ep_size, runtime_max));
  return ended == 0 ? 32 : __ffs(ended) - 1;
}

// Which of a token's `count` routes (lane k holds entry k, in increasing rank order) a rank stores to first: with
// more than two ranks, the first to a rank above its own, wrapping to the lowest after the highest. Were every rank
// to start at the lowest target, the first share of every rank's rows would head to the same GPU at once, whose
// links then take them while the others' wait; starting after itself, each rank heads for another one. 4 H100s,
// dispatch then combine of the slowest rank: 128 tokens 47.9 -> 44.7 us, 1024 tokens 258.1 -> 253.4, the FP8 and
// NVFP4 dispatches 0.4-1.8 us faster at 128 tokens; 16, 64 and 8192 tokens unchanged. With two ranks there is one
// peer, and rank order (rank 0's own rows before its peer's) stayed faster (0.3-0.5 us at 16 and 128 tokens).
__device__ __forceinline__ int FirstRouteAfterOwn(int32_t entry, int count, const Ranks& ranks, int lane) {
  if (ranks.ep_size <= 2) return 0;
  const int up_to_own = __popc(__ballot_sync(0xffffffffu, lane < count && RouteRank(entry) <= ranks.ep_rank));
  return up_to_own < count ? up_to_own : 0;
}
__device__ __forceinline__ int NextRoute(int j, int count) { return j + 1 < count ? j + 1 : 0; }

// Whether each token may go to more than two ranks (top_k and ep_size both above 2) over links of their own (a GPU
// per rank). Then the links carry a copy faster with fewer transfers in flight than a kernel filling the whole GPU
// issues (a token's row is stored to, or summed from, up to min(top_k, ep_size) ranks at once), and the dispatch
// and combine launch narrower on the whole GPU (DispatchLaunchShapeFor, OwnGpuPullWarps); under an SM budget their
// grids are narrow already. Measured on 4 H100s of one NVSwitch host; with 2 ranks the full-width launches stayed
// as fast or faster.
__host__ __device__ constexpr bool WideFanOut(int top_k, int ep_size, bool one_gpu_per_rank) {
  return one_gpu_per_rank && top_k > 2 && ep_size > 2;
}

// Counts the calling block in, once per block, after a barrier the caller has passed; exactly one block (the last
// to arrive, whichever it is) gets true. kAcqRel: the count is an acquire-release atomic at GPU scope (a grid of one
// block fences instead; ArriveLastBlock); otherwise a relaxed one that only elects the block, for blocks that
// release their stores themselves (the dispatch's arrivals).
template <bool kAcqRel>
__device__ __forceinline__ bool CountLastBlock(uint32_t* blocks_done) {
  __shared__ bool is_last;
  if (gridDim.x == 1) {
    if constexpr (kAcqRel) FenceAcqRelGpu();
    return true;
  }
  if (threadIdx.x == 0) {
    is_last = (kAcqRel ? AtomicAddAcqRelGpu(blocks_done, 1u) : atomicAdd(blocks_done, 1u)) == gridDim.x - 1;
  }
  __syncthreads();
  return is_last;
}

// Grid completion: every block calls this once after its stores; exactly one block (the last to arrive, whichever
// it is) gets true, and every store of the grid is then performed at GPU scope for each of its threads. The count is
// one acquire-release atomic at GPU scope: its release waits for the block's stores (and those the barrier ordered
// before it), and its acquire makes every earlier block's stores visible to the last one. A grid of one block fences
// instead. GPU scope is enough for the stores into this GPU's own memory, which peers read through its L2 (a signal
// that covers them may then be relaxed: PublishCombineEpoch); stores into a peer's memory need a system-scope release
// of their own (the pushed combine releases each row's flag).
__device__ __forceinline__ bool ArriveLastBlock(uint32_t* blocks_done) {
  __syncthreads();
  return CountLastBlock</*kAcqRel=*/true>(blocks_done);
}

// True when epoch `seen` has reached `wanted` (wrap-safe).
__device__ __forceinline__ bool EpochReached(uint32_t seen, uint32_t wanted) {
  return static_cast<int32_t>(seen - wanted) >= 0;
}

// Spins until `ready()` or the timeout (counted by WaitClock). Returns false on timeout.
template <typename Ready>
__device__ __forceinline__ bool WaitUntil(Ready ready, uint64_t timeout_ns) {
  if (ready()) return true;
  WaitClock clock(GlobalTimerNs());
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
    }
    if (clock.Expired(GlobalTimerNs(), timeout_ns)) return ready();
  }
}

}  // namespace flashinfer_a2a
