// The nccl transport's dispatch wire: what one rank's send buffer holds, and so what the all-gather hands every rank
// of every other (flashinfer_a2a/transports/nccl.py; flashinfer_a2a/library/nccl_wire.py mirrors this layout for
// the CPU path, pinned by tests/test_nccl_kernels.py).
//
//   [ mask planes | segment 0 | segment 1 | ... ]      every part starting on a kNcclWireAlign-byte boundary
//
// - mask planes: [ceil(ep_size / 8), plane_stride] uint8, plane_stride = runtime_max rounded up to kNcclWireAlign.
//   Bit b of byte t of plane j is set when local token t goes to rank 8j + b; bytes from num_tokens on are 0. Plane
//   major, so that counting the rows one rank takes reads 16 tokens per load.
// - segment s: [runtime_max, row_bytes[s]]; rows from num_tokens on are unspecified (never selected). A quantizing
//   dispatch's values, then its scales (row-major; swizzled ones padded with zero columns to a multiple of 4, the
//   128x4 tiles are laid out by the receiver), then the payloads as they are.
//
// Plain C++ (no CUDA runtime calls) but for the device helpers at the bottom.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ptx.cuh"
#include "workspace_layout.cuh"

namespace flashinfer_a2a {

constexpr int64_t kNcclWireAlign = 16;                    // one 16-byte vector
constexpr int kNcclMaxMaskPlanes = (kMaxRanks + 7) / 8;  // 9
// A quantizing dispatch takes at most kMaxPayloads - 1 payloads and sends the first as two segments.
constexpr int kNcclMaxSegments = kMaxPayloads;

struct NcclWireLayout {
  int32_t ep_size;
  int32_t runtime_max;
  int32_t mask_planes;   // ceil(ep_size / 8)
  int64_t plane_stride;  // bytes of one mask plane
  int32_t num_segments;
  int64_t row_bytes[kNcclMaxSegments];
  int64_t offset[kNcclMaxSegments];
  int64_t total_bytes;  // of one rank's send buffer
};

inline NcclWireLayout MakeNcclWireLayout(int32_t ep_size, int32_t runtime_max, const int64_t* row_bytes,
                                         int num_segments) {
  NcclWireLayout w{};
  w.ep_size = ep_size;
  w.runtime_max = runtime_max;
  w.mask_planes = (ep_size + 7) / 8;
  w.plane_stride = AlignUp(runtime_max, kNcclWireAlign);
  w.num_segments = num_segments;
  int64_t end = w.mask_planes * w.plane_stride;
  for (int s = 0; s < num_segments; ++s) {
    w.row_bytes[s] = row_bytes[s];
    w.offset[s] = AlignUp(end, kNcclWireAlign);
    end = w.offset[s] + runtime_max * row_bytes[s];
  }
  w.total_bytes = AlignUp(end, kNcclWireAlign);
  return w;
}

// Row bytes of the two segments a quantized first payload of `hidden` elements crosses as: its values, then its
// scales (swizzled ones as whole tiles of 4 one-byte columns).
inline void NcclQuantRowBytes(QuantFormat format, int64_t hidden, bool swizzled, int64_t* values, int64_t* scales) {
  const QuantWire wire = WireOf(format);
  *values = wire.ValueBytes(hidden);
  *scales = swizzled ? AlignUp(wire.ScaleCols(hidden), 4) : wire.ScaleCols(hidden) * wire.scale_bytes;
}

constexpr int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// 16, 4 or 1: the widest of the copy kernels' vectors dividing every value (byte counts and addresses).
inline int32_t NcclVecBytes(uint64_t a, uint64_t b, uint64_t c = 0) {
  const int v = VecBytesFor(a, b, c);
  return v >= 16 ? 16 : v >= 4 ? 4 : 1;
}

// Where plane j of a send buffer's mask lies.
__host__ __device__ __forceinline__ const uint8_t* MaskPlane(const uint8_t* send, const NcclWireLayout& w, int j) {
  return send + j * w.plane_stride;
}

// Adds to counts[b], for each b < num_bits, how many of the first `rows` bytes of a mask plane have bit
// first_bit + b set. rows is a multiple of 16 and the plane 16-byte aligned (every plane of a send buffer is). Every
// thread of the block calls it with the same arguments; the caller synchronizes the block before reading counts.
__device__ __forceinline__ void CountPlaneBits(const uint8_t* plane, int64_t rows, int first_bit, int num_bits,
                                               int32_t* counts) {
  int32_t mine[8] = {};
  const uint4* words = reinterpret_cast<const uint4*>(plane);
  for (int64_t i = threadIdx.x; i < rows / 16; i += blockDim.x) {
    const uint4 w = words[i];
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const uint32_t m = 0x01010101u << (first_bit + b);  // bit first_bit + b of each byte (b < num_bits only)
      if (b < num_bits) mine[b] += __popc(w.x & m) + __popc(w.y & m) + __popc(w.z & m) + __popc(w.w & m);
    }
  }
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    if (b >= num_bits) break;  // uniform: every lane takes the same shuffles
#pragma unroll
    for (int mask = 16; mask >= 1; mask /= 2) mine[b] += __shfl_xor_sync(0xffffffffu, mine[b], mask);
    if (threadIdx.x % 32 == 0 && mine[b] != 0) atomicAdd(&counts[b], mine[b]);
  }
}

}  // namespace flashinfer_a2a
