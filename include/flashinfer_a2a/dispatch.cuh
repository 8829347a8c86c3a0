// Dispatch: push each local token to every distinct rank that holds one of its top-k experts.
//
// One kernel, three steps per block:
//  1. route: slots are deterministic — token t's slot on rank r is the number of earlier local tokens also sent to
//     r. Each block owns a contiguous chunk of tokens and counts the tokens before it itself (no block waits on
//     another, so nothing depends on the order blocks are scheduled in), then ranks its own chunk with ballots.
//     The (rank, slot) list of each token goes into the routing record for combine.
//  2. copy: warps copy row pieces, loading each source vector once and storing it to every target rank, beginning
//     with the first rank after this one (FirstRouteAfterOwn). Rows smaller than one warp store (the top-k ids and
//     weights, block scales) go a group of tokens per warp, so that consecutive slots of a target are written by one
//     store instruction instead of a short write each.
//  3. every block tells every rank, with one system-scope release add, that it has arrived and how many of its tokens
//     it sent there; the last block to finish (by a completion counter, not by block index) then waits — bounded —
//     until every peer's blocks have all arrived, and clears its arrival words for the next dispatch.
// Only one block per rank ever spins, so ranks simulated on one GPU (each on its own stream) cannot starve each
// other of multiprocessors.
// Split phase (DispatchPhase): the send kernel stops after step 3's arrivals, and advances the epoch; the receive is a
// kernel of one block (DispatchRecvKernel) that waits for the peers' counts of that epoch. Between the two the
// stream is free for other work, and nothing of this dispatch holds a multiprocessor.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "protocol.cuh"
#include "quant_dispatch.cuh"

namespace flashinfer_a2a {

constexpr int kDispatchThreads = 512;
constexpr int kDispatchWarps = kDispatchThreads / 32;
constexpr int kDispatchPieceVectors = 4;  // vectors per lane per piece: 4 independent 16-byte loads in flight
constexpr int kWideFanOutPieceVectors = 2;  // the same for 16-byte vectors where tokens fan out wide (WideFanOut)
constexpr int kSmallGroupVectors = 64;  // vectors of one group of small rows: two loads in flight per lane
// Blocks per multiprocessor. The quantizing kernels are bound by instructions (Nsight Compute: 0.52 issued per
// scheduler per cycle with 4 warps each), so they run two blocks, 32 warps, in 64 registers a thread (spilling a
// little). One H200, one rank, 8192 tokens: FP8 106.9 -> 89.6 us, MXFP8 89.0 -> 81.1, NVFP4 130.7 -> 125.2; at 128
// tokens 0.1-0.3 us slower. The plain copy keeps one block and its registers.
constexpr int DispatchBlocksPerSm(QuantFormat f) { return f == QuantFormat::kNone ? 1 : 2; }
// Small rows are grouped only where blocks own this many tokens or more: with fewer, a group is barely wider than
// one row, and the per-token copy is quicker (h200, one rank, one token: 8.4 us against 9.0 us).
constexpr int kSmallGroupMinTokens = 4;

// Rows are copied in vectors of 16, 4 or 1 bytes (the widest dividing the row and its alignment; 8 and 2 round down):
// every copy variant more is code that short calls pay to fetch.
__host__ __device__ constexpr int32_t CopyVecBytes(int32_t vec_bytes) {
  return vec_bytes >= 16 ? 16 : vec_bytes >= 4 ? 4 : 1;
}

// What one launch does: the whole dispatch, or one of its halves (send: steps 1-3 up to the publish; receive: the
// wait for the peers' counts). The same values as CombinePhase, which the library exports to Python.
enum class DispatchPhase : int32_t { kBoth = 0, kSend = 1, kRecv = 2 };

struct DispatchParams {
  Ranks ranks;
  DispatchPhase phase;  // kBoth or kSend: DispatchKernel; kRecv: DispatchRecvKernel
  int32_t num_tokens;   // local tokens, <= runtime_max
  int32_t runtime_max;  // runtime_max_tokens_per_rank: rows per source block on the receiver
  int32_t top_k;        // columns of topk_ids
  int32_t route_stride; // columns of the routing record (the workspace's top_k capacity)
  int32_t num_experts;
  const void* topk_ids;  // [num_tokens, top_k] int32|int64
  int32_t num_payloads;
  int32_t pieces_per_token;  // sum of pieces[p]
  const uint8_t* payload[kMaxPayloads];  // [num_tokens, row_bytes[p]]
  int64_t row_bytes[kMaxPayloads];
  int64_t recv_offset[kMaxPayloads];  // receive region of payload p within every rank's workspace
  int32_t vec_bytes[kMaxPayloads];
  int32_t piece_vectors;  // vectors a lane per piece of 16-byte vectors (DispatchLaunchShapeFor)
  int32_t pieces[kMaxPayloads];       // ceil(row_bytes / PieceBytes(vec_bytes)); 0 when small
  // Small payloads (rows under one warp store, 32 * vec_bytes) are copied a group of tokens at a time.
  int32_t num_small;
  int32_t small_payload[kMaxPayloads];  // their indices
  int32_t small_group[kMaxPayloads];    // tokens per group: at most kSmallGroupVectors vectors
  DispatchQuant quant;  // format kNone: every payload is copied; otherwise payload 0 is quantized (its pieces are
                        // kQuantPieceElems elements; row_bytes and recv_offset of payload 0 are unused)
  int64_t routing_offset;
  int32_t* recv_counts;  // [ep_size] out: tokens received from each source rank
  const int32_t* eplb_local;  // [eplb_experts] int32 EPLB statistics sent to every active rank; null: none
  int32_t eplb_experts;
  int64_t eplb_offset;        // the EPLB region ([ep_size, kMaxEplbExperts] int32) within every rank's workspace
  uint64_t timeout_ns;
  uint64_t call_layout;  // fingerprint of this call's layout (workspace_layout.cuh), compared with every peer's

  // Bytes of one piece of a row copied in vectors of vec_bytes.
  __host__ __device__ int64_t PieceBytes(int32_t vec_bytes) const {
    return int64_t{32} * (vec_bytes == 16 ? piece_vectors : kDispatchPieceVectors) * vec_bytes;
  }
};

// Token t's routing entries: lane k holds its k-th (rank, slot) entry; returns how many there are.
__device__ __forceinline__ int LoadRoutes(const DispatchParams& p, const int32_t* routing, int64_t t, int lane,
                                          int32_t& entry) {
  entry = lane < p.route_stride ? routing[t * p.route_stride + lane] : -1;
  return CountRoutes(entry, p.ranks.ep_size, p.runtime_max);
}

// Copies piece `piece` (kPieceVectors vectors a lane) of token t's row of payload pp to each rank the token goes
// to. The row's loads are issued before the routing entries are read, so the two round trips overlap.
template <int kVec, int kPieceVectors>
__device__ __forceinline__ void CopyPiece(const DispatchParams& p, const int32_t* routing, int pp, int piece,
                                          int64_t t, int lane) {
  using Vec = typename VecOf<kVec>::Type;
  const int64_t row = p.row_bytes[pp];
  const int64_t begin = static_cast<int64_t>(piece) * 32 * kPieceVectors * kVec;
  const uint8_t* src = p.payload[pp] + t * row;
  Vec v[kPieceVectors];
#pragma unroll
  for (int u = 0; u < kPieceVectors; ++u) {
    const int64_t off = begin + (u * 32 + lane) * kVec;
    if (off < row) v[u] = *reinterpret_cast<const Vec*>(src + off);
  }
  int32_t entry;
  const int num_targets = LoadRoutes(p, routing, t, lane, entry);
  const int64_t src_block = static_cast<int64_t>(p.ranks.ep_rank) * p.runtime_max;
  int j = FirstRouteAfterOwn(entry, num_targets, p.ranks, lane);
  for (int i = 0; i < num_targets; ++i, j = NextRoute(j, num_targets)) {
    const int32_t e = __shfl_sync(0xffffffffu, entry, j);
    const int rank = RouteRank(e);
    const int64_t slot = RouteSlot(e);
    uint8_t* dst = p.ranks.Base(rank) + p.recv_offset[pp] + (src_block + slot) * row;
#pragma unroll
    for (int u = 0; u < kPieceVectors; ++u) {
      const int64_t off = begin + (u * 32 + lane) * kVec;
      if (off < row) *reinterpret_cast<Vec*>(dst + off) = v[u];
    }
  }
}

template <QuantFormat F>
__device__ __forceinline__ void DispatchCopyPiece(const DispatchParams& p, const int32_t* routing, int pp, int piece,
                                                  int64_t t, int lane, const float* nvfp4_inverse) {
  if constexpr (F != QuantFormat::kNone) {
    if (pp == 0) {
      DispatchQuantizePiece<F>(p.quant, p.ranks, p.runtime_max, p.payload[0], t, piece, lane, nvfp4_inverse, [&] {
        PieceTargets to;
        to.count = LoadRoutes(p, routing, t, lane, to.entry);
        return to;
      });
      return;
    }
  }
  switch (p.vec_bytes[pp]) {  // CopyVecBytes: 16, 4 or 1
    case 16:
      if (p.piece_vectors == kWideFanOutPieceVectors) {
        CopyPiece<16, kWideFanOutPieceVectors>(p, routing, pp, piece, t, lane);
      } else {
        CopyPiece<16, kDispatchPieceVectors>(p, routing, pp, piece, t, lane);
      }
      break;
    case 4: CopyPiece<4, kDispatchPieceVectors>(p, routing, pp, piece, t, lane); break;
    default: CopyPiece<1, kDispatchPieceVectors>(p, routing, pp, piece, t, lane); break;
  }
}

// Copies the rows of small payload pp of tokens [t, t + count) (count * vectors per row <= kSmallGroupVectors).
// Consecutive lanes take consecutive vectors of consecutive tokens, whose rows land in consecutive slots of a target
// rank whenever the tokens all go there: a warp's stores then cover whole lines instead of each token's row being
// a short write of its own.
template <int kVec>
__device__ __forceinline__ void CopySmallRows(const DispatchParams& p, const int32_t* routing, int pp, int64_t t,
                                              int count, int lane) {
  using Vec = typename VecOf<kVec>::Type;
  constexpr int kPerLane = kSmallGroupVectors / 32;
  const int64_t row = p.row_bytes[pp];
  const int row_vectors = static_cast<int>(row / kVec);
  const int vectors = count * row_vectors;
  const int64_t src_block = static_cast<int64_t>(p.ranks.ep_rank) * p.runtime_max;
  Vec v[kPerLane];
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    const int i = lane + 32 * u;
    if (i < vectors) v[u] = reinterpret_cast<const Vec*>(p.payload[pp] + t * row)[i];  // the rows are contiguous
  }
#pragma unroll
  for (int u = 0; u < kPerLane; ++u) {
    const int i = lane + 32 * u;
    if (i >= vectors) break;
    const int64_t token = t + i / row_vectors;
    const int64_t offset = static_cast<int64_t>(i % row_vectors) * kVec;
    const int32_t* routes = routing + token * p.route_stride;
    for (int k = 0; k < p.route_stride; ++k) {
      const int32_t e = routes[k];
      if (RouteEnds(e, p.ranks.ep_size, p.runtime_max)) break;
      uint8_t* dst = p.ranks.Base(RouteRank(e)) + p.recv_offset[pp] + (src_block + RouteSlot(e)) * row + offset;
      *reinterpret_cast<Vec*>(dst) = v[u];
    }
  }
}

__device__ __forceinline__ void CopySmallRowsAnyWidth(const DispatchParams& p, const int32_t* routing, int pp,
                                                      int64_t t, int count, int lane) {
  switch (p.vec_bytes[pp]) {  // CopyVecBytes: 16, 4 or 1
    case 16: CopySmallRows<16>(p, routing, pp, t, count, lane); break;
    case 4: CopySmallRows<4>(p, routing, pp, t, count, lane); break;
    default: CopySmallRows<1>(p, routing, pp, t, count, lane); break;
  }
}

// Step 1: routing of this block's chunk [t0, t1). Returns, in s_chunk, how many of the chunk's tokens go to each rank.
template <typename IdT>
__device__ __forceinline__ void RouteChunk(const DispatchParams& p, const ExpertPartition& part, uint32_t epoch,
                                           const RankMask& inactive, int t0, int t1, int32_t* s_base, int32_t* s_chunk,
                                           int32_t (*s_warp)[kMaxRanks], uint32_t (*s_ballot)[kMaxRanks]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int ep_size = p.ranks.ep_size;
  const IdT* ids = static_cast<const IdT*>(p.topk_ids);
  RankMetadata* meta = p.ranks.MyMeta();
  int32_t* routing = reinterpret_cast<int32_t*>(p.ranks.Base(p.ranks.ep_rank) + p.routing_offset);

  // Tiles of kDispatchThreads tokens from token 0. Those before the tile holding t0: per-warp counts only,
  // order-free. Invalid ids are reported by the chunk owning them.
  const int first_tile = t0 / kDispatchThreads * kDispatchThreads;
  for (int r = lane; r < ep_size; r += 32) s_warp[warp][r] = 0;
  for (int r = threadIdx.x; r < ep_size; r += kDispatchThreads) s_chunk[r] = 0;
  __syncthreads();  // also publishes the partition's rank table
  for (int tile = 0; tile < first_tile; tile += kDispatchThreads) {
    const RankMask mask = TokenRanks(ids, tile + threadIdx.x, p.top_k, part, nullptr, epoch, inactive);
    for (int r = 0; r < ep_size; ++r) {
      const uint32_t bal = __ballot_sync(0xffffffffu, mask.Has(r));
      if (lane == 0) s_warp[warp][r] += __popc(bal);
    }
  }
  __syncthreads();
  for (int r = threadIdx.x; r < ep_size; r += kDispatchThreads) {
    int32_t sum = 0;
    for (int w = 0; w < kDispatchWarps; ++w) sum += s_warp[w][r];
    s_base[r] = sum;
  }
  __syncthreads();

  // From there, one token per thread per tile: slot = base + earlier warps' count + earlier lanes' count. Tokens
  // before t0 in the first of these tiles are counted in the same pass (a pass of their own cost a round trip for
  // the ids and two barriers); the chunk's own tokens get their routing entries.
  for (int tile = first_tile; tile < t1; tile += kDispatchThreads) {
    const int t = tile + threadIdx.x;
    const bool own = t >= t0 && t < t1;
    RankMask mask = {};
    if (t < t1) mask = TokenRanks(ids, t, p.top_k, part, own ? meta : nullptr, epoch, inactive);
    const uint32_t own_lanes = __ballot_sync(0xffffffffu, own);
    for (int r = 0; r < ep_size; ++r) {
      const uint32_t bal = __ballot_sync(0xffffffffu, mask.Has(r));
      if (lane == 0) {
        s_ballot[warp][r] = bal;
        s_warp[warp][r] = __popc(bal);
        if ((bal & own_lanes) != 0) atomicAdd(&s_chunk[r], __popc(bal & own_lanes));
      }
    }
    __syncthreads();
    for (int r = threadIdx.x; r < ep_size; r += kDispatchThreads) {
      int32_t running = s_base[r];
      for (int w = 0; w < kDispatchWarps; ++w) {
        const int32_t count = s_warp[w][r];
        s_warp[w][r] = running;
        running += count;
      }
      s_base[r] = running;
    }
    __syncthreads();
    if (own) {
      int k = 0;
      for (int word = 0; word < kRankMaskWords; ++word) {
        for (uint32_t bits = mask.words[word]; bits != 0; bits &= bits - 1) {
          const int r = word * 32 + __ffs(bits) - 1;
          const int32_t slot = s_warp[warp][r] + __popc(s_ballot[warp][r] & LaneMaskLt());
          routing[static_cast<int64_t>(t) * p.route_stride + k++] = (r << kRouteSlotBits) | slot;
        }
      }
      if (k < p.route_stride) routing[static_cast<int64_t>(t) * p.route_stride + k] = -1;
    }
    __syncthreads();
  }
}

// A sender's blocks each add to the receiver's arrival word (RankMetadata::dispatch_signal), laid out as a tagged
// word with units where the epoch goes: a unit, and the tokens they sent it as the value; block 0 adds
// kDispatchArrivalUnits - gridDim.x units more, so that whatever the sender's grid, its dispatch is complete when the
// units reach kDispatchArrivalUnits. The receiver then takes the count and clears the word for the next dispatch
// (whose adds come only after this rank's combine has told the sender its data was taken).
constexpr uint32_t kDispatchArrivalUnits = 1u << 16;  // more than any dispatch grid (DispatchMaxBlocks)

// What the sender published: its arrival word, and its runtime_max and call layout (tagged words, see RankMetadata).
struct PeerCall {
  uint64_t signal, runtime_max, layout_low, layout_high;
  __device__ __forceinline__ bool Complete(uint32_t epoch) const {
    return TagOf(signal) == kDispatchArrivalUnits && TagOf(runtime_max) == epoch && TagOf(layout_low) == epoch &&
           TagOf(layout_high) == epoch;
  }
  __device__ __forceinline__ uint64_t Layout() const {
    return (static_cast<uint64_t>(ValueOf(layout_high)) << 32) | ValueOf(layout_low);
  }
};

// Tells rank r this call's runtime_max and layout, in words tagged with `epoch` that the receiver checks beside the
// arrival word (so they need no ordering of their own): block 0 stores them once the call may go ahead, and its
// arrivals' releases then order them before the word completes.
__device__ __forceinline__ void PublishCallWords(const DispatchParams& p, int r, uint32_t epoch) {
  RankMetadata* peer = p.ranks.Meta(r);
  const int me = p.ranks.ep_rank;
  StoreVolatile(&peer->peer_runtime_max[me], Tagged(epoch, static_cast<uint32_t>(p.runtime_max)));
  StoreVolatile(&peer->peer_call_layout[me][0], Tagged(epoch, static_cast<uint32_t>(p.call_layout)));
  StoreVolatile(&peer->peer_call_layout[me][1], Tagged(epoch, static_cast<uint32_t>(p.call_layout >> 32)));
}

// This block's arrival at rank r: `tokens` of its chunk went there. The release covers every store of the block that
// a barrier ordered before it: its rows, and block 0's call words.
__device__ __forceinline__ void ArriveAtRank(const DispatchParams& p, int r, int32_t tokens) {
  const uint32_t units = blockIdx.x == 0 ? kDispatchArrivalUnits - gridDim.x + 1 : 1;
  RedAddReleaseSys(&p.ranks.Meta(r)->dispatch_signal[p.ranks.ep_rank], Tagged(units, static_cast<uint32_t>(tokens)));
}

// Block 0's stores to every active rank before the arrivals: this call's words, and this rank's EPLB statistics in
// row ep_rank of the rank's EPLB region. This rank's own rows of inactive ranks are zeroed (no dispatch of theirs
// writes them while inactive).
__device__ __forceinline__ void PublishCallAndStatistics(const DispatchParams& p, uint32_t epoch,
                                                         const RankMask& inactive) {
  const int ep_size = p.ranks.ep_size;
  for (int r = threadIdx.x; r < ep_size; r += kDispatchThreads) {
    if (!inactive.Has(r)) PublishCallWords(p, r, epoch);
  }
  if (p.eplb_local == nullptr) return;
  const int64_t row = static_cast<int64_t>(p.ranks.ep_rank) * kMaxEplbExperts;
  for (int i = threadIdx.x; i < ep_size * p.eplb_experts; i += kDispatchThreads) {
    const int r = i / p.eplb_experts, e = i % p.eplb_experts;
    int32_t* own = reinterpret_cast<int32_t*>(p.ranks.Base(p.ranks.ep_rank) + p.eplb_offset);
    if (inactive.Has(r)) {
      own[static_cast<int64_t>(r) * kMaxEplbExperts + e] = 0;
    } else {
      reinterpret_cast<int32_t*>(p.ranks.Base(r) + p.eplb_offset)[row + e] = p.eplb_local[e];
    }
  }
}

// Waits (bounded) until every active peer's dispatch of `epoch` has arrived and writes the counts, zero for an
// inactive peer (never waited for) and for one that timed out or disagrees on runtime_max or on the call's layout
// (recorded in the error word); clears each complete arrival word. `call_layout` is this rank's. The checked words are
// loaded in the same poll as the arrival word, before its acquire (which later loads would wait for), so a peer that
// has arrived costs no further round trip.
__device__ __forceinline__ void ReceiveDispatchCounts(const DispatchParams& p, RankMetadata* meta, uint32_t epoch,
                                                      uint64_t call_layout, const RankMask& inactive) {
  for (int src = threadIdx.x; src < p.ranks.ep_size; src += kDispatchThreads) {
    if (inactive.Has(src)) {
      p.recv_counts[src] = 0;
      continue;
    }
    PeerCall peer{};
    const bool arrived = WaitUntil(
        [&] {
          peer.runtime_max = LoadVolatile(&meta->peer_runtime_max[src]);
          peer.layout_low = LoadVolatile(&meta->peer_call_layout[src][0]);
          peer.layout_high = LoadVolatile(&meta->peer_call_layout[src][1]);
          peer.signal = LoadAcquireSys(&meta->dispatch_signal[src]);
          return peer.Complete(epoch);
        },
        p.timeout_ns);
    int32_t count = 0;
    if (arrived) meta->dispatch_signal[src] = 0;
    if (!arrived) {
      RecordError(meta, ErrorCode::kTimeout, Phase::kDispatch, src, epoch, 0);
    } else if (static_cast<int32_t>(ValueOf(peer.runtime_max)) != p.runtime_max) {
      RecordError(meta, ErrorCode::kRuntimeMaxMismatch, Phase::kDispatch, src, epoch,
                  static_cast<int32_t>(ValueOf(peer.runtime_max)));
    } else if (peer.Layout() != call_layout) {  // its rows sit at other offsets or hold other types: count 0
      RecordError(meta, ErrorCode::kCallLayoutMismatch, Phase::kDispatch, src, epoch,
                  static_cast<int64_t>(peer.Layout() ^ call_layout));
    } else {
      count = static_cast<int32_t>(ValueOf(peer.signal));
    }
    p.recv_counts[src] = count;
  }
}

// F: the format payload 0 is quantized into (kNone: every payload copied). One kernel per format, so the plain
// copy keeps its registers free of the quantizing paths'. kGroupSmall: small payloads are copied in groups of tokens
// (num_small > 0); the kernel without it is the one short calls run, with none of that code to fetch. kBlocksPerSm:
// the blocks a multiprocessor its registers are budgeted for (DispatchBlocksPerSm, or 1 for small grids:
// DispatchKernelOf).
template <typename IdT, QuantFormat F, bool kGroupSmall, int kBlocksPerSm = DispatchBlocksPerSm(F)>
__global__ void __launch_bounds__(kDispatchThreads, kBlocksPerSm)
    DispatchKernel(const __grid_constant__ DispatchParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  __shared__ uint8_t s_rank_of[kRankTableExperts];
  __shared__ int32_t s_base[kMaxRanks];
  __shared__ int32_t s_chunk[kMaxRanks];
  __shared__ int32_t s_warp[kDispatchWarps][kMaxRanks];
  __shared__ uint32_t s_ballot[kDispatchWarps][kMaxRanks];
  __shared__ float s_nvfp4_inverse[F == QuantFormat::kNvfp4 ? kNvfp4Inverses : 1];
  const int ep_size = p.ranks.ep_size;
  RankMetadata* meta = p.ranks.MyMeta();

  // A protocol error from an earlier call leaves peers out of step: nothing goes to them until re-initialized (the
  // check comes after routing, which writes this rank's own record only, so that its loads overlap the ids'). Only
  // earlier kernels set it (this one does so after every block has passed the check), so all blocks agree.
  const KernelStart start = ReadKernelStart(meta, /*new_epoch=*/true);
  const uint32_t epoch = start.epoch;
  ExpertPartition part(p.num_experts, ep_size);
  part.FillTable(s_rank_of);  // RouteChunk synchronizes before the first lookup (of either table)
  if constexpr (F == QuantFormat::kNvfp4) FillNvfp4Inverses(p.quant, s_nvfp4_inverse);

  const int chunk = (p.num_tokens + gridDim.x - 1) / gridDim.x;
  const int t0 = min(p.num_tokens, static_cast<int>(blockIdx.x) * chunk);
  const int t1 = min(p.num_tokens, t0 + chunk);
  RouteChunk<IdT>(p, part, epoch, start.inactive, t0, t1, s_base, s_chunk, s_warp, s_ballot);
  if (start.fatal) {
    if (blockIdx.x == 0)
      for (int r = threadIdx.x; r < ep_size; r += kDispatchThreads) p.recv_counts[r] = 0;
    return;
  }
  if (blockIdx.x == 0) PublishCallAndStatistics(p, epoch, start.inactive);

  // Step 2: copy. The routing entries this block wrote are visible to it after the barrier in RouteChunk.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t* routing =
      reinterpret_cast<const int32_t*>(p.ranks.Base(p.ranks.ep_rank) + p.routing_offset);
  // Items: a piece of one token's row of a large payload, then a group of tokens' rows of a small one.
  const int tokens = t1 - t0;
  const int piece_items = tokens * p.pieces_per_token;
  int items = piece_items;
  if constexpr (kGroupSmall) {
    for (int s = 0; s < p.num_small; ++s) items += (tokens + p.small_group[s] - 1) / p.small_group[s];
  }
  for (int item = warp; item < items; item += kDispatchWarps) {
    if (!kGroupSmall || item < piece_items) {
      const int64_t t = t0 + item / p.pieces_per_token;
      int piece = item % p.pieces_per_token;
      int pp = 0;
      while (piece >= p.pieces[pp]) piece -= p.pieces[pp++];  // small payloads have no pieces
      DispatchCopyPiece<F>(p, routing, pp, piece, t, lane, s_nvfp4_inverse);
      continue;
    }
    if constexpr (kGroupSmall) {
      int group = item - piece_items, s = 0;
      for (int groups; group >= (groups = (tokens + p.small_group[s] - 1) / p.small_group[s]); ++s) group -= groups;
      const int t = t0 + group * p.small_group[s];
      CopySmallRowsAnyWidth(p, routing, p.small_payload[s], t, min(p.small_group[s], t1 - t), lane);
    }
  }

  // Step 3: every block arrives at every rank; the last block to count itself then waits for every peer's arrivals
  // (a send does not wait). The count only elects that block: the arrivals' releases already cover the rows, so it
  // is relaxed and waits for nothing in flight. Before, the last block sent one signal per rank for the whole grid
  // once a count with release semantics had seen every block, a second release after the first; 4 and 2 H100s, the
  // pair in the same run, this way 1.3-2.0 us less at 16 to 1024 tokens (0.2-0.3 us more at 1 token).
  __syncthreads();
  for (int r = threadIdx.x; r < ep_size; r += kDispatchThreads) {
    if (!start.inactive.Has(r)) ArriveAtRank(p, r, s_chunk[r]);
  }
  if (!CountLastBlock</*kAcqRel=*/false>(&meta->blocks_done)) return;
  if (p.phase != DispatchPhase::kSend) ReceiveDispatchCounts(p, meta, epoch, p.call_layout, start.inactive);
  __syncthreads();
  if (threadIdx.x == 0) {
    meta->blocks_done = 0;
    meta->dispatch_epoch = epoch;
  }
}

// The receive half of a split dispatch: one block waits for every peer's count of the epoch the send advanced to.
__global__ void __launch_bounds__(kDispatchThreads) DispatchRecvKernel(const __grid_constant__ DispatchParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  RankMetadata* meta = p.ranks.MyMeta();
  const KernelStart start = ReadKernelStart(meta, /*new_epoch=*/false);  // the send's
  if (start.fatal) {
    for (int r = threadIdx.x; r < p.ranks.ep_size; r += kDispatchThreads) p.recv_counts[r] = 0;
    return;
  }
  // The send already counted itself, and published its call layout to every rank, this one included.
  const int me = p.ranks.ep_rank;
  const PeerCall own{0, 0, LoadVolatile(&meta->peer_call_layout[me][0]), LoadVolatile(&meta->peer_call_layout[me][1])};
  ReceiveDispatchCounts(p, meta, start.epoch, own.Layout(), start.inactive);
}

// The most blocks a dispatch into format f runs: DispatchBlocksPerSm(f) per multiprocessor.
inline int DispatchMaxBlocks(QuantFormat f, int grid_sms) { return grid_sms * DispatchBlocksPerSm(f); }

// How the plain copy (format kNone) launches: at most max_blocks blocks, pieces of piece_vectors 16-byte vectors a
// lane. Where tokens fan out wide (WideFanOut) on the whole GPU (no SM budget: grid_sms == device_sms) it keeps
// fewer stores in flight: pieces of 2 vectors, and blocks of at least 2 tokens where that leaves
// kWideFanOutMinBlocks blocks or more. 4 H100s, pair of the slowest rank, before -> after: 64 tokens 34.9 -> 32.5
// us, 128 tokens 57.4 -> 53.0, 1024 tokens 278 -> 264, 8192 tokens no change; at 16 and 32 tokens blocks of 2
// tokens were slower. With 2 ranks each change made 16-128 tokens slower (by up to 1.2 us). The quantizing kernels,
// bound by instructions rather than the link, keep their launch.
constexpr int kWideFanOutMinBlocks = 32;
struct DispatchLaunchShape {
  int max_blocks;
  int piece_vectors;
};
inline DispatchLaunchShape DispatchLaunchShapeFor(QuantFormat f, int grid_sms, int device_sms, int num_tokens,
                                                  bool wide_fan_out) {
  const int max_blocks = DispatchMaxBlocks(f, grid_sms);
  if (f != QuantFormat::kNone || !wide_fan_out || grid_sms < device_sms) return {max_blocks, kDispatchPieceVectors};
  if (num_tokens < 2 * kWideFanOutMinBlocks) return {max_blocks, kWideFanOutPieceVectors};
  return {std::min(max_blocks, (num_tokens + 1) / 2), kWideFanOutPieceVectors};
}
// Tokens per block of a dispatch of num_tokens (the last block may own fewer).
inline int DispatchChunk(int num_tokens, int max_blocks) {
  return num_tokens > max_blocks ? (num_tokens + max_blocks - 1) / max_blocks : 1;
}
// Blocks for a dispatch of num_tokens: max_blocks at most, never an empty last chunk.
inline int DispatchGridSize(int num_tokens, int max_blocks) {
  if (num_tokens <= 0) return 1;
  const int chunk = DispatchChunk(num_tokens, max_blocks);
  return (num_tokens + chunk - 1) / chunk;
}

// kOnePerSm: the quantizing kernels compiled for one block per multiprocessor, for a grid that has no more blocks
// than multiprocessors (a token a block up to one per multiprocessor), where a second block's share of the registers
// buys nothing and its limit costs spills (80-104 bytes of stack a thread at 64 registers; 104-116 registers and no
// stack this way). 2 H100s, FP8 pair of the slowest rank, before -> after: 1 token 17.9 -> 17.2-17.4 us, 16 tokens
// 19.1 -> 18.3, 128 tokens 25.2 -> 23.2-23.3; 4 H100s, 64 tokens 28.5-28.8 -> 28.1.
template <typename IdT, bool kGroupSmall, bool kOnePerSm>
struct DispatchKernelOf {
  template <QuantFormat F>
  static auto Of() {
    return DispatchKernel<IdT, F, kGroupSmall, kOnePerSm ? 1 : DispatchBlocksPerSm(F)>;
  }
  static auto Get(QuantFormat f) {
    switch (f) {
      case QuantFormat::kFp8Block: return Of<QuantFormat::kFp8Block>();
      case QuantFormat::kMxfp8: return Of<QuantFormat::kMxfp8>();
      case QuantFormat::kNvfp4: return Of<QuantFormat::kNvfp4>();
      default: return Of<QuantFormat::kNone>();  // the plain copy: one block a multiprocessor either way
    }
  }
};

// Small rows are grouped only in grids of several tokens a block (PlanDispatchCopies), never one of a block per
// multiprocessor at most, so the grouping kernels have no one-per-multiprocessor build.
template <bool kGroupSmall>
auto DispatchKernelFor(bool ids_int64, QuantFormat f, bool one_per_sm) {
  if constexpr (!kGroupSmall) {
    if (one_per_sm) {
      return ids_int64 ? DispatchKernelOf<int64_t, false, true>::Get(f)
                       : DispatchKernelOf<int32_t, false, true>::Get(f);
    }
  }
  return ids_int64 ? DispatchKernelOf<int64_t, kGroupSmall, false>::Get(f)
                   : DispatchKernelOf<int32_t, kGroupSmall, false>::Get(f);
}

// The launch plan of each payload's copy, made on the host before LaunchDispatch from `p.payload`, `p.row_bytes`,
// `p.num_payloads` and `p.piece_vectors`: its vector width (the widest its row bytes and address allow), then either
// a group of rows per warp (a row under one warp store, 32 vectors, when a block has at least kSmallGroupMinTokens
// tokens to group) or pieces of p.PieceBytes(vector width) per row. A quantized first payload (`quant_hidden` > 0
// elements) is cut in pieces of kQuantPieceElems elements.
inline void PlanDispatchCopies(DispatchParams& p, int num_tokens, int max_blocks, int64_t quant_hidden) {
  const bool group_small = DispatchChunk(num_tokens, max_blocks) >= kSmallGroupMinTokens;
  for (int i = 0; i < p.num_payloads; ++i) {
    const int64_t row = p.row_bytes[i];
    const bool quantized = quant_hidden > 0 && i == 0;
    p.vec_bytes[i] = CopyVecBytes(VecBytesFor(row, reinterpret_cast<uintptr_t>(p.payload[i]), kAlignBytes));
    if (group_small && !quantized && row > 0 && row < 32 * p.vec_bytes[i]) {
      p.small_payload[p.num_small] = i;
      p.small_group[p.num_small++] =
          static_cast<int32_t>(std::min<int64_t>(32, kSmallGroupVectors / (row / p.vec_bytes[i])));
      continue;
    }
    const int64_t piece_bytes = p.PieceBytes(p.vec_bytes[i]);
    p.pieces[i] = static_cast<int32_t>(quantized ? (quant_hidden + kQuantPieceElems - 1) / kQuantPieceElems
                                                 : (row + piece_bytes - 1) / piece_bytes);
    p.pieces_per_token += p.pieces[i];
  }
}

inline cudaError_t LaunchDispatch(const DispatchParams& p, bool ids_int64, int max_blocks, cudaStream_t stream) {
  if (p.phase == DispatchPhase::kRecv) return LaunchAfterPrior(DispatchRecvKernel, 1, kDispatchThreads, stream, p);
  const int blocks = DispatchGridSize(p.num_tokens, max_blocks);
  if (blocks > static_cast<int>(kDispatchArrivalUnits)) return cudaErrorInvalidConfiguration;  // ArriveAtRank
  const bool one_per_sm = static_cast<int64_t>(blocks) * DispatchBlocksPerSm(p.quant.format) <= max_blocks;
  const auto kernel = p.num_small > 0 ? DispatchKernelFor<true>(ids_int64, p.quant.format, false)
                                      : DispatchKernelFor<false>(ids_int64, p.quant.format, one_per_sm);
  return LaunchAfterPrior(kernel, blocks, kDispatchThreads, stream, p);
}

inline cudaError_t GetDispatchKernelAttributes() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, DispatchRecvKernel);
  for (QuantFormat f : {QuantFormat::kNone, QuantFormat::kFp8Block, QuantFormat::kMxfp8, QuantFormat::kNvfp4}) {
    for (bool ids_int64 : {false, true}) {
      for (bool one_per_sm : {false, true}) {
        if (err == cudaSuccess) {
          err = cudaFuncGetAttributes(&attr, DispatchKernelFor<false>(ids_int64, f, one_per_sm));
        }
      }
      if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, DispatchKernelFor<true>(ids_int64, f, false));
    }
  }
  return err;
}

}  // namespace flashinfer_a2a
