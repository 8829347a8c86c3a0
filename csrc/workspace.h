// Host-side workspace configuration shared by the entry points: validated construction of WorkspaceConfig.
#pragma once

#include <flashinfer_a2a/workspace_layout.cuh>

#include "common.h"

namespace flashinfer_a2a {

inline WorkspaceConfig MakeWorkspaceConfig(int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
                                           int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token) {
  TVM_FFI_CHECK(ep_size >= 1 && ep_size <= kMaxRanks, ValueError)
      << "ep_size must be in [1, " << kMaxRanks << "], got " << ep_size;
  TVM_FFI_CHECK(max_num_tokens >= 1 && max_num_tokens < (int64_t{1} << kRouteSlotBits), ValueError)
      << "max_num_tokens must be in [1, " << (int64_t{1} << kRouteSlotBits) << "), got " << max_num_tokens;
  TVM_FFI_CHECK(top_k >= 1 && top_k <= kMaxTopK, ValueError)
      << "top_k must be in [1, " << kMaxTopK << "], got " << top_k;
  TVM_FFI_CHECK(dispatch_bytes_per_token >= 0, ValueError)
      << "dispatch_bytes_per_token must be >= 0, got " << dispatch_bytes_per_token;
  TVM_FFI_CHECK(combine_bytes_per_token >= 0, ValueError)
      << "combine_bytes_per_token must be >= 0, got " << combine_bytes_per_token;
  return WorkspaceConfig{static_cast<int32_t>(ep_size), max_num_tokens, static_cast<int32_t>(top_k),
                         dispatch_bytes_per_token, combine_bytes_per_token};
}

}  // namespace flashinfer_a2a

namespace flashinfer_a2a {

// Checks the CUDA workspace of a dispatch or combine acting as rank ep_rank; returns its layout.
inline WorkspaceLayout CheckCudaWorkspace(const TensorView& workspace, int64_t ep_rank,
                                          const WorkspaceConfig& config) {
  const WorkspaceLayout layout = ComputeLayout(config);
  CheckRank(ep_rank, config.ep_size);
  TVM_FFI_CHECK(IsCuda(workspace), ValueError) << "workspace must be a CUDA tensor";
  CheckWorkspace(workspace, config.ep_size, layout.total_bytes);
  return layout;
}

// Checks a dispatch's runtime_max and payload row sizes against the workspace's sizes; copies the row sizes out.
template <typename RowBytes>
inline void CheckPayloadRows(const WorkspaceConfig& config, int64_t runtime_max, const RowBytes& payload_row_bytes,
                             int64_t* row_bytes) {
  TVM_FFI_CHECK(runtime_max >= 0 && runtime_max <= config.max_num_tokens, ValueError)
      << "runtime_max_tokens_per_rank must be in [0, max_num_tokens=" << config.max_num_tokens << "], got "
      << runtime_max;
  const int64_t num_payloads = static_cast<int64_t>(payload_row_bytes.size());
  TVM_FFI_CHECK(num_payloads <= kMaxPayloads, ValueError)
      << "at most " << kMaxPayloads << " payloads per dispatch, got " << num_payloads;
  int64_t total = 0;
  for (int64_t p = 0; p < num_payloads; ++p) {
    row_bytes[p] = payload_row_bytes[p];
    TVM_FFI_CHECK(row_bytes[p] >= 1, ValueError) << "payload " << p << " has empty rows";
    total += row_bytes[p];
  }
  TVM_FFI_CHECK(total <= config.dispatch_bytes_per_token, ValueError)
      << "payloads need " << total << " bytes per token, the workspace was sized for dispatch_bytes_per_token="
      << config.dispatch_bytes_per_token;
}

}  // namespace flashinfer_a2a
