// Entry points for the workspace: its size, the metainfo (byte offsets of every metadata field and region), and
// initialize (clears this rank's metadata).
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/string.h>

#include <cstddef>
#include <cstring>
#include <string>

#include <flashinfer_a2a/combine_fp8.cuh>

#include "kernels.h"
#include "workspace.h"

namespace flashinfer_a2a {

namespace {

// X(name, byte offset within a rank's workspace). The index of an entry is its position in this list.
#define A2A_METAINFO_FIELDS(X, layout)                                                     \
  X(dispatch_epoch_offset, offsetof(RankMetadata, dispatch_epoch))                         \
  X(blocks_done_offset, offsetof(RankMetadata, blocks_done))                               \
  X(error_code_offset, offsetof(RankMetadata, error) + offsetof(ErrorRecord, code))        \
  X(error_phase_offset, offsetof(RankMetadata, error) + offsetof(ErrorRecord, phase))      \
  X(error_peer_offset, offsetof(RankMetadata, error) + offsetof(ErrorRecord, peer))        \
  X(error_epoch_offset, offsetof(RankMetadata, error) + offsetof(ErrorRecord, epoch))      \
  X(error_detail_offset, offsetof(RankMetadata, error) + offsetof(ErrorRecord, detail))    \
  X(dispatch_signal_offset, offsetof(RankMetadata, dispatch_signal))                       \
  X(peer_runtime_max_offset, offsetof(RankMetadata, peer_runtime_max))                     \
  X(combine_signal_offset, offsetof(RankMetadata, combine_signal))                         \
  X(inactive_ranks_offset, offsetof(RankMetadata, inactive_ranks))                         \
  X(metadata_bytes, sizeof(RankMetadata))                                                  \
  X(eplb_offset, (layout).eplb_offset)                                                     \
  X(push_flags_offset, (layout).push_flags_offset)                                         \
  X(routing_offset, (layout).routing_offset)                                               \
  X(dispatch_offset, (layout).dispatch_offset)                                             \
  X(combine_offset, (layout).combine_offset)                                               \
  X(bytes_per_rank, (layout).total_bytes)

#define A2A_COUNT_FIELD(name, value) +1
constexpr int kNumMetainfo = 0 A2A_METAINFO_FIELDS(A2A_COUNT_FIELD, WorkspaceLayout{});
#undef A2A_COUNT_FIELD

}  // namespace

int64_t GetWorkspaceSize(int64_t ep_size, int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                         int64_t combine_bytes_per_token) {
  auto config =
      MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token);
  return ComputeLayout(config).total_bytes;
}

tvm::ffi::Map<tvm::ffi::String, int64_t> GetMetainfoIndexPairs() {
  tvm::ffi::Map<tvm::ffi::String, int64_t> pairs;
  int64_t index = 0;
#define A2A_ADD_PAIR(name, value) pairs.Set(#name, index++);
  A2A_METAINFO_FIELDS(A2A_ADD_PAIR, WorkspaceLayout{})
#undef A2A_ADD_PAIR
  return pairs;
}

tvm::ffi::Map<tvm::ffi::String, int64_t> GetConstants() {
  // The one owner of every number Python and C++ share: limits, error and phase codes, wire-format codes, and
  // the fingerprint fields (value: shift << 8 | bits).
  tvm::ffi::Map<tvm::ffi::String, int64_t> c;
  c.Set("max_ep_size", kMaxRanks);
  c.Set("max_top_k", kMaxTopK);
  c.Set("max_payloads", kMaxPayloads);
  c.Set("max_eplb_experts", kMaxEplbExperts);
  c.Set("max_num_tokens_limit", int64_t{1} << kRouteSlotBits);
  c.Set("align_bytes", kAlignBytes);
  c.Set("error_none", static_cast<int64_t>(ErrorCode::kNone));
  c.Set("error_timeout", static_cast<int64_t>(ErrorCode::kTimeout));
  c.Set("error_invalid_expert_id", static_cast<int64_t>(ErrorCode::kInvalidExpertId));
  c.Set("error_runtime_max_mismatch", static_cast<int64_t>(ErrorCode::kRuntimeMaxMismatch));
  c.Set("error_call_layout_mismatch", static_cast<int64_t>(ErrorCode::kCallLayoutMismatch));
  c.Set("phase_none", static_cast<int64_t>(Phase::kNone));
  c.Set("phase_dispatch", static_cast<int64_t>(Phase::kDispatch));
  c.Set("phase_combine", static_cast<int64_t>(Phase::kCombine));
  c.Set("quant_none", static_cast<int64_t>(QuantFormat::kNone));
  c.Set("quant_fp8_block", static_cast<int64_t>(QuantFormat::kFp8Block));
  c.Set("quant_mxfp8", static_cast<int64_t>(QuantFormat::kMxfp8));
  c.Set("quant_nvfp4", static_cast<int64_t>(QuantFormat::kNvfp4));
  c.Set("combine_pull", static_cast<int64_t>(CombineMode::kPull));
  c.Set("combine_push", static_cast<int64_t>(CombineMode::kPush));
  // The split-phase codes of the dispatch and combine entries (DispatchPhase has the same values).
  c.Set("split_both", static_cast<int64_t>(CombinePhase::kBoth));
  c.Set("split_send", static_cast<int64_t>(CombinePhase::kSend));
  c.Set("split_recv", static_cast<int64_t>(CombinePhase::kRecv));
  c.Set("fp8_wire_hidden_multiple", kQuantLaneElems);
  c.Set("fp8_wire_max_hidden", int64_t{kFp8WireMaxCols} * quant::kFp8Block);
  for (const CallLayoutField& f : kCallLayoutFields) {
    c.Set(std::string("call_layout:") + f.name, (static_cast<int64_t>(f.shift) << 8) | f.bits);
  }
  return c;
}

void Initialize(TensorView workspace, TensorView metainfo, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                int64_t top_k, int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token) {
  auto config =
      MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token);
  const WorkspaceLayout layout = ComputeLayout(config);
  CheckRank(ep_rank, ep_size);
  CheckWorkspace(workspace, ep_size, layout.total_bytes);
  A2A_CHECK(IsDType(metainfo, kDLInt, 64) && metainfo.ndim() == 1 && metainfo.size(0) == kNumMetainfo &&
                    metainfo.IsContiguous() && metainfo.device().device_type == kDLCPU,
                ValueError)
      << "metainfo must be a contiguous CPU int64 tensor of shape [" << kNumMetainfo << "]";

  auto* values = static_cast<int64_t*>(BytePtr(metainfo));
  int64_t index = 0;
#define A2A_SET_VALUE(name, value) values[index++] = static_cast<int64_t>(value);
  A2A_METAINFO_FIELDS(A2A_SET_VALUE, layout)
#undef A2A_SET_VALUE

  // Only this rank's metadata and push flags: peers' workspaces are theirs to clear, and their signals may already
  // be in flight towards ours once every rank has passed the barrier that follows initialization.
  uint8_t* metadata = static_cast<uint8_t*>(BytePtr(workspace)) + ep_rank * workspace.stride(0);
  if (workspace.device().device_type == kDLCPU) {
    std::memset(metadata, 0, layout.routing_offset);
    return;
  }
  A2A_CHECK(IsCuda(workspace), ValueError) << "workspace must be a CUDA (or CPU) tensor";
  DeviceGuard guard(workspace.device().device_id);
  cudaStream_t stream = CurrentStream(workspace);
  PreloadKernels();
  A2A_CUDA_CHECK(cudaMemsetAsync(metadata, 0, layout.routing_offset, stream));
}

}  // namespace flashinfer_a2a

namespace flashinfer_a2a {

tvm::ffi::Array<int64_t> GetDispatchLayout(int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
                                           int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token,
                                           int64_t runtime_max_tokens_per_rank,
                                           tvm::ffi::Array<int64_t> payload_row_bytes, int64_t quant_format,
                                           int64_t quant_hidden, bool swizzled_scales) {
  auto config =
      MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token);
  const WorkspaceLayout layout = ComputeLayout(config);
  const QuantRequest quant = MakeQuantRequest(ToQuantFormat(quant_format), quant_hidden, swizzled_scales);
  const RecvRegions regions =
      PlanRecvRegions(config, layout, runtime_max_tokens_per_rank, payload_row_bytes, quant);
  tvm::ffi::Array<int64_t> result;
  for (int p = 0; p < regions.count; ++p) result.push_back(regions.offsets[p]);
  result.push_back(layout.combine_offset);
  return result;
}

}  // namespace flashinfer_a2a
