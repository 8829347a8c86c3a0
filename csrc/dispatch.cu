// Entry point for dispatch: validate -> device guard -> stream -> fill DispatchParams -> launch.
#include <tvm/ffi/container/array.h>

#include <flashinfer_a2a/dispatch.cuh>

#include <vector>

#include "kernels.h"
#include "workspace.h"

namespace flashinfer_a2a {

void PreloadDispatchKernels() { A2A_CUDA_CHECK(GetDispatchKernelAttributes()); }

namespace {

int64_t RowBytes(const TensorView& t) {
  int64_t row = ElementBytes(t);
  for (int d = 1; d < t.ndim(); ++d) row *= t.size(d);
  return row;
}

}  // namespace

void Dispatch(TensorView workspace, TensorView topk_ids, tvm::ffi::Array<tvm::ffi::Tensor> payloads,
              TensorView recv_counts, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
              int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token, int64_t runtime_max_tokens_per_rank,
              int64_t num_experts, double timeout_s) {
  const WorkspaceConfig config =
      MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token);
  const WorkspaceLayout layout = CheckCudaWorkspace(workspace, ep_rank, config);

  TVM_FFI_CHECK(IsDType(topk_ids, kDLInt, 32) || IsDType(topk_ids, kDLInt, 64), TypeError)
      << "topk_ids must be int32 or int64, got dtype " << DTypeName(topk_ids.dtype());
  TVM_FFI_CHECK(topk_ids.ndim() == 2, ValueError) << "topk_ids must be [num_tokens, top_k], got " << topk_ids.ndim()
                                                  << " dims";
  CheckContiguous(topk_ids, "topk_ids");
  CheckSameDevice(topk_ids, workspace, "topk_ids", "workspace");
  const int64_t num_tokens = topk_ids.size(0);
  TVM_FFI_CHECK(topk_ids.size(1) >= 1 && topk_ids.size(1) <= top_k, ValueError)
      << "topk_ids has top_k=" << topk_ids.size(1) << ", the workspace was built for top_k <= " << top_k;
  TVM_FFI_CHECK(num_tokens <= runtime_max_tokens_per_rank, ValueError)
      << "topk_ids has " << num_tokens << " tokens, more than runtime_max_tokens_per_rank="
      << runtime_max_tokens_per_rank;
  TVM_FFI_CHECK(num_experts >= 1 && num_experts < (int64_t{1} << 31), ValueError)
      << "num_experts must be >= 1, got " << num_experts;

  TVM_FFI_CHECK(IsDType(recv_counts, kDLInt, 32) && recv_counts.ndim() == 1 && recv_counts.size(0) == ep_size,
                ValueError)
      << "recv_counts must be int32 of shape [ep_size=" << ep_size << "]";
  CheckContiguous(recv_counts, "recv_counts");
  CheckSameDevice(recv_counts, workspace, "recv_counts", "workspace");

  const uint64_t timeout_ns = TimeoutNs(timeout_s);

  DispatchParams params{};
  params.num_payloads = static_cast<int32_t>(payloads.size());
  std::vector<int64_t> rows;
  for (size_t p = 0; p < payloads.size(); ++p) {
    const TensorView payload = payloads[p];
    TVM_FFI_CHECK(payload.ndim() >= 1 && payload.size(0) == num_tokens, ValueError)
        << "payloads[" << p << "] must have num_tokens=" << num_tokens << " rows like topk_ids";
    CheckContiguous(payload, "payloads[i]");
    CheckSameDevice(payload, workspace, "payloads[i]", "workspace");
    rows.push_back(RowBytes(payload));
  }
  int64_t row_bytes[kMaxPayloads];
  CheckPayloadRows(config, runtime_max_tokens_per_rank, rows, row_bytes);
  ComputeRecvOffsets(layout, config.ep_size, runtime_max_tokens_per_rank, row_bytes, params.num_payloads,
                     params.recv_offset);
  for (int p = 0; p < params.num_payloads; ++p) {
    params.payload[p] = static_cast<const uint8_t*>(BytePtr(TensorView(payloads[p])));
    params.row_bytes[p] = row_bytes[p];
    params.vec_bytes[p] = VecBytesFor(row_bytes[p], reinterpret_cast<uintptr_t>(params.payload[p]), kAlignBytes);
    const int64_t piece_bytes = 32 * kDispatchPieceVectors * params.vec_bytes[p];
    params.pieces[p] = static_cast<int32_t>((row_bytes[p] + piece_bytes - 1) / piece_bytes);
    params.pieces_per_token += params.pieces[p];
  }

  DeviceGuard guard(workspace.device().device_id);
  cudaStream_t stream = CurrentStream(workspace);
  params.ranks = Ranks{static_cast<uint8_t*>(BytePtr(workspace)), workspace.stride(0),
                       static_cast<int32_t>(ep_rank), static_cast<int32_t>(ep_size)};
  params.num_tokens = static_cast<int32_t>(num_tokens);
  params.runtime_max = static_cast<int32_t>(runtime_max_tokens_per_rank);
  params.top_k = static_cast<int32_t>(topk_ids.size(1));
  params.route_stride = static_cast<int32_t>(top_k);
  params.num_experts = static_cast<int32_t>(num_experts);
  params.topk_ids = BytePtr(topk_ids);
  params.routing_offset = layout.routing_offset;
  params.recv_counts = static_cast<int32_t*>(BytePtr(recv_counts));
  params.timeout_ns = timeout_ns;
  A2A_CUDA_CHECK(LaunchDispatch(params, IsDType(topk_ids, kDLInt, 64), NumSMs(workspace.device().device_id), stream));
}

}  // namespace flashinfer_a2a
