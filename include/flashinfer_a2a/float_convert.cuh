// fp32 to and from the floating-point element types the kernels read and write (round to nearest even).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace flashinfer_a2a {

template <typename T>
struct FloatConvert;
template <>
struct FloatConvert<float> {
  static __device__ __forceinline__ float ToFloat(float x) { return x; }
  static __device__ __forceinline__ float FromFloat(float x) { return x; }
};
// The 16-bit types also name their packed pair, for two-at-a-time maxima.
template <>
struct FloatConvert<__nv_bfloat16> {
  using Pair = __nv_bfloat162;
  static __device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 FromFloat(float x) { return __float2bfloat16_rn(x); }
  static __device__ __forceinline__ float Low(Pair p) { return __low2float(p); }
  static __device__ __forceinline__ float High(Pair p) { return __high2float(p); }
  static __device__ __forceinline__ Pair ZeroPair() { return __float2bfloat162_rn(0.0f); }
};
template <>
struct FloatConvert<__half> {
  using Pair = __half2;
  static __device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half FromFloat(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ float Low(Pair p) { return __low2float(p); }
  static __device__ __forceinline__ float High(Pair p) { return __high2float(p); }
  static __device__ __forceinline__ Pair ZeroPair() { return __float2half2_rn(0.0f); }
};

}  // namespace flashinfer_a2a
