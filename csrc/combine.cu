// Entry points for combine and sanitize_expert_ids: validate -> device guard -> stream -> fill params -> launch.
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>

#include <flashinfer_a2a/combine.cuh>
#include <flashinfer_a2a/sanitize.cuh>

#include "kernels.h"
#include "workspace.h"

namespace flashinfer_a2a {

void PreloadCombineKernels() {
  A2A_CUDA_CHECK(GetCombineKernelAttributes());
  A2A_CUDA_CHECK(GetSanitizeKernelAttributes());
}

namespace {

FloatType CombineFloatType(const TensorView& t, const char* name) {
  if (IsDType(t, kDLBfloat, 16)) return FloatType::kBFloat16;
  if (IsDType(t, kDLFloat, 16)) return FloatType::kFloat16;
  A2A_CHECK(IsDType(t, kDLFloat, 32), TypeError)
      << name << " must be bfloat16, float16 or float32, got dtype " << DTypeName(t.dtype());
  return FloatType::kFloat32;
}

}  // namespace

void Combine(TensorView workspace, tvm::ffi::Optional<tvm::ffi::Tensor> partials, TensorView recv_counts,
             TensorView out, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
             int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token, int64_t runtime_max_tokens_per_rank,
             double timeout_s, bool one_gpu_per_rank, int64_t quant_format, int64_t combine_mode, int64_t phase,
             int64_t num_sms) {
  A2A_CHECK(phase >= 0 && phase <= 2, ValueError)
      << "combine phase must be 0 (send and receive), 1 (send) or 2 (receive), got " << phase;
  CheckSmBudget(num_sms);
  const WorkspaceConfig config =
      MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token);
  const WorkspaceLayout layout = CheckCudaWorkspace(workspace, ep_rank, config);
  CheckRecvCounts(recv_counts, workspace, ep_size);
  A2A_CHECK(runtime_max_tokens_per_rank >= 0 && runtime_max_tokens_per_rank <= max_num_tokens, ValueError)
      << "runtime_max_tokens_per_rank must be in [0, max_num_tokens=" << max_num_tokens << "], got "
      << runtime_max_tokens_per_rank;

  const FloatType type = CombineFloatType(out, "out");
  A2A_CHECK(out.ndim() == 2 && out.size(0) <= runtime_max_tokens_per_rank, ValueError)
      << "out must be [num_tokens, hidden] with num_tokens <= runtime_max_tokens_per_rank="
      << runtime_max_tokens_per_rank;
  CheckContiguous(out, "out");
  CheckSameDevice(out, workspace, "out", "workspace");
  const int64_t hidden = out.size(1);
  const int64_t row_bytes = hidden * ElementBytes(out);
  A2A_CHECK(hidden >= 1 && row_bytes <= combine_bytes_per_token, ValueError)
      << "combine rows of hidden=" << hidden << " need " << row_bytes
      << " bytes, the workspace was sized for combine_bytes_per_token=" << combine_bytes_per_token;
  const uint64_t timeout_ns = TimeoutNs(timeout_s);
  A2A_CHECK(combine_mode == static_cast<int64_t>(CombineMode::kPull) ||
                combine_mode == static_cast<int64_t>(CombineMode::kPush),
            ValueError)
      << "combine_mode must be " << static_cast<int64_t>(CombineMode::kPull) << " (pull) or "
      << static_cast<int64_t>(CombineMode::kPush) << " (push), got " << combine_mode;
  A2A_CHECK(quant_format == 0 || quant_format == 1, ValueError)
      << "combine quant_format must be 0 (none) or 1 (fp8_block), got " << quant_format;
  const bool fp8_wire = quant_format == 1;
  if (fp8_wire) {
    A2A_CHECK(type != FloatType::kFloat32, TypeError) << "an FP8-wire combine needs bfloat16 or float16 out";
    A2A_CHECK(hidden % kQuantLaneElems == 0 && hidden <= kFp8WireMaxCols * quant::kFp8Block, ValueError)
        << "an FP8-wire combine needs hidden % 8 == 0 and hidden <= " << kFp8WireMaxCols * quant::kFp8Block
        << ", got hidden=" << hidden;
    A2A_CHECK(reinterpret_cast<uintptr_t>(BytePtr(out)) % 16 == 0, ValueError)
        << "an FP8-wire combine needs out 16-byte aligned";
  }

  uint8_t* base = static_cast<uint8_t*>(BytePtr(workspace));
  const uint8_t* region = base + ep_rank * workspace.stride(0) + layout.combine_offset;
  const uint8_t* input = nullptr;
  if (partials.has_value()) {
    const tvm::ffi::Tensor in_tensor = partials.value();
    const TensorView in = in_tensor;
    A2A_CHECK(in.dtype() == out.dtype(), TypeError) << "partials must have the dtype of out";
    A2A_CHECK(in.ndim() == 3 && in.size(0) == ep_size && in.size(1) == runtime_max_tokens_per_rank &&
                      in.size(2) == hidden,
                  ValueError)
        << "partials must be [ep_size=" << ep_size << ", runtime_max_tokens_per_rank=" << runtime_max_tokens_per_rank
        << ", hidden=" << hidden << "]";
    CheckContiguous(in, "partials");
    CheckSameDevice(in, workspace, "partials", "workspace");
    // The workspace's own combine region needs no copy: the expert side wrote straight into it.
    if (BytePtr(in) != region) input = static_cast<const uint8_t*>(BytePtr(in));
    A2A_CHECK(!fp8_wire || reinterpret_cast<uintptr_t>(input) % 16 == 0, ValueError)
        << "an FP8-wire combine needs partials 16-byte aligned";
  }

  DeviceGuard guard(workspace.device().device_id);
  cudaStream_t stream = CurrentStream(workspace);
  CombineParams params{};
  params.ranks = Ranks{base, workspace.stride(0), static_cast<int32_t>(ep_rank), static_cast<int32_t>(ep_size)};
  params.ranks.own_gpu = one_gpu_per_rank;
  params.num_tokens = static_cast<int32_t>(out.size(0));
  params.runtime_max = static_cast<int32_t>(runtime_max_tokens_per_rank);
  params.route_stride = static_cast<int32_t>(top_k);
  params.routing_offset = layout.routing_offset;
  params.combine_offset = layout.combine_offset;
  params.row_bytes = row_bytes;
  params.input = input;
  params.input_vec_bytes = VecBytesFor(row_bytes, reinterpret_cast<uintptr_t>(input), kAlignBytes);
  params.recv_counts = static_cast<const int32_t*>(BytePtr(recv_counts));
  params.output = BytePtr(out);
  params.timeout_ns = timeout_ns;
  params.fp8_wire = fp8_wire;
  params.fp16 = type == FloatType::kFloat16;
  params.hidden = static_cast<int32_t>(hidden);
  // The caller chose the algorithm (MoeAlltoAll when sizing its workspace); it is checked here, never switched: a
  // workspace too small for a push is an error, and a large row in a pulled combine stays pulled. The test is on the
  // per-token size, not on this call's runtime_max, so every rank decides alike from sizes all ranks share.
  params.phase = static_cast<CombinePhase>(phase);
  params.push = combine_mode == static_cast<int64_t>(CombineMode::kPush);
  if (params.push) {
    // A split combine is pulled: its send must return before the peers' rows are needed.
    A2A_CHECK(phase == 0, ValueError) << "combine_mode=" << combine_mode << " (push) cannot be split: phase must be 0, "
                                      << "got " << phase << "; split combines use combine_mode="
                                      << static_cast<int64_t>(CombineMode::kPull) << " (pull)";
    A2A_CHECK(one_gpu_per_rank, ValueError)
        << "combine_mode=" << combine_mode << " (push) needs one_gpu_per_rank: with ranks sharing a GPU the pushing "
        << "blocks can hold every multiprocessor a peer on that GPU still needs; use combine_mode="
        << static_cast<int64_t>(CombineMode::kPull) << " (pull)";
    const int64_t needed = PushCombineRowBytes(row_bytes, hidden, fp8_wire);
    A2A_CHECK(needed <= combine_bytes_per_token, ValueError)
        << "combine_mode=" << combine_mode << " (push) of hidden=" << hidden << (fp8_wire ? " over the FP8 wire" : "")
        << " needs combine_bytes_per_token >= " << needed << " (the partial and its landing row), the workspace was "
        << "sized for " << combine_bytes_per_token;
  }
  params.landing_offset = layout.combine_offset + ep_size * runtime_max_tokens_per_rank * row_bytes;
  params.push_flags_offset = layout.push_flags_offset;
  params.max_num_tokens = static_cast<int32_t>(max_num_tokens);
  // Vector width of the sums, which read this rank's own partials where the caller put them, and of the pushes.
  const int pull_vec =
      VecBytesFor(row_bytes, reinterpret_cast<uintptr_t>(params.output), reinterpret_cast<uintptr_t>(input));
  const int device = workspace.device().device_id;
  A2A_CUDA_CHECK(LaunchCombine(params, type, pull_vec, SmBudget(num_sms, device), NumSMs(device), one_gpu_per_rank,
                               stream));
}

// The eager fast path (flashinfer_a2a/transports/nvlink_eager.py): Combine with the arguments fixed for one
// MoeAlltoAll bound once, as BindDispatch does for Dispatch.
tvm::ffi::Function BindCombine(tvm::ffi::Tensor workspace, tvm::ffi::Tensor recv_counts, int64_t ep_rank,
                               int64_t ep_size, int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                               int64_t combine_bytes_per_token, bool one_gpu_per_rank, int64_t num_sms) {
  return tvm::ffi::Function::FromTyped([=](tvm::ffi::Optional<tvm::ffi::Tensor> partials, TensorView out,
                                           int64_t runtime_max_tokens_per_rank, double timeout_s,
                                           int64_t quant_format, int64_t combine_mode, int64_t phase) {
    Combine(workspace, partials, recv_counts, out, ep_rank, ep_size, max_num_tokens, top_k, dispatch_bytes_per_token,
            combine_bytes_per_token, runtime_max_tokens_per_rank, timeout_s, one_gpu_per_rank, quant_format,
            combine_mode, phase, num_sms);
  });
}

void SanitizeExpertIds(TensorView recv_topk_ids, TensorView recv_counts, int64_t invalid_id) {
  A2A_CHECK(IsCuda(recv_topk_ids), ValueError) << "recv_topk_ids must be a CUDA tensor";
  const bool is_int64 = IsDType(recv_topk_ids, kDLInt, 64);
  A2A_CHECK(is_int64 || IsDType(recv_topk_ids, kDLInt, 32), TypeError)
      << "recv_topk_ids must be int32 or int64, got dtype " << DTypeName(recv_topk_ids.dtype());
  A2A_CHECK(recv_topk_ids.ndim() == 3, ValueError)
      << "recv_topk_ids must be [ep_size, runtime_max_tokens_per_rank, top_k]";
  CheckContiguous(recv_topk_ids, "recv_topk_ids");
  const int64_t ep_size = recv_topk_ids.size(0);
  CheckRecvCounts(recv_counts, recv_topk_ids, ep_size);
  A2A_CHECK(is_int64 || (invalid_id >= INT32_MIN && invalid_id <= INT32_MAX), ValueError)
      << "invalid_id=" << invalid_id << " does not fit int32 recv_topk_ids";

  DeviceGuard guard(recv_topk_ids.device().device_id);
  cudaStream_t stream = CurrentStream(recv_topk_ids);
  const int grid_sms = NumSMs(recv_topk_ids.device().device_id);
  const auto runtime_max = static_cast<int32_t>(recv_topk_ids.size(1));
  const auto top_k = static_cast<int32_t>(recv_topk_ids.size(2));
  const auto* counts = static_cast<const int32_t*>(BytePtr(recv_counts));
  if (is_int64) {
    A2A_CUDA_CHECK(LaunchSanitize(static_cast<int64_t*>(BytePtr(recv_topk_ids)), counts, static_cast<int32_t>(ep_size),
                                  runtime_max, top_k, invalid_id, grid_sms, stream));
  } else {
    A2A_CUDA_CHECK(LaunchSanitize(static_cast<int32_t*>(BytePtr(recv_topk_ids)), counts, static_cast<int32_t>(ep_size),
                                  runtime_max, top_k, static_cast<int32_t>(invalid_id), grid_sms, stream));
  }
}

}  // namespace flashinfer_a2a
