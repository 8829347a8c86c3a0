// The nccl transport's pack: one kernel writes a rank's send buffer (nccl_wire.cuh) from its dispatch inputs: each
// token's destination mask, the payloads' rows, and payloads[0] quantized into its wire format by the device code of
// the NVLink fused dispatch (quant_dispatch.cuh), so that the values and scales are the same bytes.
//
// Three grid-stride loops, independent of each other (no block waits on another): threads over the mask planes'
// bytes (one token each), threads over 16-, 4- or 1-byte vectors of each payload copied as it is (the send segment
// of a payload is its rows back to back, as the payload is), warps over (token, 1024-element piece) of the quantized
// payload.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "nccl_wire.cuh"
#include "protocol.cuh"
#include "quant_dispatch.cuh"

namespace flashinfer_a2a {

constexpr int kNcclPackThreads = 256;
constexpr int kNcclPackWarps = kNcclPackThreads / 32;
constexpr int kNcclCopyBatch = 4;  // vectors a thread loads before storing them

struct NcclPackParams {
  uint8_t* send;  // [wire.total_bytes]
  NcclWireLayout wire;
  int32_t num_tokens;  // <= wire.runtime_max
  int32_t top_k;
  int32_t num_experts;
  const void* topk_ids;  // [num_tokens, top_k] int32|int64
  int32_t num_copies;    // payloads sent as they are
  const uint8_t* copy_src[kMaxPayloads];  // [num_tokens, wire.row_bytes[copy_segment[c]]]
  int32_t copy_segment[kMaxPayloads];
  int32_t copy_vec_bytes[kMaxPayloads];  // 16, 4 or 1: divides the payload's bytes and its address
  const uint8_t* quant_src;  // payloads[0] [num_tokens, hidden] bf16|fp16 when quantized
  DispatchQuant quant;       // values in segment 0 and scales in segment 1 of the send buffer, row-major
};

// Grid-stride copy of `bytes` (a multiple of kVec) from src to dst, thread `first` of `stride`: kNcclCopyBatch
// vectors in flight per thread.
template <int kVec>
__device__ __forceinline__ void CopySpan(uint8_t* dst, const uint8_t* src, int64_t bytes, int64_t first,
                                         int64_t stride) {
  using Vec = typename VecOf<kVec>::Type;
  const int64_t n = bytes / kVec;
  const Vec* in = reinterpret_cast<const Vec*>(src);
  Vec* out = reinterpret_cast<Vec*>(dst);
  for (int64_t i0 = first; i0 < n; i0 += stride * kNcclCopyBatch) {
    Vec v[kNcclCopyBatch];
#pragma unroll
    for (int j = 0; j < kNcclCopyBatch; ++j) {
      if (i0 + j * stride < n) v[j] = in[i0 + j * stride];
    }
#pragma unroll
    for (int j = 0; j < kNcclCopyBatch; ++j) {
      if (i0 + j * stride < n) out[i0 + j * stride] = v[j];
    }
  }
}

// Byte t of every mask plane: the ranks token t goes to (TokenRanks: -1 and ids outside [0, num_experts) reach
// none), 0 from num_tokens on.
template <typename IdT>
__device__ __forceinline__ void PackMaskPlanes(const NcclPackParams& p, const ExpertPartition& part, int64_t first,
                                               int64_t stride) {
  const IdT* ids = static_cast<const IdT*>(p.topk_ids);
  for (int64_t t = first; t < p.wire.plane_stride; t += stride) {
    RankMask mask = {};
    if (t < p.num_tokens) mask = TokenRanks(ids, t, p.top_k, part, nullptr, 0, RankMask{});
    for (int j = 0; j < p.wire.mask_planes; ++j) {
      p.send[j * p.wire.plane_stride + t] = static_cast<uint8_t>(mask.Word(8 * j) >> (8 * (j % 4)));
    }
  }
}

template <QuantFormat F>
__device__ __forceinline__ void PackQuantized(const NcclPackParams& p, const float* nvfp4_inverse) {
  const int lane = threadIdx.x % 32;
  const int pieces = (p.quant.hidden + kQuantPieceElems - 1) / kQuantPieceElems;
  const int64_t items = static_cast<int64_t>(p.num_tokens) * pieces;
  for (int64_t item = blockIdx.x * kNcclPackWarps + threadIdx.x / 32; item < items;
       item += static_cast<int64_t>(gridDim.x) * kNcclPackWarps) {
    const int64_t t = item / pieces;
    const int piece = static_cast<int>(item % pieces);
    QuantizeTokenPiece<F>(p.quant, p.quant_src, t, piece, lane, nvfp4_inverse,
                          [&](auto whole, const LaneQuant(&lq)[kQuantRounds], uint32_t scales) {
                            StorePieceRow<F, decltype(whole)::value>(p.quant, p.send, 0, t, t, piece, lq, scales,
                                                                     lane);
                          });
  }
}

template <typename IdT, QuantFormat F>
__global__ void __launch_bounds__(kNcclPackThreads) NcclPackKernel(const __grid_constant__ NcclPackParams p) {
  __shared__ uint8_t s_rank_of[kRankTableExperts];
  __shared__ float s_nvfp4_inverse[F == QuantFormat::kNvfp4 ? kNvfp4Inverses : 1];
  WaitPriorKernels();
  ExpertPartition part(p.num_experts, p.wire.ep_size);
  part.FillTable(s_rank_of);
  if constexpr (F == QuantFormat::kNvfp4) FillNvfp4Inverses(p.quant, s_nvfp4_inverse);
  __syncthreads();
  if constexpr (F != QuantFormat::kNone) PackQuantized<F>(p, s_nvfp4_inverse);
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kNcclPackThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kNcclPackThreads;
  for (int c = 0; c < p.num_copies; ++c) {
    uint8_t* dst = p.send + p.wire.offset[p.copy_segment[c]];
    const int64_t bytes = p.num_tokens * p.wire.row_bytes[p.copy_segment[c]];
    switch (p.copy_vec_bytes[c]) {
      case 16: CopySpan<16>(dst, p.copy_src[c], bytes, first, stride); break;
      case 4: CopySpan<4>(dst, p.copy_src[c], bytes, first, stride); break;
      default: CopySpan<1>(dst, p.copy_src[c], bytes, first, stride); break;
    }
  }
  PackMaskPlanes<IdT>(p, part, first, stride);
}

// One thread block per 4096 bytes to move or per kNcclPackWarps quantized pieces, at most 4 per multiprocessor.
inline cudaError_t LaunchNcclPack(const NcclPackParams& p, bool ids_int64, int grid_sms, cudaStream_t stream) {
  int64_t bytes = p.wire.plane_stride;
  for (int c = 0; c < p.num_copies; ++c) bytes += p.num_tokens * p.wire.row_bytes[p.copy_segment[c]];
  const int64_t pieces = p.quant.format == QuantFormat::kNone
                             ? 0
                             : p.num_tokens * ((p.quant.hidden + kQuantPieceElems - 1) / kQuantPieceElems);
  const int64_t wanted = std::max<int64_t>({1, (bytes + 4095) / 4096, (pieces + kNcclPackWarps - 1) / kNcclPackWarps});
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, int64_t{grid_sms} * 4));
  void (*kernel)(NcclPackParams) = nullptr;
  switch (p.quant.format) {
    case QuantFormat::kNone:
      kernel = ids_int64 ? NcclPackKernel<int64_t, QuantFormat::kNone> : NcclPackKernel<int32_t, QuantFormat::kNone>;
      break;
    case QuantFormat::kFp8Block:
      kernel = ids_int64 ? NcclPackKernel<int64_t, QuantFormat::kFp8Block>
                         : NcclPackKernel<int32_t, QuantFormat::kFp8Block>;
      break;
    case QuantFormat::kMxfp8:
      kernel =
          ids_int64 ? NcclPackKernel<int64_t, QuantFormat::kMxfp8> : NcclPackKernel<int32_t, QuantFormat::kMxfp8>;
      break;
    case QuantFormat::kNvfp4:
      kernel =
          ids_int64 ? NcclPackKernel<int64_t, QuantFormat::kNvfp4> : NcclPackKernel<int32_t, QuantFormat::kNvfp4>;
      break;
  }
  return LaunchAfterPrior(kernel, blocks, kNcclPackThreads, stream, p);
}

}  // namespace flashinfer_a2a
