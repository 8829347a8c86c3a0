// What the entry points share about launching: the multiprocessor count, the timeout, loading every kernel up front.
#pragma once

#include "common.h"

namespace flashinfer_a2a {

inline int NumSMs(int device) {
  static int cached[64] = {};
  if (device < 0 || device >= 64) device = 0;
  if (cached[device] == 0) {
    A2A_CUDA_CHECK(cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device));
  }
  return cached[device];
}

// An entry point checks its SM budget first, before the workspace (so the check needs no GPU).
inline void CheckSmBudget(int64_t num_sms) {
  A2A_CHECK(num_sms >= 0, ValueError) << "num_sms must be >= 0 (0: every multiprocessor), got " << num_sms;
}

// Multiprocessors the kernels size their grids for: the device's, or fewer under an SM budget (num_sms > 0), so that
// work running beside them keeps the rest.
inline int SmBudget(int64_t num_sms, int device) {
  const int all = NumSMs(device);
  return num_sms > 0 && num_sms < all ? static_cast<int>(num_sms) : all;
}

inline uint64_t TimeoutNs(double timeout_s) {
  A2A_CHECK(timeout_s > 0 && timeout_s < 1e6, ValueError)
      << "timeout_s must be in (0, 1e6) seconds, got " << timeout_s;
  return static_cast<uint64_t>(timeout_s * 1e9);
}

void PreloadDispatchKernels();  // dispatch.cu
void PreloadCombineKernels();   // combine.cu, sanitize included

// Loads every kernel of the module now. With lazy module loading the first launch of a kernel may synchronize the
// device; were that to happen while a peer kernel on the same GPU spins on this rank, neither would move.
inline void PreloadKernels() {
  PreloadDispatchKernels();
  PreloadCombineKernels();
}

}  // namespace flashinfer_a2a
