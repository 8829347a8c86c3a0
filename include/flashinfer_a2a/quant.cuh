// Device conversions of the quantized wire formats. flashinfer_a2a/reference/quant.py is the bit-exact definition:
// every step here gives the result of the same IEEE-rounded fp32 operation (__fmul_rn / __fmaf_rn, never contracted
// otherwise), and the narrow formats convert through CUTLASS's numeric types (round to nearest even), saturating as
// the reference's clamp does (E4M3 by the conversion's satfinite, which gives the clamp's result for every value but
// NaN). Four steps take a shorter exact route than the reference's text, each checked exhaustively by
// tests/test_quant_identities.py: the FP8 block quotient and scale (a reciprocal and one correction instead of a
// division), the MXFP8 exponent (from the maximum's bits instead of frexp) and Hopper's E2M1 rounding.
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

#if defined(__CUDA_ARCH__) && !defined(CUDA_PTX_FP8_CVT_ENABLED)
#error "ToE4m3 and ToE4m3x8 rely on cvt.rn.satfinite.e4m3x2.f32 (sm_89 and later) to saturate"
#endif

// E4M3 bits of v, round to nearest even: values beyond +-448, infinities included, saturate by the conversion's
// satfinite, as the reference's clamp makes them, so no clamp is spent on them.
__device__ __forceinline__ uint8_t ToE4m3(float v) { return cutlass::float_e4m3_t(v).storage; }

// E4M3 bits of eight values as ToE4m3 converts them, element i in byte i, two per cvt.rn.satfinite instruction.
__device__ __forceinline__ uint2 ToE4m3x8(const float (&v)[8]) {
  cutlass::Array<float, 8> in;
#pragma unroll
  for (int i = 0; i < 8; ++i) in[i] = v[i];
  const auto out = cutlass::NumericArrayConverter<cutlass::float_e4m3_t, float, 8>::convert(in);
  uint2 bytes;
  memcpy(&bytes, &out, sizeof(bytes));
  return bytes;
}

__device__ __forceinline__ float FromE4m3(uint8_t bits) {
  return static_cast<float>(cutlass::float_e4m3_t::bitcast(bits));
}

// E2M1 on Hopper. Where the GPU converts E2M1 in hardware (sm_100a and later), CUTLASS's array converter emits
// cvt.rn.satfinite.e2m1x2.f32. Elsewhere (sm_90a) CUTLASS's fallback is a generic software conversion of about 250
// instructions an element (measured: an NVFP4 dispatch of 8192 tokens of 7168 took 564 us against 112 us for the
// same bytes pre-quantized), so Hopper rounds by hand. The magnitudes 0, 0.5, 1, 1.5 | 2, 3 | 4, 6 are spaced 0.5
// below 2, 1 below 4 and 2 above, so the code of a = |v| is RN(2a) below 2, 2 + RN(a) below 4 and 4 + RN(a / 2)
// above, at most 7 (ties to even give the reference's midpoints). The three lines meet where the binades do and
// min(2a, a + 2, a / 2 + 4) is the right one everywhere; rounding is monotonic, so the code is the least of the
// three rounded values, each one fma adding 2^23 (whose sum's low bits then hold the integer). Capping a at 6 first
// keeps the least at most 7; the rounded values are positive floats, which order as their bits do, so one
// three-way integer minimum (a Hopper DPX instruction) takes the least.
constexpr float kE2m1Round = 8388608.0f;          // 2^23
constexpr uint32_t kE2m1RoundBits = 0x4B000000u;  // its bits: a code k rounds to kE2m1RoundBits + k
// kE2m1RoundBits + the 3-bit E2M1 code of a magnitude a (+0 or more, not NaN): round to nearest even, saturating at
// 6. Equal to the reference's (count the rounding midpoints below a) for every such a
// (tests/test_quant_identities.py); tests/gpu/test_quant_conversions.py checks it on the GPU.
__device__ __forceinline__ uint32_t E2m1MagnitudeBits(float a) {
  const float capped = fminf(a, kE2m1Max);
  return __vimin3_u32(__float_as_uint(__fmaf_rn(capped, 2.0f, kE2m1Round)),
                      __float_as_uint(__fadd_rn(capped, kE2m1Round + 2.0f)),
                      __float_as_uint(__fmaf_rn(capped, 0.5f, kE2m1Round + 4.0f)));
}

// The codes of eight values are taken as magnitudes and signs apart. E2m1Magnitude is |v| with a NaN as 0 (its code,
// as the reference's count of midpoints gives it); E2m1Signs puts element i's sign in bit 4i + 3, from fp32 values
// or from eight 16-bit floats (bf16 or fp16, two per word, low half first), whose high bytes (the signs') four byte
// permutes pick into words of the even and the odd elements.
__device__ __forceinline__ float E2m1Magnitude(float v) { return fmaxf(fabsf(v), 0.0f); }
__device__ __forceinline__ uint32_t E2m1Signs(const float (&v)[8]) {
  uint32_t signs = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) signs |= (__float_as_uint(v[i]) >> 31) << (4 * i + 3);
  return signs;
}
__device__ __forceinline__ uint32_t E2m1Signs(const uint4& halves) {
  const uint32_t first = __byte_perm(halves.x, halves.y, 0x7351);  // elements 0, 2, 1, 3
  const uint32_t last = __byte_perm(halves.z, halves.w, 0x7351);   // elements 4, 6, 5, 7
  const uint32_t even = __byte_perm(first, last, 0x5410);          // sign of element 2j in bit 8j + 7
  const uint32_t odd = __byte_perm(first, last, 0x7632);           // sign of element 2j + 1 in bit 8j + 7
  return ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
}

// Eight E2M1 codes, element i in bits 4i..4i+3 (two per byte, low nibble first), from magnitudes (+0 or more, not
// NaN) and their signs (E2m1Signs).
__device__ __forceinline__ uint32_t ToE2m1x8(const float (&magnitudes)[8], uint32_t signs) {
#if defined(CUDA_PTX_FP4FP6_CVT_ENABLED)
  cutlass::Array<float, 8> in;
#pragma unroll
  for (int i = 0; i < 8; ++i) in[i] = fminf(magnitudes[i], kE2m1Max);
  const auto out = cutlass::NumericArrayConverter<cutlass::float_e2m1_t, float, 8>::convert(in);
  return reinterpret_cast<const uint32_t&>(out) | signs;
#else
  // Byte j is the low byte of E2m1MagnitudeBits(a[2j]) + (E2m1MagnitudeBits(a[2j + 1]) << 4): the codes are at most
  // 7, so nothing carries out of it, and the kE2m1RoundBits each carries stay in the bytes above.
  uint32_t pairs[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    pairs[j] = E2m1MagnitudeBits(magnitudes[2 * j]) + (E2m1MagnitudeBits(magnitudes[2 * j + 1]) << 4);
  }
  const uint32_t codes =
      __byte_perm(__byte_perm(pairs[0], pairs[1], 0x0040), __byte_perm(pairs[2], pairs[3], 0x0040), 0x5410);
  return codes | signs;
#endif
}

// x / scale without a division, from inverse = RN(1 / scale) (non-zero): q = RN(x * inverse) is within an ulp of
// the quotient, the residual x - q * scale is exact in one fused multiply-add, and one correction step rounds
// correctly (Markstein). The residual is taken as -(q * scale - x), which is -0 where it is zero, so that the
// correction keeps the quotient's sign where it is zero too (x = -0 gives -0, as the division does; x - q * scale
// would give +0). Where the residual underflows (|x / scale| < 2^-12, which E4M3 rounds to a zero of the quotient's
// sign) the result may differ in its last bit; the E4M3 value never does: checked for every bf16 and fp16 x and
// block maximum, and 10^8 random fp32 pairs (tests/test_quant_identities.py). Three instructions and no branch,
// against a division's nine and a branch.
__device__ __forceinline__ float Fp8BlockQuotient(float x, float scale, float inverse) {
  const float q = __fmul_rn(x, inverse);
  const float negated_residual = __fmaf_rn(q, scale, -x);
  return __fmaf_rn(-negated_residual, inverse, q);
}

// FP8 block scales (DeepSeek style): one fp32 scale per 128 elements, max(amax, 1e-10) / 448, taken as the quotient
// above from the constant RN(1 / 448): equal to the division for every finite amax (tests/test_quant_identities.py)
// without its branch; an infinite maximum, whose residual would be NaN, gives the division's infinity.
__device__ __forceinline__ float Fp8BlockScale(float amax) {
  const float a = fmaxf(amax, kFp8AmaxFloor);
  return a == INFINITY ? a : Fp8BlockQuotient(a, kE4m3Max, 1.0f / kE4m3Max);
}

// The quotients of eight elements of one FP8 block by a finite scale; inverse = __frcp_rn(scale), not 0.
__device__ __forceinline__ void Fp8BlockQuotients(const float (&x)[8], float scale, float inverse, float (&q)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = Fp8BlockQuotient(x[i], scale, inverse);
}

// The E4M3 values of eight elements of one FP8 block with a finite scale, element i in byte i.
__device__ __forceinline__ uint2 Fp8BlockValuesFinite(const float (&x)[8], float scale, float inverse) {
  float q[8];
  Fp8BlockQuotients(x, scale, inverse, q);
  return ToE4m3x8(q);
}

// The same for any scale: an infinite one (the block holds an infinity, inverse 0) takes the divisions.
__device__ __forceinline__ uint2 Fp8BlockValues(const float (&x)[8], float scale, float inverse) {
  float q[8];
  if (inverse != 0.0f) {  // one test per lane: a test per element made every quotient a branch of its own
    Fp8BlockQuotients(x, scale, inverse, q);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = __fdiv_rn(x[i], scale);
  }
  return ToE4m3x8(q);
}

// MXFP8: the smallest e with amax <= 448 * 2^e, clamped to [-127, 127]; -127 for an all-zero block. The reference
// takes it from frexp (amax = m * 2^k, m in [0.5, 1); 448 = 0.875 * 2^9: e = k - 9 where m <= 0.875, else k - 8);
// here from amax's bits (k = biased exponent - 126, m <= 0.875 where the stored mantissa is at most 0x600000), which
// is a few integer instructions against frexpf's forty and its branches. Subnormal amax gives e < -127 (clamped),
// an infinite or NaN maximum -8, as frexp's exponent 0 does. Equal to the frexp form for every amax >= +0 (a maximum
// of magnitudes; tests/test_quant_identities.py).
__device__ __forceinline__ int MxExponent(float amax) {
  const uint32_t bits = __float_as_uint(amax);
  const int biased = static_cast<int>(bits >> 23);
  const int e = biased - ((bits & 0x7FFFFFu) <= 0x600000u ? 135 : 134);
  return biased == 255 ? -8 : max(e, -127);
}
__device__ __forceinline__ uint8_t MxScaleByte(int e) { return static_cast<uint8_t>(e + 127); }  // UE8M0: 2^(b-127)
// The E4M3 values of eight elements of one MXFP8 block with exponent e, element i in byte i.
__device__ __forceinline__ uint2 Mxfp8Values(const float (&x)[8], int e) {
  const float factor = __uint_as_float(static_cast<uint32_t>(127 - e) << 23);  // 2^-e: e is in [-127, 120]
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
// The codes of x * inverse from the magnitudes of x (E2m1Magnitude) and E2m1Signs of x, which are those of the
// products: an inverse is 0 or positive (a scale is non-zero only where global_scale * amax / 6 is positive), so
// |x| * inverse is the product's magnitude and x its sign, zeros included (a product can be NaN only for a NaN or
// infinite x or a global scale above 2^119, outside the reference's bit-exact domain).
__device__ __forceinline__ uint32_t Nvfp4Codes(const float (&magnitudes)[8], float inverse, uint32_t signs) {
  float scaled[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) scaled[i] = __fmul_rn(magnitudes[i], inverse);
  return ToE2m1x8(scaled, signs);
}

}  // namespace flashinfer_a2a::quant
