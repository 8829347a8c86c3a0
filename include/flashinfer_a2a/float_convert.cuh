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
template <>
struct FloatConvert<__nv_bfloat16> {
  static __device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 FromFloat(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct FloatConvert<__half> {
  static __device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half FromFloat(float x) { return __float2half_rn(x); }
};

}  // namespace flashinfer_a2a
