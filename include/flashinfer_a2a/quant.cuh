// Device conversions of the quantized wire formats. flashinfer_a2a/reference/quant.py is the bit-exact definition:
// every step here is the same single IEEE-rounded fp32 operation (__fdiv_rn / __fmul_rn: never contracted into a
// fused multiply-add), and the narrow formats convert through CUTLASS's numeric types (round to nearest even),
// after the same clamp the reference applies (so saturation never depends on a conversion's overflow behaviour).
#pragma once

#include <cuda_runtime.h>
#include <cutlass/float8.h>
#include <cutlass/float_subbyte.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>

namespace flashinfer_a2a::quant {

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
constexpr float kFp8AmaxFloor = 1e-10f;  // an all-zero FP8 block still gets a finite scale
constexpr int kFp8Block = 128;
constexpr int kMxfp8Block = 32;
constexpr int kNvfp4Block = 16;

// E4M3 bits of v: round to nearest even, saturating at +-448.
__device__ __forceinline__ uint8_t ToE4m3(float v) {
  return cutlass::float_e4m3_t(fminf(fmaxf(v, -kE4m3Max), kE4m3Max)).storage;
}

__device__ __forceinline__ float FromE4m3(uint8_t bits) {
  return static_cast<float>(cutlass::float_e4m3_t::bitcast(bits));
}

// 4-bit E2M1 code of v: round to nearest even, saturating at +-6 (the sign kept when v rounds to zero).
//
// Where the GPU converts E2M1 in hardware (sm_100a and later), CUTLASS's array converter emits
// cvt.rn.satfinite.e2m1x2.f32. Elsewhere (sm_90a) CUTLASS's fallback is a generic software conversion of about 250
// instructions an element (measured: an NVFP4 dispatch of 8192 tokens of 7168 took 564 us against 112 us for the
// same bytes pre-quantized), so Hopper uses the reference's own definition: count the rounding midpoints below |v|,
// a tie going to the even code. tests/gpu/test_quant_conversions.py checks it bit for bit against the reference.
__device__ __forceinline__ uint32_t E2m1Code(float v) {
  const float a = fabsf(v);
  const uint32_t code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) +
                        (a > 5.0f);
  return code | (signbit(v) ? 8u : 0u);
}

// Eight E2M1 codes, element i in bits 4i..4i+3 (two per byte, low nibble first).
__device__ __forceinline__ uint32_t ToE2m1x8(const float (&v)[8]) {
#if defined(CUDA_PTX_FP4FP6_CVT_ENABLED)
  cutlass::Array<float, 8> in;
#pragma unroll
  for (int i = 0; i < 8; ++i) in[i] = fminf(fmaxf(v[i], -kE2m1Max), kE2m1Max);
  const auto out = cutlass::NumericArrayConverter<cutlass::float_e2m1_t, float, 8>::convert(in);
  return reinterpret_cast<const uint32_t&>(out);
#else
  uint32_t codes = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) codes |= E2m1Code(v[i]) << (4 * i);
  return codes;
#endif
}

__device__ __forceinline__ uint8_t ToE2m1(float v) {
  const float eight[8] = {v, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  return static_cast<uint8_t>(ToE2m1x8(eight) & 0xF);
}

// FP8 block scales (DeepSeek style): one fp32 scale per 128 elements.
__device__ __forceinline__ float Fp8BlockScale(float amax) {
  return __fdiv_rn(fmaxf(amax, kFp8AmaxFloor), kE4m3Max);
}
__device__ __forceinline__ uint8_t Fp8BlockValue(float x, float scale) { return ToE4m3(__fdiv_rn(x, scale)); }

// MXFP8: the smallest e with amax <= 448 * 2^e, clamped to [-127, 127]; -127 for an all-zero block. From frexp
// (amax = m * 2^k, m in [0.5, 1); 448 = 0.875 * 2^9), so no rounding is involved.
__device__ __forceinline__ int MxExponent(float amax) {
  if (amax == 0.0f) return -127;
  int k;
  const float m = frexpf(amax, &k);
  return min(max(m <= 0.875f ? k - 9 : k - 8, -127), 127);
}
__device__ __forceinline__ uint8_t MxScaleByte(int e) { return static_cast<uint8_t>(e + 127); }  // UE8M0: 2^(b-127)
__device__ __forceinline__ uint8_t Mxfp8Value(float x, int e) { return ToE4m3(__fmul_rn(x, ldexpf(1.0f, -e))); }

// NVFP4: a UE4M3 scale per 16 elements under a per-tensor fp32 global scale.
__device__ __forceinline__ uint8_t Nvfp4ScaleBits(float amax, float global_scale) {
  return ToE4m3(fmaxf(__fmul_rn(global_scale, __fdiv_rn(amax, kE2m1Max)), 0.0f));
}
// What the elements of a block with scale bits `sf` are multiplied by before rounding to E2M1.
__device__ __forceinline__ float Nvfp4Inverse(uint8_t sf, float global_scale) {
  const float scale = FromE4m3(sf);
  return scale == 0.0f ? 0.0f : __fdiv_rn(global_scale, scale);
}
__device__ __forceinline__ uint8_t Nvfp4Code(float x, float inverse) { return ToE2m1(__fmul_rn(x, inverse)); }
__device__ __forceinline__ uint32_t Nvfp4Codes(const float (&x)[8], float inverse) {
  float scaled[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) scaled[i] = __fmul_rn(x[i], inverse);
  return ToE2m1x8(scaled);
}

}  // namespace flashinfer_a2a::quant
