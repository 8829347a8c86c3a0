// Exhaustive checks of the places where include/flashinfer_a2a/quant.cuh computes a quantized value by a
// shorter route than the reference's text (flashinfer_a2a/reference/quant.py). Run by tests/test_quant_identities.py;
// the same operations in C (fmaf and float division are correctly rounded; compiled without contraction).
//
//   fp8_bf16, fp8_fp16: for every x of the type and every block maximum amax >= |x| of the type, the quotient
//     x / scale (scale = max(amax, 1e-10) / 448) computed as Fp8BlockQuotient does equals the division, or both
//     are below 2^-12 in magnitude with the same sign (E4M3 rounds both to that signed zero: its smallest
//     subnormal is 2^-9).
//   fp8_fp32: the same on random fp32 pairs (the GPU conversion tests feed fp32 rows).
//   fp8_scale: for every amax >= +0 up to inf, Fp8BlockScale (the same quotient of max(amax, 1e-10) by 448) equals
//     the division.
//   mx_exponent: for every amax >= +0 (and a NaN), MxExponent equals the reference's frexp form, and its scaling
//     factor 2^-e built from bits equals ldexpf(1, -e).
//   e2m1: for all 2^32 fp32 bit patterns v, E2m1MagnitudeBits(E2m1Magnitude(v)) equals the reference's count of
//     rounding midpoints below |v| (plus the 2^23 it carries).
// Prints "<check>: <cases> cases, <n> differ" and exits 1 if any differs.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static float from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static uint32_t bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static float bf16_value(uint32_t h) { return from_bits(h << 16); }
static float fp16_value(uint32_t h) {
  const uint32_t sign = (h >> 15) & 1, exponent = (h >> 10) & 31, mantissa = h & 1023;
  if (exponent == 31) return from_bits((sign << 31) | 0x7f800000u | (mantissa << 13));
  const float v = exponent == 0 ? ldexpf((float)mantissa, -24) : from_bits(((exponent + 112) << 23) | (mantissa << 13));
  return sign ? -v : v;
}

// Fp8BlockScale and Fp8BlockQuotient.
static float fp8_scale(float amax) { return fmaxf(amax, 1e-10f) / 448.0f; }
static float fp8_quotient(float x, float scale, float inverse) {
  const float q = x * inverse;
  const float negated_residual = fmaf(q, scale, -x);
  return fmaf(-negated_residual, inverse, q);
}
static int same_e4m3(float a, float b) {
  return bits(a) == bits(b) || (fabsf(a) < 0x1p-12f && fabsf(b) < 0x1p-12f && signbit(a) == signbit(b));
}
static int fp8_pair_differs(float x, float amax) {
  const float scale = fp8_scale(amax);
  return !same_e4m3(fp8_quotient(x, scale, 1.0f / scale), x / scale);
}

static long long fp8_exhaustive(float (*value)(uint32_t), long long* cases) {
  long long differ = 0;
  for (uint32_t a = 0; a < 0x8000; ++a) {
    const float amax = value(a);
    if (!isfinite(amax)) continue;
    for (uint32_t xb = 0; xb < 0x10000; ++xb) {
      const float x = value(xb);
      if (!(fabsf(x) <= amax)) continue;
      ++*cases;
      differ += fp8_pair_differs(x, amax);
    }
  }
  return differ;
}

// Fp8BlockScale: the scale as the quotient above from RN(1 / 448), an infinite maximum passed through.
static long long fp8_scale_exhaustive(long long* cases) {
  long long differ = 0;
  for (uint32_t b = 0; b <= 0x7F800000u; ++b) {  // every amax >= +0 up to inf
    const float a = fmaxf(from_bits(b), 1e-10f);
    const float scale = isinf(a) ? a : fp8_quotient(a, 448.0f, 1.0f / 448.0f);
    differ += bits(scale) != bits(fp8_scale(from_bits(b)));
  }
  *cases = 0x7F800001ll;
  return differ;
}

static long long fp8_random_fp32(long long n, long long* cases) {
  uint64_t state = 0x9E3779B97F4A7C15ull;
  long long differ = 0;
  for (long long i = 0; i < n; ++i) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    const float amax = from_bits((uint32_t)state & 0x7f7fffffu);  // finite, non-negative
    // x within amax's binade or up to 15 binades below it (where the E4M3 values are not zero)
    float x = ldexpf(1.0f + (float)((state >> 32) & 0x7fffff) * 0x1p-23f, ilogbf(amax) - (int)((state >> 56) & 15));
    if (state & (1ull << 55)) x = -x;
    if (!(fabsf(x) <= amax) || !isfinite(x)) continue;
    ++*cases;
    differ += fp8_pair_differs(x, amax);
  }
  return differ;
}

// The reference's E2M1 magnitude code and E2m1MagnitudeBits (the sign bit is the input's, taken apart).
static uint32_t e2m1_reference(float v) {
  const float a = fabsf(v);
  return (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
}
static uint32_t e2m1_code(float v) {  // E2m1MagnitudeBits(E2m1Magnitude(v)), less the 2^23 it carries
  const float round = 8388608.0f;
  const float a = isnan(v) ? 0.0f : fabsf(v);  // the GPU's max(|v|, 0), which returns 0 for every NaN (C's fmaxf
                                               // returns NaN for a signaling one)
  const float capped = fminf(a, 6.0f);
  const uint32_t lines[3] = {bits(fmaf(capped, 2.0f, round)), bits(capped + (round + 2.0f)),
                             bits(fmaf(capped, 0.5f, round + 4.0f))};  // the least by their bits, as __vimin3_u32
  uint32_t least = lines[0];
  for (int i = 1; i < 3; ++i) least = lines[i] < least ? lines[i] : least;
  return least - 0x4B000000u;
}
// The reference's MXFP8 exponent (frexp) and MxExponent (bits), with the scaling factor 2^-e built from bits.
static int mx_exponent_reference(float amax) {
  int k;
  const float m = frexpf(amax, &k);
  const int e = amax == 0.0f ? -127 : m <= 0.875f ? k - 9 : k - 8;
  return e < -127 ? -127 : e > 127 ? 127 : e;
}
static int mx_exponent(float amax) {
  const uint32_t b = bits(amax);
  const int biased = (int)(b >> 23);
  const int e = biased - ((b & 0x7FFFFFu) <= 0x600000u ? 135 : 134);
  return biased == 255 ? -8 : e > -127 ? e : -127;
}
static long long mx_exhaustive(long long* cases) {
  long long differ = 0;
  for (uint32_t b = 0; b <= 0x7F800000u; ++b) {  // every amax >= +0 up to inf (NaN: below)
    const float amax = from_bits(b);
    const int e = mx_exponent(amax);
    differ += e != mx_exponent_reference(amax) || bits(ldexpf(1.0f, -e)) != (uint32_t)(127 - e) << 23;
  }
  differ += mx_exponent(from_bits(0x7FC00000u)) != mx_exponent_reference(from_bits(0x7FC00000u));
  *cases = 0x7F800002ll;
  return differ;
}

static long long e2m1_exhaustive(long long* cases) {
  long long differ = 0;
  for (uint64_t b = 0; b < (1ull << 32); ++b) {
    const float v = from_bits((uint32_t)b);
    differ += e2m1_code(v) != e2m1_reference(v);
  }
  *cases = 1ll << 32;
  return differ;
}

int main(int argc, char** argv) {
  const char* check = argc > 1 ? argv[1] : "";
  long long cases = 0, differ;
  if (strcmp(check, "fp8_bf16") == 0) {
    differ = fp8_exhaustive(bf16_value, &cases);
  } else if (strcmp(check, "fp8_fp16") == 0) {
    differ = fp8_exhaustive(fp16_value, &cases);
  } else if (strcmp(check, "fp8_fp32") == 0) {
    differ = fp8_random_fp32(argc > 2 ? atoll(argv[2]) : 100000000ll, &cases);
  } else if (strcmp(check, "fp8_scale") == 0) {
    differ = fp8_scale_exhaustive(&cases);
  } else if (strcmp(check, "mx_exponent") == 0) {
    differ = mx_exhaustive(&cases);
  } else if (strcmp(check, "e2m1") == 0) {
    differ = e2m1_exhaustive(&cases);
  } else {
    fprintf(stderr, "usage: %s fp8_bf16|fp8_fp16|fp8_fp32 [n]|fp8_scale|mx_exponent|e2m1\n", argv[0]);
    return 2;
  }
  printf("%s: %lld cases, %lld differ\n", check, cases, differ);
  return differ != 0;
}
