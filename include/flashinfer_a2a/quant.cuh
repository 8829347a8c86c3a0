// Device conversions of the quantized wire formats. flashinfer_a2a/reference/quant.py is the bit-exact definition:
// every step here gives the result of the same IEEE-rounded fp32 operation (__fmul_rn / __fmaf_rn, never contracted
// otherwise), and the narrow formats convert through CUTLASS's numeric types (round to nearest even), after the same
// clamp the reference applies (so saturation never depends on a conversion's overflow behaviour). Two steps take a
// shorter exact route than the reference's text, each checked exhaustively by tests/test_quant_identities.py: the
// FP8 block quotient (a reciprocal and one correction instead of a division) and Hopper's E2M1 rounding.
#pragma once

#include <cuda_runtime.h>
#include <cutlass/float8.h>
#include <cutlass/float_subbyte.h>
#include <cutlass/numeric_conversion.h>

#include <cstdint>
#include <cstring>

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

// E4M3 bits of eight values, element i in byte i (two per cvt instruction where the GPU converts FP8).
__device__ __forceinline__ uint2 ToE4m3x8(const float (&v)[8]) {
  cutlass::Array<float, 8> in;
#pragma unroll
  for (int i = 0; i < 8; ++i) in[i] = fminf(fmaxf(v[i], -kE4m3Max), kE4m3Max);
  const auto out = cutlass::NumericArrayConverter<cutlass::float_e4m3_t, float, 8>::convert(in);
  uint2 bytes;
  memcpy(&bytes, &out, sizeof(bytes));
  return bytes;
}

__device__ __forceinline__ float FromE4m3(uint8_t bits) {
  return static_cast<float>(cutlass::float_e4m3_t::bitcast(bits));
}

// 4-bit E2M1 code of v: round to nearest even, saturating at +-6 (the sign kept when v rounds to zero).
//
// Where the GPU converts E2M1 in hardware (sm_100a and later), CUTLASS's array converter emits
// cvt.rn.satfinite.e2m1x2.f32. Elsewhere (sm_90a) CUTLASS's fallback is a generic software conversion of about 250
// instructions an element (measured: an NVFP4 dispatch of 8192 tokens of 7168 took 564 us against 112 us for the
// same bytes pre-quantized), so Hopper rounds by hand: |v| is scaled to the code spacing of its binade (0.5 below 2,
// 1 below 4, 2 above), 2^23 is added so that the sum's low bits hold the scaled value rounded to an integer (ties to
// even), and the binade's first code is added. Equal to the reference (count the rounding midpoints below |v|) for
// all 2^32 inputs, NaN included (tests/test_quant_identities.py); tests/gpu/test_quant_conversions.py checks it on
// the GPU.
__device__ __forceinline__ uint32_t E2m1Code(float v) {
  float a = fabsf(v);
  a = a == a ? fminf(a, 8.0f) : 0.0f;  // NaN passes no midpoint: code 0
  const bool low = a < 2.0f, mid = a < 4.0f;
  const float spacing_inverse = low ? 2.0f : mid ? 1.0f : 0.5f;
  const int first = low ? 0 : mid ? 2 : 4;
  const int rounded = static_cast<int>(__float_as_uint(__fmaf_rn(a, spacing_inverse, 8388608.0f)) - 0x4B000000u);
  return static_cast<uint32_t>(min(first + rounded, 7)) | (signbit(v) ? 8u : 0u);
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

// x / scale without a division, from inverse = RN(1 / scale): q = RN(x * inverse) is within an ulp of the quotient,
// the residual x - q * scale is exact in one fused multiply-add, and one correction step rounds correctly
// (Markstein). Where the residual underflows (|x / scale| < 2^-12, which E4M3 rounds to a zero of the quotient's
// sign) the result may differ in its last bit; the E4M3 value never does: checked for every bf16 and fp16 x and
// block maximum, and 10^8 random fp32 pairs (tests/test_quant_identities.py).
__device__ __forceinline__ float Fp8BlockQuotient(float x, float scale, float inverse) {
  const float q = __fmul_rn(x, inverse);
  const float residual = __fmaf_rn(-q, scale, x);
  return residual == 0.0f ? q : __fmaf_rn(residual, inverse, q);  // the test keeps the sign of a zero quotient
}

// The E4M3 values of eight elements of one FP8 block, element i in byte i.
__device__ __forceinline__ uint2 Fp8BlockValues(const float (&x)[8], float scale) {
  const float inverse = __frcp_rn(scale);
  float q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    q[i] = inverse != 0.0f ? Fp8BlockQuotient(x[i], scale, inverse) : __fdiv_rn(x[i], scale);  // 0: scale is inf
  }
  return ToE4m3x8(q);
}

// MXFP8: the smallest e with amax <= 448 * 2^e, clamped to [-127, 127]; -127 for an all-zero block. From frexp
// (amax = m * 2^k, m in [0.5, 1); 448 = 0.875 * 2^9), so no rounding is involved.
__device__ __forceinline__ int MxExponent(float amax) {
  if (amax == 0.0f) return -127;
  int k;
  const float m = frexpf(amax, &k);
  return min(max(m <= 0.875f ? k - 9 : k - 8, -127), 127);
}
__device__ __forceinline__ uint8_t MxScaleByte(int e) { return static_cast<uint8_t>(e + 127); }  // UE8M0: 2^(b-127)
// The E4M3 values of eight elements of one MXFP8 block with exponent e, element i in byte i.
__device__ __forceinline__ uint2 Mxfp8Values(const float (&x)[8], int e) {
  const float factor = ldexpf(1.0f, -e);
  float scaled[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) scaled[i] = __fmul_rn(x[i], factor);
  return ToE4m3x8(scaled);
}

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
