// Sanitize: fill the received top-k id rows beyond each source's count with an invalid id, so expert kernels can
// run on the padded [ep_size * runtime_max, top_k] shape.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ptx.cuh"

namespace flashinfer_a2a {

constexpr int kSanitizeThreads = 256;

template <typename IdT>
__global__ void __launch_bounds__(kSanitizeThreads)
    SanitizeKernel(IdT* recv_topk_ids, const int32_t* recv_counts, int32_t ep_size, int32_t runtime_max,
                   int32_t top_k, IdT invalid_id) {
  WaitPriorKernels();
  const int64_t total = static_cast<int64_t>(ep_size) * runtime_max * top_k;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kSanitizeThreads) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kSanitizeThreads) {
    const int64_t row = i / top_k;
    if (row % runtime_max >= recv_counts[row / runtime_max]) recv_topk_ids[i] = invalid_id;
  }
}

template <typename IdT>
inline cudaError_t LaunchSanitize(IdT* recv_topk_ids, const int32_t* recv_counts, int32_t ep_size,
                                  int32_t runtime_max, int32_t top_k, IdT invalid_id, int grid_sms,
                                  cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(ep_size) * runtime_max * top_k;
  const int64_t wanted = (total + kSanitizeThreads - 1) / kSanitizeThreads;
  const int blocks = static_cast<int>(wanted < grid_sms * 4 ? (wanted > 0 ? wanted : 1) : grid_sms * 4);
  return LaunchAfterPrior(SanitizeKernel<IdT>, blocks, kSanitizeThreads, stream, recv_topk_ids, recv_counts, ep_size,
                          runtime_max, top_k, invalid_id);
}

inline cudaError_t GetSanitizeKernelAttributes() {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, SanitizeKernel<int32_t>);
  if (err != cudaSuccess) return err;
  return cudaFuncGetAttributes(&attr, SanitizeKernel<int64_t>);
}

}  // namespace flashinfer_a2a
