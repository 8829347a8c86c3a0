// Device conversions of the quantized wire formats. flashinfer_a2a/reference/quant.py is the bit-exact definition:
// every step here is the same single IEEE-rounded fp32 operation (__fdiv_rn / __fmul_rn: never contracted into a
// fused multiply-add), and the narrow formats convert through CUTLASS's numeric types (round to nearest even),
// after the same clamp the reference applies (so saturation never depends on a conversion's overflow behaviour).
#pragma once

#include <cuda_runtime.h>
#include <cutlass/float8.h>
#include <cutlass/float_subbyte.h>

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
__device__ __forceinline__ uint8_t ToE2m1(float v) {
  return cutlass::float_e2m1_t(fminf(fmaxf(v, -kE2m1Max), kE2m1Max)).storage & 0xF;
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

}  // namespace flashinfer_a2a::quant
