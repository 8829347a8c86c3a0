// The nccl transport's select: after the all-gather of every rank's send buffer (nccl_wire.cuh), one kernel keeps,
// for each source rank, the rows whose mask names this rank, in increasing token order, as the NVLink dispatch
// receives them: row k of source block src is the k-th token of src sent here. It writes recv_counts too.
//
// A block takes `chunk_rows` rows of one source block (and, split `splits` ways, a share of their copies). It counts
// the rows before its chunk that this rank takes itself (every block reads the mask plane from row 0: no block waits
// on another, so nothing depends on the order blocks run in), ranks its chunk's rows with a ballot, then copies the
// selected rows of every segment: warps over 2 KiB pieces of wide rows, threads over the vectors of narrow ones.
// Swizzled scales are written into the 128x4-tile layout of their source block as they are copied.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "combine_common.cuh"
#include "nccl_pack.cuh"
#include "nccl_wire.cuh"

namespace flashinfer_a2a {

constexpr int kNcclSelectThreads = 256;
constexpr int kNcclSelectWarps = kNcclSelectThreads / 32;
constexpr int kNcclSelectMinChunk = 32;  // rows of a block's chunk: a multiple of 16 (CountPlaneBits), at least a warp

struct NcclSelectParams {
  const uint8_t* gathered;  // [ep_size, wire.total_bytes]: every rank's send buffer
  NcclWireLayout wire;
  int32_t ep_rank;
  uint8_t* recv[kNcclMaxSegments];        // segment s: [ep_size, runtime_max, row_bytes[s]], or swizzled scales
  int32_t vec_bytes[kNcclMaxSegments];    // 16, 4 or 1: divides the row bytes and the receive buffer's address
  int32_t swizzled_segment;               // the scales, received in the 128x4-tile layout; -1: none
  int64_t swizzled_block_bytes;           // one source block of them
  int32_t* recv_counts;                   // [ep_size] out
  int32_t chunk_rows;                     // a power of two in [kNcclSelectMinChunk, kNcclSelectThreads]
  int32_t chunks;                         // per source block, at least 1
  int32_t splits;                         // blocks sharing one chunk's copies
};

// Copies `count` rows (source row s_rows[k] to row k of dst), `row_bytes` a multiple of kVec. Worker `worker` of
// `workers` blocks: the warps take (row, piece of 32 * kNcclCopyBatch vectors) items of rows of 32 vectors or more
// (CopyRow, kNcclCopyBatch loads in flight a lane), the threads single vectors of narrower rows.
template <int kVec>
__device__ __forceinline__ void CopySelectedRows(uint8_t* dst, const uint8_t* rows, int64_t row_bytes,
                                                 const int32_t* s_rows, int count, int worker, int workers) {
  using Vec = typename VecOf<kVec>::Type;
  const int64_t vectors = row_bytes / kVec;
  if (vectors >= 32) {
    constexpr int64_t kPiece = 32 * kNcclCopyBatch * kVec;
    const int64_t pieces = CeilDiv(row_bytes, kPiece);
    for (int64_t item = worker * kNcclSelectWarps + threadIdx.x / 32; item < count * pieces;
         item += static_cast<int64_t>(workers) * kNcclSelectWarps) {
      const int64_t k = item / pieces, begin = item % pieces * kPiece;
      const int64_t bytes = row_bytes - begin < kPiece ? row_bytes - begin : kPiece;
      CopyRow<kVec>(dst + k * row_bytes + begin, rows + s_rows[k] * row_bytes + begin, bytes, threadIdx.x % 32);
    }
    return;
  }
  for (int64_t i = static_cast<int64_t>(worker) * kNcclSelectThreads + threadIdx.x; i < count * vectors;
       i += static_cast<int64_t>(workers) * kNcclSelectThreads) {
    const int64_t k = i / vectors;
    reinterpret_cast<Vec*>(dst + k * row_bytes)[i % vectors] =
        reinterpret_cast<const Vec*>(rows + s_rows[k] * row_bytes)[i % vectors];
  }
}

// The scales of `count` rows (row_bytes padded columns each, a multiple of 4), received at slots first_slot.. of
// their source block in the 128x4-tile layout: 4 columns are 4 contiguous bytes there.
__device__ __forceinline__ void CopySelectedScalesSwizzled(uint8_t* block, const uint8_t* rows, int64_t row_bytes,
                                                           const int32_t* s_rows, int count, int64_t first_slot,
                                                           int worker, int workers) {
  const int64_t tiles_per_row = row_bytes / 4;
  for (int64_t i = static_cast<int64_t>(worker) * kNcclSelectThreads + threadIdx.x; i < count * tiles_per_row;
       i += static_cast<int64_t>(workers) * kNcclSelectThreads) {
    const int64_t k = i / tiles_per_row;
    const int64_t tile = i % tiles_per_row;
    const uint32_t word = reinterpret_cast<const uint32_t*>(rows + s_rows[k] * row_bytes)[tile];
    *reinterpret_cast<uint32_t*>(block + SwizzledScaleOffset(first_slot + k, 4 * tile, tiles_per_row)) = word;
  }
}

__global__ void __launch_bounds__(kNcclSelectThreads) NcclSelectKernel(const __grid_constant__ NcclSelectParams p) {
  __shared__ int32_t s_rows[kNcclSelectThreads];  // the chunk's rows for this rank, in increasing order
  __shared__ int32_t s_warp[kNcclSelectWarps];
  __shared__ int32_t s_base;  // rows before the chunk that this rank takes
  WaitPriorKernels();
  const int split = blockIdx.x % p.splits;
  const int chunk = blockIdx.x / p.splits % p.chunks;
  const int src = blockIdx.x / p.splits / p.chunks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint8_t* send = p.gathered + src * p.wire.total_bytes;
  const uint8_t* plane = MaskPlane(send, p.wire, p.ep_rank / 8);
  const int bit = p.ep_rank % 8;
  const int64_t r0 = static_cast<int64_t>(chunk) * p.chunk_rows;

  if (threadIdx.x == 0) s_base = 0;
  __syncthreads();
  CountPlaneBits(plane, r0, bit, 1, &s_base);
  const int64_t r = r0 + threadIdx.x;
  const bool mine = threadIdx.x < p.chunk_rows && r < p.wire.runtime_max && ((plane[r] >> bit) & 1);
  const uint32_t ballot = __ballot_sync(0xffffffffu, mine);
  if (lane == 0) s_warp[warp] = __popc(ballot);
  __syncthreads();  // s_warp, and s_base complete
  int before = 0, count = 0;
  for (int w = 0; w < kNcclSelectWarps; ++w) {
    before += w < warp ? s_warp[w] : 0;
    count += s_warp[w];
  }
  if (mine) s_rows[before + __popc(ballot & LaneMaskLt())] = static_cast<int32_t>(r);
  const int64_t base = s_base;
  if (split == 0 && chunk == p.chunks - 1 && threadIdx.x == 0) p.recv_counts[src] = static_cast<int32_t>(base + count);
  __syncthreads();  // s_rows

  for (int s = 0; s < p.wire.num_segments; ++s) {
    const int64_t row_bytes = p.wire.row_bytes[s];
    const uint8_t* rows = send + p.wire.offset[s];
    if (s == p.swizzled_segment) {
      CopySelectedScalesSwizzled(p.recv[s] + src * p.swizzled_block_bytes, rows, row_bytes, s_rows, count, base,
                                 split, p.splits);
      continue;
    }
    uint8_t* dst = p.recv[s] + (static_cast<int64_t>(src) * p.wire.runtime_max + base) * row_bytes;
    switch (p.vec_bytes[s]) {
      case 16: CopySelectedRows<16>(dst, rows, row_bytes, s_rows, count, split, p.splits); break;
      case 4: CopySelectedRows<4>(dst, rows, row_bytes, s_rows, count, split, p.splits); break;
      default: CopySelectedRows<1>(dst, rows, row_bytes, s_rows, count, split, p.splits); break;
    }
  }
}

// Sizes the grid (chunk_rows, chunks, splits) for about 4 blocks per multiprocessor: chunks as small as a warp where
// the source blocks are short, then each chunk's copies split over blocks, while each block still has a piece to
// copy per warp.
inline cudaError_t LaunchNcclSelect(NcclSelectParams p, int grid_sms, cudaStream_t stream) {
  constexpr int64_t kPieceBytes = 32 * kNcclCopyBatch * 16;  // of a warp item
  const int64_t target = int64_t{grid_sms} * 4;
  const int64_t rows = p.wire.runtime_max, sources = p.wire.ep_size;
  int64_t chunk = kNcclSelectThreads;
  while (chunk > kNcclSelectMinChunk && sources * CeilDiv(rows, chunk) < target) chunk /= 2;
  const int64_t chunks = std::max<int64_t>(1, CeilDiv(rows, chunk));
  int64_t pieces = 1;  // of the widest row
  for (int s = 0; s < p.wire.num_segments; ++s) pieces = std::max(pieces, CeilDiv(p.wire.row_bytes[s], kPieceBytes));
  const int64_t most = std::max<int64_t>(1, CeilDiv(std::min(chunk, rows) * pieces, kNcclSelectWarps));
  const int64_t splits = std::clamp<int64_t>(CeilDiv(target, sources * chunks), 1, most);
  p.chunk_rows = static_cast<int32_t>(chunk);
  p.chunks = static_cast<int32_t>(chunks);
  p.splits = static_cast<int32_t>(splits);
  return LaunchAfterPrior(NcclSelectKernel, static_cast<int>(sources * chunks * splits), kNcclSelectThreads, stream,
                          p);
}

}  // namespace flashinfer_a2a
