// Test-only library: the device conversions of include/flashinfer_a2a/quant.cuh applied row by row, one thread per
// block of elements, so tests/gpu/test_quant_conversions.py can compare them with the reference bit for bit.
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <flashinfer_a2a/quant.cuh>

namespace {

using tvm::ffi::TensorView;
namespace q = flashinfer_a2a::quant;

enum Format : int64_t { kFp8Block = 0, kMxfp8 = 1, kNvfp4 = 2 };

// x [rows, hidden] fp32; values [rows, hidden] (fp8) or [rows, ceil(hidden / 2)] (nvfp4) uint8; scales
// [rows, blocks] fp32 (fp8 block) or uint8.
__global__ void QuantizeRowsKernel(const float* x, int rows, int hidden, int format, float global_scale,
                                   uint8_t* values, void* scales) {
  const int block = format == kFp8Block ? q::kFp8Block : format == kMxfp8 ? q::kMxfp8Block : q::kNvfp4Block;
  const int blocks = (hidden + block - 1) / block;
  const int id = blockIdx.x * blockDim.x + threadIdx.x;
  if (id >= rows * blocks) return;
  const int row = id / blocks, b = id % blocks;
  const float* in = x + static_cast<int64_t>(row) * hidden;
  const int begin = b * block, end = min(hidden, begin + block);
  float amax = 0.0f;
  for (int i = begin; i < end; ++i) amax = fmaxf(amax, fabsf(in[i]));
  if (format != kNvfp4) {  // the kernels' eight-element conversions, zeros past the block's end
    const float scale = q::Fp8BlockScale(amax);
    const int e = q::MxExponent(amax);
    if (format == kFp8Block) {
      static_cast<float*>(scales)[id] = scale;
    } else {
      static_cast<uint8_t*>(scales)[id] = q::MxScaleByte(e);
    }
    for (int i0 = begin; i0 < end; i0 += 8) {
      float x8[8];
      for (int i = 0; i < 8; ++i) x8[i] = i0 + i < end ? in[i0 + i] : 0.0f;
      const uint2 v = format == kFp8Block ? q::Fp8BlockValues(x8, scale, __frcp_rn(scale)) : q::Mxfp8Values(x8, e);
      uint8_t* out = values + static_cast<int64_t>(row) * hidden + i0;
      for (int i = 0; i < 8 && i0 + i < end; ++i) out[i] = static_cast<uint8_t>((i < 4 ? v.x : v.y) >> (8 * (i % 4)));
    }
  } else {
    const uint8_t sf = q::Nvfp4ScaleBits(amax, global_scale);
    static_cast<uint8_t*>(scales)[id] = sf;
    const float inverse = q::Nvfp4Inverse(sf, global_scale);
    uint8_t* out = values + static_cast<int64_t>(row) * ((hidden + 1) / 2);
    for (int i0 = begin; i0 < end; i0 += 8) {  // the kernels' eight codes; a nibble past the block's end stays 0
      float x8[8], magnitudes[8];
      for (int i = 0; i < 8; ++i) x8[i] = i0 + i < end ? in[i0 + i] : 0.0f;
      for (int i = 0; i < 8; ++i) magnitudes[i] = q::E2m1Magnitude(x8[i]);
      const uint32_t codes = q::Nvfp4Codes(magnitudes, inverse, q::E2m1Signs(x8));
      for (int i = 0; i < 8 && i0 + i < end; i += 2) {
        const uint32_t mask = i0 + i + 1 < end ? 0xFFu : 0xFu;
        out[(i0 + i) / 2] = static_cast<uint8_t>((codes >> (4 * i)) & mask);
      }
    }
  }
}

void QuantizeRows(TensorView x, int64_t format, double global_scale, TensorView values, TensorView scales) {
  const int rows = static_cast<int>(x.size(0)), hidden = static_cast<int>(x.size(1));
  const int block = format == kFp8Block ? q::kFp8Block : format == kMxfp8 ? q::kMxfp8Block : q::kNvfp4Block;
  const int threads = rows * ((hidden + block - 1) / block);
  QuantizeRowsKernel<<<(threads + 127) / 128, 128>>>(static_cast<const float*>(x.data_ptr()), rows, hidden,
                                                     static_cast<int>(format), static_cast<float>(global_scale),
                                                     static_cast<uint8_t*>(values.data_ptr()), scales.data_ptr());
  TVM_FFI_ICHECK(cudaDeviceSynchronize() == cudaSuccess) << "quantize_rows failed";
}

}  // namespace

TVM_FFI_DLL_EXPORT_TYPED_FUNC(quantize_rows, QuantizeRows);
