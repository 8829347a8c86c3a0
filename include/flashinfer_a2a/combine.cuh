// Combine: every rank publishes its experts' partial outputs in its own workspace; each token's owner pulls the
// partials of the ranks it sent the token to and sums them in increasing rank order, in fp32.
//
// Two kernels, because a kernel whose blocks all spin on peers could hold every multiprocessor while a peer
// simulated on the same GPU still needs one to publish:
//  1. CombinePublishKernel: copies the caller's partials into this rank's combine region (skipped when the expert
//     side wrote them there: zero copy); the last block to finish publishes this rank's epoch to every peer, then
//     waits (bounded) until every peer has published — after which no peer still reads this epoch's dispatch data.
//  2. CombinePullKernel: one warp per (token, piece of hidden: 32 vectors, or 64 of 16 bytes where that spares
//     warps a second piece, PullVecsFor); loads every source first, then adds.
// Over the FP8 wire (bf16|fp16; combine_fp8.cuh), the publish kernel quantizes the rows for other ranks into FP8
// values and fp32 block scales over the front of their rows, and CombinePullFp8Kernel dequantizes them while
// summing. When every rank has a GPU of its own and the combine region has room for landing rows after the
// partials, CombinePushKernel (combine_push.cuh) instead pushes the rows, as they are or quantized, into their
// owners' workspaces and sums them as they land.
// When the partials are already in place (zero copy) and the pull is small, CombineFusedKernel does both in one
// launch: the first block to run publishes, every block waits for the peers, then pulls. Its grid is kept small
// enough that the waiting blocks never hold a multiprocessor a peer sharing the GPU still needs (FusedCombineFor).
// A short pull over the FP8 wire is one launch too (CombineFusedFp8Kernel): the blocks quantize, the last to finish
// publishes, then all wait and pull.
// A combine runs the epoch of its dispatch and advances no counter of its own.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "combine_common.cuh"
#include "combine_fp8.cuh"
#include "combine_push.cuh"

namespace flashinfer_a2a {

__device__ __forceinline__ void CopyRowAnyWidth(uint8_t* dst, const uint8_t* src, int64_t bytes, int vec, int lane) {
  switch (vec) {
    case 16: CopyRow<16>(dst, src, bytes, lane); break;
    case 8: CopyRow<8>(dst, src, bytes, lane); break;
    case 4: CopyRow<4>(dst, src, bytes, lane); break;
    case 2: CopyRow<2>(dst, src, bytes, lane); break;
    default: CopyRow<1>(dst, src, bytes, lane); break;
  }
}

// Grid completion of a publishing kernel, after each block's stores: the last block to arrive (which then sees every
// block's rows at GPU scope) clears the count for the next combine and publishes this rank's epoch to every peer.
// Returns whether this block was that one.
__device__ __forceinline__ bool PublishIfLastBlock(const CombineParams& p, RankMetadata* meta, uint32_t epoch,
                                                   const RankMask& inactive) {
  if (!ArriveLastBlock(&meta->blocks_done)) return false;
  if (threadIdx.x == 0) meta->blocks_done = 0;
  PublishCombineEpoch(p, epoch, inactive);
  return true;
}

// Split phase: a send runs the copy and the publish and advances the epoch; a receive runs this kernel as one block
// that only waits for the peers (of the epoch its send advanced to) before the pull kernel.
__global__ void __launch_bounds__(kCombineThreads, 2) CombinePublishKernel(const __grid_constant__ CombineParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  const int ep_size = p.ranks.ep_size;
  RankMetadata* meta = p.ranks.MyMeta();
  const bool sends = p.phase != CombinePhase::kRecv, waits = p.phase != CombinePhase::kSend;
  const KernelStart start = ReadKernelStart(meta, /*new_epoch=*/false);
  const uint32_t epoch = start.epoch;
  if (start.fatal) return;  // set by earlier kernels only: all blocks agree

  if (!sends) {
    WaitCombinePeers(p, meta, epoch, start.inactive);
    return;
  }
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

  if (PublishIfLastBlock(p, meta, epoch, start.inactive) && waits) WaitCombinePeers(p, meta, epoch, start.inactive);
}

template <typename T, int kVec, int kVecs>
__global__ void __launch_bounds__(kCombineThreads) CombinePullKernel(const __grid_constant__ CombineParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  PullItems<T, kVec, kVecs>(p, HasFatalError(p.ranks.MyMeta()), blockIdx.x * kCombineWarps + threadIdx.x / 32,
                            static_cast<int64_t>(gridDim.x) * kCombineWarps);
}

// Blocks of 4 to 32 warps (FusedCombineFor): blockDim.x is the launch's. One block per multiprocessor lets ptxas use up
// to 64 registers, which the widest pulls need.
template <typename T, int kVec, int kVecs>
__global__ void __launch_bounds__(kFusedCombineMaxThreads, 1)
    CombineFusedKernel(const __grid_constant__ CombineParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  RankMetadata* meta = p.ranks.MyMeta();
  const int warps = blockDim.x / 32;
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32;
  const int64_t item_stride = static_cast<int64_t>(gridDim.x) * warps;
  const KernelStart start = ReadKernelStart(meta, /*new_epoch=*/false);
  const uint32_t epoch = start.epoch;
  const int32_t first_entry = PrefetchRoute<kVec, kVecs>(p, first_item, threadIdx.x % 32);  // own record
  if (start.fatal) {  // set by earlier kernels only: all blocks agree; zeros out, like the pull
    PullItems<T, kVec, kVecs>(p, true, first_item, item_stride);
    return;
  }
  // The partials were written by earlier kernels, so the signal is relaxed (PublishCombineEpoch). Every block of a
  // small grid publishes (the same epoch), so whichever runs first gets it out with no round trip to elect it; a
  // larger grid's first block to arrive claims the publish, so that the peers get one store each, not one per block.
  bool publishes = true;
  if (static_cast<int64_t>(gridDim.x) * p.ranks.ep_size > kCombinePublishAllStores) {
    __shared__ bool s_publisher;
    if (threadIdx.x == 0) s_publisher = atomicExch(&meta->combine_published, epoch) != epoch;
    __syncthreads();
    publishes = s_publisher;
  }
  if (publishes) PublishCombineEpoch(p, epoch, start.inactive);
  // The barrier extends the acquires to the whole block: the peers' partials are visible to every warp. Nothing is
  // counted at the end: the next combine runs the epoch of the next dispatch.
  const bool failed = __syncthreads_or(WaitCombinePeers(p, meta, epoch, start.inactive)) != 0;
  PullItems<T, kVec, kVecs>(p, failed, first_item, item_stride, &first_entry);
}

// The one-kernel combine over the FP8 wire (bf16|fp16): every block quantizes its share of the rows for other ranks
// (as CombinePublishKernel does), the last block to finish publishes for all, then every block waits for the peers
// and pulls (as CombinePullFp8Kernel does). The grid runs in one wave (FusedFp8CombineFor): a block waiting for the
// peers must not keep one of this rank's blocks from quantizing.
template <typename T>
__global__ void __launch_bounds__(kFusedFp8MaxWarps * 32)
    CombineFusedFp8Kernel(const __grid_constant__ CombineParams p) {
  WaitPriorKernels();
  StartDependents(p.ranks.own_gpu);
  RankMetadata* meta = p.ranks.MyMeta();
  const int warps = blockDim.x / 32;
  const int64_t first_item = static_cast<int64_t>(blockIdx.x) * warps + threadIdx.x / 32;
  const int64_t item_stride = static_cast<int64_t>(gridDim.x) * warps;
  const KernelStart start = ReadKernelStart(meta, /*new_epoch=*/false);
  if (start.fatal) {  // set by earlier kernels only: all blocks agree; zeros out, like the pull
    PullItemsFp8<T>(p, true, first_item, item_stride);
    return;
  }
  __shared__ float s_scales[kFusedFp8MaxWarps][kFp8WireMaxCols];
  QuantizeRowsFp8<T>(p, s_scales[threadIdx.x / 32]);
  PublishIfLastBlock(p, meta, start.epoch, start.inactive);
  const bool failed = __syncthreads_or(WaitCombinePeers(p, meta, start.epoch, start.inactive)) != 0;
  PullItemsFp8<T>(p, failed, first_item, item_stride);
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

// The pushed combine with a block per work item at most: one per Wire::kPushWarps peer rows, one per reducers' share
// of the token chunks.
template <typename Wire>
cudaError_t LaunchPush(const CombineParams& p, int grid_sms, cudaStream_t stream) {
  constexpr int kPushWarps = Wire::kPushWarps, kReduceWarps = kCombineWarps - kPushWarps;
  const int64_t rows = static_cast<int64_t>(p.ranks.ep_size - 1) * p.runtime_max;
  const int64_t reduces = static_cast<int64_t>(p.num_tokens) * Wire::Chunks(p);
  const int64_t blocks = std::max((rows + kPushWarps - 1) / kPushWarps, (reduces + kReduceWarps - 1) / kReduceWarps);
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(grid_sms * 2, blocks)));
  return LaunchAfterPrior(CombinePushKernel<Wire>, grid, kCombineThreads, stream, p);
}

struct PushLauncher {
  const CombineParams& p;
  int grid_sms;
  cudaStream_t stream;
  template <typename T, int kVec>
  cudaError_t operator()() const {
    return LaunchPush<PlainWire<T, kVec>>(p, grid_sms, stream);
  }
};

// Launches the pull (fused: the one-kernel combine) with items of `vecs` vectors a lane (2 only for 16-byte ones).
struct PullLauncher {
  const CombineParams& p;
  int blocks, threads;
  bool fused;
  int vecs;
  cudaStream_t stream;
  template <typename T, int kVec, int kVecs>
  cudaError_t Launch() const {
    return LaunchAfterPrior(fused ? CombineFusedKernel<T, kVec, kVecs> : CombinePullKernel<T, kVec, kVecs>, blocks,
                            threads, stream, p);
  }
  template <typename T, int kVec>
  cudaError_t operator()() const {
    if constexpr (kVec == 16) {
      if (vecs == 2) return Launch<T, kVec, 2>();
    }
    return Launch<T, kVec, 1>();
  }
};

struct PullPreloader {
  template <typename T, int kVec>
  cudaError_t operator()() const {
    cudaFuncAttributes attr;
    cudaError_t err = cudaFuncGetAttributes(&attr, CombinePullKernel<T, kVec, 1>);
    if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombineFusedKernel<T, kVec, 1>);
    if constexpr (kVec == 16) {
      if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePullKernel<T, kVec, 2>);
      if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombineFusedKernel<T, kVec, 2>);
    }
    return err == cudaSuccess ? cudaFuncGetAttributes(&attr, CombinePushKernel<PlainWire<T, kVec>>) : err;
  }
};

// Vectors a lane per pull item: 2 (1 KiB items) where the vectors are 16 bytes and 512-byte items would leave some
// warp of the pull's grid (`warps`) more than one in turn; else 1. Half as many items, the same bytes in flight a
// warp. One H200: the partials of 4 simulated ranks at 64 tokens, summed alone, took 3.7 us instead of 4.3-4.4,
// while 512-byte items were quicker wherever every warp had one (docs/measurements/data_movement_floor.cu); the
// bench's pair took 9-17% less at 1024 and 8192 tokens with 1 and 2 simulated ranks (docs/benchmarks.md).
inline int PullVecsFor(int64_t narrow_items, int64_t warps, int vec_bytes) {
  return vec_bytes == 16 && narrow_items > warps ? 2 : 1;
}

// The grid of a one-kernel combine: every block waits for the peers before it pulls, so the grid must run in one
// wave.
// - With a GPU per rank only this GPU's own work can be delayed by the waiting blocks: a block per multiprocessor at
//   most. On the whole GPU the blocks have OwnGpuPullWarps warps, each pulling up to kOwnGpuFusedItems items in
//   turn: fewer partials in flight beat a warp per item on real links. The combine alone, before (as under a
//   budget, below) -> after: 4 H100s, 128 tokens 32.5 -> 28.5 us, 1024 tokens 140 -> 135, 8192 tokens 995 -> 973;
//   2 H100s, 128 tokens 17.1 -> 15.7, 1024 tokens 57.9 -> 56.3, 8192 tokens 364 -> 362 (DeepSeek-V3 rows).
// - With a GPU per rank under an SM budget (grid_sms < device_sms) blocks keep 8 warps while there are enough of
//   them, then grow to 32, a warp per item; larger pulls take two kernels, whose grid is not held to the budget.
//   Blocks of 4-8 warps on 32 multiprocessors left too few partials in flight: the a2a alone took 1.5-1.8x its
//   whole-GPU time at 1024-4096 tokens on 2 and 4 H100s, against 0.93-1.06x this way.
// - Where ranks share a GPU (simulated ranks, processes on one GPU) each has at most one such kernel running, and a
//   peer can always finish what it still has to run (a dispatch, a publish) while every rank's waiting blocks
//   together leave a multiprocessor free. Within that cap blocks keep 8 warps while there are enough of them, then
//   grow to 32, and a warp may pull up to kSharedGpuFusedItems items in turn (the next item's route is loaded
//   during the current one's sums); past that the second launch costs less.
constexpr int kSharedGpuFusedItems = 4;
constexpr int kOwnGpuFusedItems = 512;
// Warps a block of the one-kernel combine has with a GPU per rank on the whole GPU, pulling `items` items: 4 where
// tokens fan out wide (WideFanOut), else 8; twice that where a warp would otherwise pull more than
// kOwnGpuDeepItems items in turn. Pair of the slowest rank on a 4xH100 host, two rounds, before -> after: 2 GPUs
// 1024 tokens 98.8 -> 97.4 us, 2048 tokens 184.0 -> 182.1, pulled at 8192 688.3 -> 686.2; 4 GPUs 512 tokens 132.9
// -> 130.8, 1024 tokens 249.3 -> 246.8, pulled at 2048 484.3 -> 480.0; 128 tokens unchanged (no doubling there).
// Four times as many warps was slower than twice (2 GPUs 1024 tokens 99.8 us, 4 GPUs 251.5).
constexpr int kOwnGpuDeepItems = 8;
inline int OwnGpuPullWarps(bool wide_fan_out, int64_t items, int grid_sms) {
  const int base = wide_fan_out ? 4 : 8;
  return items > int64_t{grid_sms} * base * kOwnGpuDeepItems ? 2 * base : base;
}
struct FusedCombineShape {
  int blocks = 0, threads = 0;  // blocks == 0: the combine does not fit one kernel
};
// The grid for `items` warp-sized items on at most `cap` (>= 1) blocks: kCombineWarps warps a block while that
// covers them, then wider blocks up to max_warps (past cap * max_warps items, a warp takes several in turn).
inline FusedCombineShape CappedBlocks(int64_t items, int64_t cap, int max_warps) {
  const int64_t per_block = std::clamp<int64_t>((items + cap - 1) / cap, kCombineWarps, max_warps);
  const int64_t blocks = std::clamp<int64_t>((items + per_block - 1) / per_block, 1, cap);
  return {static_cast<int>(blocks), static_cast<int>(per_block * 32)};
}
// The most blocks of a one-kernel combine, all of which may wait for the peers at once: the budget's
// multiprocessors with a GPU per rank; where ranks share a GPU, also their share of all but one multiprocessor.
inline int64_t FusedCombineCap(int grid_sms, int device_sms, int ep_size, bool one_gpu_per_rank) {
  return one_gpu_per_rank ? grid_sms : std::min<int64_t>(grid_sms, (device_sms - 1) / ep_size);
}
inline FusedCombineShape FusedCombineFor(int64_t warps, int grid_sms, int device_sms, int ep_size,
                                         bool one_gpu_per_rank, bool wide_fan_out) {
  if (one_gpu_per_rank && grid_sms >= device_sms) {  // the whole GPU
    const int64_t per_block = OwnGpuPullWarps(wide_fan_out, warps, grid_sms);
    if (grid_sms < 1 || warps > grid_sms * per_block * kOwnGpuFusedItems) return {};
    const int64_t blocks = std::min<int64_t>(grid_sms, (warps + per_block - 1) / per_block);
    return {static_cast<int>(blocks), static_cast<int>(per_block * 32)};
  }
  constexpr int kMaxWarps = kFusedCombineMaxThreads / 32;
  const int64_t cap = FusedCombineCap(grid_sms, device_sms, ep_size, one_gpu_per_rank);
  const int64_t items_per_warp = one_gpu_per_rank ? 1 : kSharedGpuFusedItems;
  if (cap < 1 || warps > cap * kMaxWarps * items_per_warp) return {};
  return CappedBlocks(warps, cap, kMaxWarps);
}

// The grid of the one-kernel combine over the FP8 wire: FusedCombineCap blocks at most, of 8 to kFusedFp8MaxWarps
// warps, a warp per pull item (every warp quantizes its share of the rows first); where that cannot cover the pull,
// two kernels (blocks == 0). DeepSeek-V3 rows from a partials tensor, pair of the slowest rank, two kernels -> one
// (blocks of 8 warps, up to 2 items a warp): 2 H100s, 1 token 21.7 -> 20.3 us, 64 tokens 25.4 -> 23.7, 128 tokens
// 30.1 -> 28.8; 4 H100s 23.1 -> 22.6, 33.1 -> 32.8, 46.3 -> 46.2. At 256 tokens (3.4 items a warp) one kernel was
// slower (36.2 -> 40.4 and 73.9 -> 79.9 us). Blocks growing to 16 warps, so that no warp quantizes or pulls twice in
// turn, then took 2 H200s from 24.4 to 23.9 us at 128 tokens and 26.2 to 24.8 at 150, 4 H200s from 27.6 to 27.2 at
// 64 (1 and 16 tokens unchanged).
inline FusedCombineShape FusedFp8CombineFor(int64_t pull_items, int grid_sms, int device_sms, int ep_size,
                                            bool one_gpu_per_rank) {
  const int64_t cap = FusedCombineCap(grid_sms, device_sms, ep_size, one_gpu_per_rank);
  if (cap < 1 || pull_items > cap * kFusedFp8MaxWarps) return {};
  return CappedBlocks(pull_items, cap, kFusedFp8MaxWarps);
}

// pull_vec_bytes: vector width of the pull (16 down to one element), dividing row_bytes. grid_sms: the
// multiprocessors the grids are sized for (the SM budget applied); device_sms: the GPU's multiprocessors.
// one_gpu_per_rank: no two ranks share a GPU.
// A split combine (phase kSend or kRecv) is the pulled two-kernel combine cut after the publish: the caller never
// sets push for it, and the one-kernel combine is not used.
inline cudaError_t LaunchCombine(const CombineParams& p, FloatType type, int pull_vec_bytes, int grid_sms,
                                 int device_sms, bool one_gpu_per_rank, cudaStream_t stream) {
  const bool split = p.phase != CombinePhase::kBoth;
  if (p.push && p.fp8_wire) {
    return p.fp16 ? LaunchPush<Fp8Wire<__half>>(p, grid_sms, stream)
                  : LaunchPush<Fp8Wire<__nv_bfloat16>>(p, grid_sms, stream);
  }
  if (p.push) return DispatchPullKernel(type, pull_vec_bytes, PushLauncher{p, grid_sms, stream});
  if (p.fp8_wire) pull_vec_bytes = kFp8PullElems * 2;  // bf16|fp16, 16 elements a lane
  // Items of 512 bytes where the vectors are 16 (narrow), and of 1 KiB (wide) where that spares warps a second item.
  auto items_of = [&](int64_t item_bytes) {
    return static_cast<int64_t>(p.num_tokens) * ((p.row_bytes + item_bytes - 1) / item_bytes);
  };
  const int64_t narrow_items = items_of(32 * pull_vec_bytes), wide_items = items_of(64 * pull_vec_bytes);
  auto blocks_for = [&](int64_t items) {
    return static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>(grid_sms * 8, (items + kCombineWarps - 1) / kCombineWarps)));
  };
  // One kernel where the pull fits one wave (FusedCombineFor).
  if (!split && p.input == nullptr && !p.fp8_wire) {
    const bool wide = WideFanOut(p.route_stride, p.ranks.ep_size, one_gpu_per_rank);
    FusedCombineShape fused =
        FusedCombineFor(narrow_items, grid_sms, device_sms, p.ranks.ep_size, one_gpu_per_rank, wide);
    if (fused.blocks > 0) {
      const int vecs =
          PullVecsFor(narrow_items, static_cast<int64_t>(fused.blocks) * (fused.threads / 32), pull_vec_bytes);
      if (vecs == 2) {
        fused = FusedCombineFor(wide_items, grid_sms, device_sms, p.ranks.ep_size, one_gpu_per_rank, wide);
      }
      return DispatchPullKernel(type, pull_vec_bytes,
                                PullLauncher{p, fused.blocks, fused.threads, true, vecs, stream});
    }
  }
  if (!split && p.fp8_wire && p.num_tokens > 0) {
    const FusedCombineShape fused =
        FusedFp8CombineFor(narrow_items, grid_sms, device_sms, p.ranks.ep_size, one_gpu_per_rank);
    if (fused.blocks > 0) {
      return LaunchAfterPrior(p.fp16 ? CombineFusedFp8Kernel<__half> : CombineFusedFp8Kernel<__nv_bfloat16>,
                              fused.blocks, fused.threads, stream, p);
    }
  }
  // Zero copy needs one block (the signal); a copy gets a warp per row (per piece of a row when quantizing from a
  // partials tensor), up to two blocks per multiprocessor.
  const int64_t items = static_cast<int64_t>(p.ranks.ep_size) * p.runtime_max *
                        (p.fp8_wire && p.input != nullptr ? (p.hidden + kQuantPieceElems - 1) / kQuantPieceElems : 1);
  const int64_t copy_blocks = std::min<int64_t>(grid_sms * 2, (items + kCombineWarps - 1) / kCombineWarps);
  const bool copies = p.input != nullptr || p.fp8_wire;
  const int publish_blocks =
      copies && p.phase != CombinePhase::kRecv ? static_cast<int>(std::max<int64_t>(copy_blocks, 1)) : 1;
  const cudaError_t err = LaunchAfterPrior(CombinePublishKernel, publish_blocks, kCombineThreads, stream, p);
  if (err != cudaSuccess || p.num_tokens == 0 || p.phase == CombinePhase::kSend) return err;
  const int narrow_blocks = blocks_for(narrow_items);
  if (p.fp8_wire) {
    return LaunchAfterPrior(p.fp16 ? CombinePullFp8Kernel<__half> : CombinePullFp8Kernel<__nv_bfloat16>,
                            narrow_blocks, kCombineThreads, stream, p);
  }
  const int vecs = PullVecsFor(narrow_items, static_cast<int64_t>(narrow_blocks) * kCombineWarps, pull_vec_bytes);
  return DispatchPullKernel(type, pull_vec_bytes, PullLauncher{p, vecs == 2 ? blocks_for(wide_items) : narrow_blocks,
                                                               kCombineThreads, false, vecs, stream});
}

inline cudaError_t GetCombineKernelAttributes() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, CombinePublishKernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePullFp8Kernel<__half>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePullFp8Kernel<__nv_bfloat16>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombineFusedFp8Kernel<__half>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombineFusedFp8Kernel<__nv_bfloat16>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePushKernel<Fp8Wire<__half>>);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, CombinePushKernel<Fp8Wire<__nv_bfloat16>>);
  for (FloatType type : {FloatType::kFloat32, FloatType::kBFloat16, FloatType::kFloat16}) {
    for (int vec : {16, 8, 4, 2}) {
      if (err == cudaSuccess) err = DispatchPullKernel(type, vec, PullPreloader{});
    }
  }
  return err;
}

}  // namespace flashinfer_a2a
