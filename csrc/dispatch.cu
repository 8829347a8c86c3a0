// Entry point for dispatch: validate -> device guard -> stream -> fill DispatchParams -> launch.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/function.h>

#include <flashinfer_a2a/dispatch.cuh>

#include <algorithm>
#include <mutex>
#include <utility>
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

// `value` placed in `field` of a call-layout fingerprint, folded by XOR to the field's width.
uint64_t PackField(uint64_t value, const CallLayoutField& field) {
  const uint64_t mask = field.bits >= 64 ? ~uint64_t{0} : (uint64_t{1} << field.bits) - 1;
  uint64_t folded = 0;
  for (int shift = 0; shift < 64; shift += field.bits) folded ^= (value >> shift) & mask;
  return folded << field.shift;
}

// The fingerprint of this call's layout (see kCallLayoutFields): what a peer's rows must agree with to be read.
uint64_t CallLayoutOf(const TensorView& topk_ids, const tvm::ffi::Array<tvm::ffi::Tensor>& payloads,
                      const std::vector<int64_t>& rows, const QuantRequest& quant) {
  uint64_t dtypes = kFnvOffset, row_bytes = kFnvOffset;
  for (size_t p = 0; p < rows.size(); ++p) {
    const DLDataType d = TensorView(payloads[p]).dtype();
    dtypes = Fnv1a(dtypes, d.code | (d.bits << 8) | (static_cast<uint64_t>(d.lanes) << 16));
    row_bytes = Fnv1a(row_bytes, static_cast<uint64_t>(rows[p]));
  }
  const uint64_t values[] = {static_cast<uint64_t>(topk_ids.size(1)), IsDType(topk_ids, kDLInt, 64) ? 1u : 0u,
                             static_cast<uint64_t>(quant.format), quant.swizzled ? 1u : 0u, rows.size(), dtypes,
                             row_bytes};
  static_assert(sizeof(values) / sizeof(values[0]) == sizeof(kCallLayoutFields) / sizeof(kCallLayoutFields[0]),
                "one value per fingerprint field");
  uint64_t fingerprint = 0;
  for (size_t f = 0; f < sizeof(values) / sizeof(values[0]); ++f) {
    fingerprint |= PackField(values[f], kCallLayoutFields[f]);
  }
  return fingerprint;
}

DispatchQuant MakeDispatchQuant(const QuantRequest& quant, const RecvRegions& regions, const TensorView& hidden_states,
                                int64_t runtime_max) {
  const QuantWire wire = WireOf(quant.format);
  DispatchQuant q{};
  q.format = quant.format;
  q.fp16 = IsDType(hidden_states, kDLFloat, 16);
  q.vectorized =
      quant.hidden % kQuantLaneElems == 0 && reinterpret_cast<uintptr_t>(BytePtr(hidden_states)) % 16 == 0;
  q.swizzled = quant.swizzled;
  q.hidden = static_cast<int32_t>(quant.hidden);
  q.scale_cols = static_cast<int32_t>(wire.ScaleCols(quant.hidden));
  q.value_row_bytes = wire.ValueBytes(quant.hidden);
  q.values_offset = regions.offsets[0];
  q.scales_offset = regions.offsets[1];
  q.scale_block_bytes = wire.ScaleBlockBytes(quant.hidden, runtime_max, quant.swizzled);
  return q;
}

// The distinct payload row shapes (per payload: dtype, rank and every size but the first) one bound dispatch has
// been called with, each under an id that is never reused: the caller keys its cached receive views on it instead of
// reading every payload's shape in Python. Past kMaxShapes it starts over with new ids.
class RowShapes {
 public:
  int64_t IdOf(const tvm::ffi::Array<tvm::ffi::Tensor>& payloads) {
    std::vector<int64_t> shape;
    for (const tvm::ffi::Tensor& payload : payloads) {
      const TensorView p = payload;
      const DLDataType d = p.dtype();
      shape.push_back(d.code | (d.bits << 8) | (static_cast<int64_t>(d.lanes) << 16));
      shape.push_back(p.ndim());
      for (int i = 1; i < p.ndim(); ++i) shape.push_back(p.size(i));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [seen, id] : seen_) {
      if (seen == shape) return id;
    }
    if (seen_.size() >= kMaxShapes) seen_.clear();
    seen_.emplace_back(std::move(shape), next_id_);
    return next_id_++;
  }

 private:
  static constexpr size_t kMaxShapes = 64;
  std::mutex mutex_;  // calls from several Python threads may overlap
  std::vector<std::pair<std::vector<int64_t>, int64_t>> seen_;
  int64_t next_id_ = 0;
};

}  // namespace

void Dispatch(TensorView workspace, TensorView topk_ids, tvm::ffi::Array<tvm::ffi::Tensor> payloads,
              TensorView recv_counts, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
              int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token, int64_t runtime_max_tokens_per_rank,
              int64_t num_experts, double timeout_s, int64_t quant_format,
              tvm::ffi::Optional<tvm::ffi::Tensor> global_scale, bool swizzled_scales, int64_t phase,
              int64_t num_sms, bool one_gpu_per_rank, tvm::ffi::Optional<tvm::ffi::Tensor> eplb_local_stats) {
  // tvm-ffi passes a None entry of the list as an undefined tensor, which no TensorView may be made of.
  for (size_t p = 0; p < payloads.size(); ++p) {
    A2A_CHECK(payloads[p].defined(), TypeError) << "payloads[" << p << "] must be a tensor, got None";
  }
  A2A_CHECK(phase == 0 || phase == 1, ValueError)
      << "dispatch phase must be 0 (send and receive) or 1 (send only), got " << phase;
  CheckSmBudget(num_sms);
  const WorkspaceConfig config =
      MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token);
  const WorkspaceLayout layout = CheckCudaWorkspace(workspace, ep_rank, config);

  A2A_CHECK(IsDType(topk_ids, kDLInt, 32) || IsDType(topk_ids, kDLInt, 64), TypeError)
      << "topk_ids must be int32 or int64, got dtype " << DTypeName(topk_ids.dtype());
  A2A_CHECK(topk_ids.ndim() == 2, ValueError) << "topk_ids must be [num_tokens, top_k], got " << topk_ids.ndim()
                                                  << " dims";
  CheckContiguous(topk_ids, "topk_ids");
  CheckSameDevice(topk_ids, workspace, "topk_ids", "workspace");
  const int64_t num_tokens = topk_ids.size(0);
  A2A_CHECK(topk_ids.size(1) >= 1 && topk_ids.size(1) <= top_k, ValueError)
      << "topk_ids has top_k=" << topk_ids.size(1) << ", the workspace was built for top_k <= " << top_k;
  A2A_CHECK(num_tokens <= runtime_max_tokens_per_rank, ValueError)
      << "topk_ids has " << num_tokens << " tokens, more than runtime_max_tokens_per_rank="
      << runtime_max_tokens_per_rank;
  A2A_CHECK(num_experts >= 1 && num_experts < (int64_t{1} << 31), ValueError)
      << "num_experts must be in [1, 2^31), got " << num_experts;

  CheckRecvCounts(recv_counts, workspace, ep_size);

  const uint64_t timeout_ns = TimeoutNs(timeout_s);

  DispatchParams params{};
  if (eplb_local_stats.has_value()) {
    const tvm::ffi::Tensor held = eplb_local_stats.value();  // a view of a temporary would dangle
    const TensorView stats = held;
    A2A_CHECK(IsDType(stats, kDLInt, 32), TypeError)
        << "eplb_local_stats must be int32, got dtype " << DTypeName(stats.dtype());
    A2A_CHECK(stats.ndim() == 1 && stats.size(0) >= 1 && stats.size(0) <= kMaxEplbExperts, ValueError)
        << "eplb_local_stats must be [eplb_stats_num_experts] with 1 to " << kMaxEplbExperts << " entries, got "
        << stats.ndim() << " dims of " << (stats.ndim() > 0 ? stats.size(0) : 0) << " entries";
    CheckContiguous(stats, "eplb_local_stats");
    CheckSameDevice(stats, workspace, "eplb_local_stats", "workspace");
    params.eplb_local = static_cast<const int32_t*>(BytePtr(stats));
    params.eplb_experts = static_cast<int32_t>(stats.size(0));
    params.eplb_offset = layout.eplb_offset;
  }
  params.num_payloads = static_cast<int32_t>(payloads.size());
  std::vector<int64_t> rows;
  for (size_t p = 0; p < payloads.size(); ++p) {
    const TensorView payload = payloads[p];
    A2A_CHECK(payload.ndim() >= 1 && payload.size(0) == num_tokens, ValueError)
        << "payloads[" << p << "] must have num_tokens=" << num_tokens << " rows like topk_ids";
    // Not CheckContiguous / CheckSameDevice: the message names the index, with no string built per call.
    A2A_CHECK(payload.IsContiguous(), ValueError) << "payloads[" << p << "] must be contiguous";
    A2A_CHECK(payload.device().device_type == workspace.device().device_type &&
                  payload.device().device_id == workspace.device().device_id,
              ValueError)
        << "payloads[" << p << "] must be on the same device as workspace";
    rows.push_back(RowBytes(payload));
  }
  const QuantRequest quant = CheckQuantPayload(ToQuantFormat(quant_format), payloads, global_scale, workspace,
                                               "workspace", swizzled_scales);
  const bool quantize = quant.format != QuantFormat::kNone;
  const RecvRegions regions = PlanRecvRegions(config, layout, runtime_max_tokens_per_rank, rows, quant);
  const bool wide = WideFanOut(static_cast<int>(topk_ids.size(1)), static_cast<int>(ep_size), one_gpu_per_rank);
  const int device = workspace.device().device_id;
  const DispatchLaunchShape shape = DispatchLaunchShapeFor(quant.format, SmBudget(num_sms, device), NumSMs(device),
                                                           static_cast<int>(num_tokens), wide);
  const int max_blocks = shape.max_blocks;
  params.piece_vectors = shape.piece_vectors;
  for (int p = 0; p < params.num_payloads; ++p) {
    params.payload[p] = static_cast<const uint8_t*>(BytePtr(TensorView(payloads[p])));
    params.row_bytes[p] = rows[p];
    params.recv_offset[p] = regions.offsets[quantize && p > 0 ? p + 1 : p];  // values and scales come first
  }
  PlanDispatchCopies(params, static_cast<int>(num_tokens), max_blocks, quantize ? quant.hidden : 0);
  if (quantize) params.quant = MakeDispatchQuant(quant, regions, payloads[0], runtime_max_tokens_per_rank);
  if (global_scale.has_value()) {
    const tvm::ffi::Tensor gs = global_scale.value();
    params.quant.global_scale = static_cast<const float*>(BytePtr(gs));
  }

  DeviceGuard guard(workspace.device().device_id);
  cudaStream_t stream = CurrentStream(workspace);
  params.ranks = Ranks{static_cast<uint8_t*>(BytePtr(workspace)), workspace.stride(0),
                       static_cast<int32_t>(ep_rank), static_cast<int32_t>(ep_size)};
  params.ranks.own_gpu = one_gpu_per_rank;
  params.num_tokens = static_cast<int32_t>(num_tokens);
  params.runtime_max = static_cast<int32_t>(runtime_max_tokens_per_rank);
  params.top_k = static_cast<int32_t>(topk_ids.size(1));
  params.route_stride = static_cast<int32_t>(top_k);
  params.num_experts = static_cast<int32_t>(num_experts);
  params.topk_ids = BytePtr(topk_ids);
  params.routing_offset = layout.routing_offset;
  params.recv_counts = static_cast<int32_t*>(BytePtr(recv_counts));
  params.timeout_ns = timeout_ns;
  params.call_layout = CallLayoutOf(topk_ids, payloads, rows, quant);
  params.phase = static_cast<DispatchPhase>(phase);
  A2A_CUDA_CHECK(LaunchDispatch(params, IsDType(topk_ids, kDLInt, 64), max_blocks, stream));
}

void DispatchRecv(TensorView workspace, TensorView recv_counts, int64_t ep_rank, int64_t ep_size,
                  int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                  int64_t combine_bytes_per_token, int64_t runtime_max_tokens_per_rank, double timeout_s) {
  const WorkspaceConfig config =
      MakeWorkspaceConfig(ep_size, max_num_tokens, top_k, dispatch_bytes_per_token, combine_bytes_per_token);
  CheckCudaWorkspace(workspace, ep_rank, config);
  A2A_CHECK(runtime_max_tokens_per_rank >= 0 && runtime_max_tokens_per_rank <= max_num_tokens, ValueError)
      << "runtime_max_tokens_per_rank must be in [0, max_num_tokens=" << max_num_tokens << "], got "
      << runtime_max_tokens_per_rank;
  CheckRecvCounts(recv_counts, workspace, ep_size);
  const uint64_t timeout_ns = TimeoutNs(timeout_s);

  DeviceGuard guard(workspace.device().device_id);
  cudaStream_t stream = CurrentStream(workspace);
  DispatchParams params{};
  params.ranks = Ranks{static_cast<uint8_t*>(BytePtr(workspace)), workspace.stride(0),
                       static_cast<int32_t>(ep_rank), static_cast<int32_t>(ep_size)};
  params.phase = DispatchPhase::kRecv;
  params.runtime_max = static_cast<int32_t>(runtime_max_tokens_per_rank);
  params.recv_counts = static_cast<int32_t*>(BytePtr(recv_counts));
  params.timeout_ns = timeout_ns;
  A2A_CUDA_CHECK(LaunchDispatch(params, false, 1, stream));
}

// The eager fast path (flashinfer_a2a/transports/nvlink_eager.py): the arguments that stay fixed for one MoeAlltoAll
// bound once, so that each call converts only what changes. Each call runs Dispatch, checks included, and returns
// the id of its payloads' row shapes (RowShapes).
tvm::ffi::Function BindDispatch(tvm::ffi::Tensor workspace, tvm::ffi::Tensor recv_counts, int64_t ep_rank,
                                int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
                                int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token, int64_t num_experts,
                                int64_t num_sms, bool one_gpu_per_rank) {
  auto shapes = std::make_shared<RowShapes>();
  return tvm::ffi::Function::FromTyped(
      [=](TensorView topk_ids, tvm::ffi::Array<tvm::ffi::Tensor> payloads, int64_t runtime_max_tokens_per_rank,
          double timeout_s, int64_t quant_format, tvm::ffi::Optional<tvm::ffi::Tensor> global_scale,
          bool swizzled_scales, int64_t phase, tvm::ffi::Optional<tvm::ffi::Tensor> eplb_local_stats) -> int64_t {
        Dispatch(workspace, topk_ids, payloads, recv_counts, ep_rank, ep_size, max_num_tokens, top_k,
                 dispatch_bytes_per_token, combine_bytes_per_token, runtime_max_tokens_per_rank, num_experts,
                 timeout_s, quant_format, global_scale, swizzled_scales, phase, num_sms, one_gpu_per_rank,
                 eplb_local_stats);
        return shapes->IdOf(payloads);
      });
}

// DispatchRecv with the workspace, rank and sizes bound (the receive half of a split dispatch sent through
// BindDispatch). The counts tensor is passed at each call, not bound: tvm-ffi sets the stream CurrentStream reads
// (torch's current stream) only from a tensor argument of the call, and a call with none would launch on the
// legacy default stream, whatever stream the caller (or a communication stream) made current.
tvm::ffi::Function BindDispatchRecv(tvm::ffi::Tensor workspace, int64_t ep_rank, int64_t ep_size,
                                    int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                                    int64_t combine_bytes_per_token) {
  return tvm::ffi::Function::FromTyped(
      [=](TensorView recv_counts, int64_t runtime_max_tokens_per_rank, double timeout_s) {
        DispatchRecv(workspace, recv_counts, ep_rank, ep_size, max_num_tokens, top_k, dispatch_bytes_per_token,
                     combine_bytes_per_token, runtime_max_tokens_per_rank, timeout_s);
      });
}

}  // namespace flashinfer_a2a
