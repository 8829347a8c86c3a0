// The pushed combine, used when every rank has a GPU of its own and the combine region has room for landing rows
// after the partials: each rank stores the rows it computed straight into their owners' workspaces (as they are,
// PlainWire, or quantized, Fp8Wire in combine_fp8.cuh) and each owner sums its tokens as their rows land. Stores
// cross NVLink faster than loads (docs/measurements/nvlink_pull_push.py: 363 vs 333 GB/s), and the sums overlap
// the transfer instead of following it.
//
// One kernel. Its warps are pushers (the first Wire::kPushWarps of a block) or reducers, each claiming work one item
// at a time from a counter in this rank's metadata:
//  - a push item is one row this rank computed for another (rows of every owner interleaved, slots in order): the
//    warp stores it into the owner's landing block for this rank, then releases the row's push flag there (the
//    epoch). Pushes wait for nothing: an owner's landing block is free once this rank has its dispatch signal, as
//    the owner's previous combine finished before that dispatch began. A pusher reduces once no push is left.
//  - a reduce item is one chunk of one local token (tokens in order, so reducers follow the landing rows): the
//    warp waits (bounded) for the flags of the token's remote rows, then sums the chunk from local memory.
// Pushers never wait, so every row lands whatever the reducers do. Each rank publishes its combine epoch on entry and
// the last block waits for every peer's, as the pull does: only then may the next dispatch overwrite a peer's
// receive region, even that of a peer that pushed nothing here.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "combine_common.cuh"
#include "combine_fp8.cuh"

namespace flashinfer_a2a {

// Rows travel as they are, kVec bytes a lane; the owner sums them in fp32 like the pull.
template <typename T, int kVec>
struct PlainWire {
  // Pushers per block; the other warps reduce from the start. Copying is cheap, so few warps keep the link busy and
  // more only compete with the sums (2xH200, 8192 tokens of 14 KB: 345 us with 2 of 8 warps, 431 with 4, 458 with 6,
  // 393 with 1).
  static constexpr int kPushWarps = 2;
  static constexpr int kPieceBytes = 32 * kVec;
  static constexpr int kChunkPieces = (kReduceChunkBytes + kPieceBytes - 1) / kPieceBytes;

  __device__ static int64_t LandingRowBytes(const CombineParams& p) { return p.row_bytes; }
  __host__ __device__ static int Chunks(const CombineParams& p) {
    return static_cast<int>((p.row_bytes + kChunkPieces * kPieceBytes - 1) / (kChunkPieces * kPieceBytes));
  }

  __device__ static void Push(const CombineParams& p, uint8_t* dst, const uint8_t* src, int lane) {
    CopyRow<kVec>(dst, src, p.row_bytes, lane);
  }

  __device__ static void Sum(const CombineParams& p, int64_t t, int chunk, int32_t entry, int num_sources, int lane) {
    for (int piece = chunk * kChunkPieces; piece < (chunk + 1) * kChunkPieces; ++piece) {
      const int64_t off = static_cast<int64_t>(piece) * kPieceBytes + lane * kVec;
      if (piece * static_cast<int64_t>(kPieceBytes) >= p.row_bytes) break;
      SumPlainElems<T, kVec>(p, t, off, entry, num_sources, true);
    }
  }

  __device__ static void WriteZeros(const CombineParams& p, int64_t first_item, int64_t item_stride) {
    PullItems<T, kVec>(p, true, first_item, item_stride);
  }
};

__device__ __forceinline__ uint32_t* PushFlags(const CombineParams& p, int rank, int src) {
  return reinterpret_cast<uint32_t*>(p.ranks.Base(rank) + p.push_flags_offset) +
         static_cast<int64_t>(src) * p.max_num_tokens;
}

// One claim per warp: lane 0 takes the next item of `counter`, every lane gets it.
__device__ __forceinline__ uint32_t ClaimItem(uint32_t* counter, int lane) {
  uint32_t item = 0;
  if (lane == 0) item = atomicAdd(counter, 1u);
  return __shfl_sync(0xffffffffu, item, 0);
}

// Waits (bounded) until the token's remote rows of `epoch` have landed here. Returns false when the sum must not
// read them: a wait of this warp timed out (recorded) or another one had failed on this rank.
__device__ __forceinline__ bool WaitPushedRows(const CombineParams& p, RankMetadata* meta, int32_t entry,
                                               int num_sources, uint32_t epoch, int lane) {
  const int rank = RouteRank(entry);
  bool ok = true;
  if (lane < num_sources && rank != p.ranks.ep_rank) {
    const uint32_t* flag = PushFlags(p, p.ranks.ep_rank, rank) + RouteSlot(entry);
    if (!WaitUntil([&] { return EpochReached(LoadAcquireSys(flag), epoch) || HasFatalError(meta); }, p.timeout_ns)) {
      RecordError(meta, ErrorCode::kTimeout, Phase::kCombine, rank, epoch, 0);
    }
    ok = EpochReached(LoadAcquireSys(flag), epoch);
  }
  __syncwarp();  // extends the lanes' acquires to the whole warp
  return __all_sync(0xffffffffu, ok);
}

template <typename Wire>
__global__ void __launch_bounds__(kCombineThreads, 2) CombinePushKernel(const __grid_constant__ CombineParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  RankMetadata* meta = p.ranks.MyMeta();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const KernelStart start = ReadKernelStart(meta, /*new_epoch=*/false);
  const uint32_t epoch = start.epoch;
  if (start.fatal) {  // set by earlier kernels only: all blocks agree; zeros out, like the pull
    Wire::WriteZeros(p, blockIdx.x * kCombineWarps + warp, static_cast<int64_t>(gridDim.x) * kCombineWarps);
    return;
  }
  const int me = p.ranks.ep_rank, peers = p.ranks.ep_size - 1;
  __shared__ bool s_publisher;
  if (threadIdx.x == 0) s_publisher = atomicExch(&meta->combine_published, epoch) != epoch;
  __syncthreads();
  if (s_publisher) PublishCombineEpoch(p, epoch, start.inactive);  // before any push

  if (warp < Wire::kPushWarps) {
    int max_rows = 0;  // most rows this rank computed for one peer
    for (int r = lane; r < p.ranks.ep_size; r += 32) max_rows = r == me ? max_rows : max(max_rows, p.recv_counts[r]);
    max_rows = __reduce_max_sync(0xffffffffu, max_rows);
    const int64_t push_items = static_cast<int64_t>(peers) * max_rows;
    const uint8_t* partials = OwnPartials(p);
    const int64_t landing_row_bytes = Wire::LandingRowBytes(p);
    for (int64_t item = ClaimItem(&meta->combine_claim, lane); item < push_items;
         item = ClaimItem(&meta->combine_claim, lane)) {
      const int owner = (me + 1 + static_cast<int>(item % peers)) % p.ranks.ep_size;
      const int64_t slot = item / peers;
      if (slot >= p.recv_counts[owner]) continue;
      Wire::Push(p, LandingRow(p, owner, me, slot, landing_row_bytes),
                 partials + (static_cast<int64_t>(owner) * p.runtime_max + slot) * p.row_bytes, lane);
      __syncwarp();  // the release below covers every lane's stores
      if (lane == 0) StoreReleaseSys(PushFlags(p, owner, me) + slot, epoch);
    }
  }
  const int chunks = Wire::Chunks(p);
  const int64_t reduce_items = static_cast<int64_t>(p.num_tokens) * chunks;
  for (int64_t item = ClaimItem(&meta->combine_reduce_claim, lane); item < reduce_items;
       item = ClaimItem(&meta->combine_reduce_claim, lane)) {
    const int64_t t = item / chunks;
    const auto [entry, num_sources] = LoadTokenSources(p, false, t, lane);
    const bool landed = WaitPushedRows(p, meta, entry, num_sources, epoch, lane);
    Wire::Sum(p, t, static_cast<int>(item % chunks), entry, landed ? num_sources : 0, lane);  // 0: zeros
  }

  if (!ArriveLastBlock(&meta->blocks_done)) return;
  WaitCombinePeers(p, meta, epoch, start.inactive);
  __syncthreads();
  if (threadIdx.x == 0) {
    meta->blocks_done = 0;
    meta->combine_claim = 0;
    meta->combine_reduce_claim = 0;
  }
}

}  // namespace flashinfer_a2a
