// Entry points of the nccl transport's kernels (flashinfer_a2a/transports/nccl.py): pack, select, the FP8 combine
// wire and the ordered sum. Each: validate -> device guard -> stream -> fill params -> launch.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/optional.h>

#include <flashinfer_a2a/nccl_combine.cuh>
#include <flashinfer_a2a/nccl_select.cuh>

#include <string>
#include <vector>

#include "kernels.h"
#include "workspace.h"

namespace flashinfer_a2a {

namespace {

// Bytes of one row of t: the product of its sizes from dimension `first` on, times its element's.
int64_t NcclRowBytes(const TensorView& t, int first = 1) {
  int64_t row = ElementBytes(t);
  for (int d = first; d < t.ndim(); ++d) row *= t.size(d);
  return row;
}

// A tensor the caller hands in: on the GPU, contiguous, on ref's device.
void CheckNcclInput(const TensorView& t, const std::string& name, const TensorView& ref, const char* ref_name) {
  A2A_CHECK(IsCuda(t), ValueError) << name << " must be a CUDA tensor";
  CheckContiguous(t, name.c_str());
  CheckSameDevice(t, ref, name.c_str(), ref_name);
}

// What the kernels read or write in 16-byte vectors (the buffers the transport allocates are).
void CheckNcclAligned(const TensorView& t, const std::string& name) {
  A2A_CHECK(reinterpret_cast<uintptr_t>(BytePtr(t)) % kNcclWireAlign == 0, ValueError)
      << name << " must start on a 16-byte boundary";
}

// A uint8 buffer of the transport's (send, gathered, combine wire) of `shape` bytes.
void CheckNcclBuffer(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  bool same = IsDType(t, kDLUInt, 8) && t.ndim() == static_cast<int>(shape.size());
  int d = 0;
  for (const int64_t size : shape) same = same && t.size(d++) == size;
  std::string want;
  for (const int64_t size : shape) want += (want.empty() ? "" : ", ") + std::to_string(size);
  A2A_CHECK(same, ValueError) << name << " must be uint8 of shape [" << want << "] (the nccl transport's layout)";
}

void CheckNcclSizes(int64_t ep_size, int64_t runtime_max) {
  A2A_CHECK(ep_size >= 1 && ep_size <= kMaxRanks, ValueError)
      << "ep_size must be in [1, " << kMaxRanks << "], got " << ep_size;
  A2A_CHECK(runtime_max >= 0 && runtime_max < (int64_t{1} << kRouteSlotBits), ValueError)
      << "runtime_max_tokens_per_rank must be in [0, 2^" << kRouteSlotBits << "), got " << runtime_max;
}

// The wire of one dispatch: a quantized first payload as its values and scales, then the payloads' rows.
NcclWireLayout NcclLayoutOf(int64_t ep_size, int64_t runtime_max, const QuantRequest& quant, const int64_t* rows,
                            int num_payloads) {
  const bool quantize = quant.format != QuantFormat::kNone;
  const int most = quantize ? kMaxPayloads - 1 : kMaxPayloads;
  A2A_CHECK(num_payloads <= most, ValueError)
      << "at most " << most << " payloads per dispatch" << (quantize ? " that quantizes" : "") << ", got "
      << num_payloads;
  int64_t segments[kNcclMaxSegments];
  int n = 0;
  for (int p = 0; p < num_payloads; ++p) {
    if (p == 0 && quantize) {
      NcclQuantRowBytes(quant.format, quant.hidden, quant.swizzled, &segments[0], &segments[1]);
      n = 2;
    } else {
      segments[n++] = rows[p];
    }
  }
  return MakeNcclWireLayout(static_cast<int32_t>(ep_size), static_cast<int32_t>(runtime_max), segments, n);
}

}  // namespace

tvm::ffi::Array<int64_t> GetNcclWireLayout(int64_t ep_size, int64_t runtime_max_tokens_per_rank, int64_t quant_format,
                                           int64_t quant_hidden, bool swizzled_scales,
                                           tvm::ffi::Array<int64_t> payload_row_bytes) {
  CheckNcclSizes(ep_size, runtime_max_tokens_per_rank);
  std::vector<int64_t> rows(payload_row_bytes.begin(), payload_row_bytes.end());
  const NcclWireLayout w =
      NcclLayoutOf(ep_size, runtime_max_tokens_per_rank,
                   MakeQuantRequest(ToQuantFormat(quant_format), quant_hidden, swizzled_scales), rows.data(),
                   static_cast<int>(rows.size()));
  tvm::ffi::Array<int64_t> out{w.plane_stride};
  for (int s = 0; s < w.num_segments; ++s) out.push_back(w.offset[s]);
  out.push_back(w.total_bytes);
  return out;
}

void NcclPack(TensorView send, TensorView topk_ids, tvm::ffi::Array<tvm::ffi::Tensor> payloads, int64_t ep_size,
              int64_t runtime_max_tokens_per_rank, int64_t num_experts, int64_t quant_format,
              tvm::ffi::Optional<tvm::ffi::Tensor> global_scale, bool swizzled_scales) {
  for (size_t p = 0; p < payloads.size(); ++p) {
    A2A_CHECK(payloads[p].defined(), TypeError) << "payloads[" << p << "] must be a tensor, got None";
  }
  CheckNcclSizes(ep_size, runtime_max_tokens_per_rank);
  A2A_CHECK(IsCuda(send), ValueError) << "send must be a CUDA tensor";
  A2A_CHECK(IsDType(topk_ids, kDLInt, 32) || IsDType(topk_ids, kDLInt, 64), TypeError)
      << "topk_ids must be int32 or int64, got dtype " << DTypeName(topk_ids.dtype());
  A2A_CHECK(topk_ids.ndim() == 2 && topk_ids.size(1) >= 1 && topk_ids.size(1) <= kMaxTopK, ValueError)
      << "topk_ids must be [num_tokens, top_k] with top_k in [1, " << kMaxTopK << "]";
  CheckNcclInput(topk_ids, "topk_ids", send, "send");
  const int64_t num_tokens = topk_ids.size(0);
  A2A_CHECK(num_tokens <= runtime_max_tokens_per_rank, ValueError)
      << "topk_ids has " << num_tokens << " tokens, more than runtime_max_tokens_per_rank="
      << runtime_max_tokens_per_rank;
  A2A_CHECK(num_experts >= 1 && num_experts < (int64_t{1} << 31), ValueError)
      << "num_experts must be in [1, 2^31), got " << num_experts;
  const QuantRequest quant =
      CheckQuantPayload(ToQuantFormat(quant_format), payloads, global_scale, send, "send", swizzled_scales);
  int64_t rows[kMaxPayloads];
  for (size_t p = 0; p < payloads.size() && p < kMaxPayloads; ++p) {
    const TensorView payload = payloads[p];
    const std::string name = "payloads[" + std::to_string(p) + "]";
    A2A_CHECK(payload.ndim() >= 1 && payload.size(0) == num_tokens, ValueError)
        << name << " must have num_tokens=" << num_tokens << " rows like topk_ids";
    CheckNcclInput(payload, name, send, "send");
    rows[p] = NcclRowBytes(payload);
    A2A_CHECK(rows[p] >= 1, ValueError) << name << " has empty rows";
  }
  const NcclWireLayout wire = NcclLayoutOf(ep_size, runtime_max_tokens_per_rank, quant, rows,
                                           static_cast<int>(payloads.size()));
  CheckNcclBuffer(send, "send", {wire.total_bytes});
  CheckContiguous(send, "send");
  CheckNcclAligned(send, "send");

  NcclPackParams params{};
  params.wire = wire;
  params.num_tokens = static_cast<int32_t>(num_tokens);
  params.top_k = static_cast<int32_t>(topk_ids.size(1));
  params.num_experts = static_cast<int32_t>(num_experts);
  params.topk_ids = BytePtr(topk_ids);
  const bool quantize = quant.format != QuantFormat::kNone;
  for (size_t p = quantize ? 1 : 0; p < payloads.size(); ++p) {
    const int c = params.num_copies++;
    params.copy_src[c] = static_cast<const uint8_t*>(BytePtr(TensorView(payloads[p])));
    params.copy_segment[c] = static_cast<int32_t>(quantize ? p + 1 : p);
    params.copy_vec_bytes[c] = NcclVecBytes(num_tokens * rows[p], reinterpret_cast<uintptr_t>(params.copy_src[c]));
  }
  if (quantize) {
    const TensorView hidden_states = payloads[0];
    params.quant_src = static_cast<const uint8_t*>(BytePtr(hidden_states));
    DispatchQuant& q = params.quant;
    q.format = quant.format;
    q.fp16 = IsDType(hidden_states, kDLFloat, 16);
    q.vectorized =
        quant.hidden % kQuantLaneElems == 0 && reinterpret_cast<uintptr_t>(params.quant_src) % 16 == 0;
    q.swizzled = false;  // the receiver lays the tiles out (nccl_select.cuh); the wire's rows are padded to them
    q.hidden = static_cast<int32_t>(quant.hidden);
    q.scale_cols = static_cast<int32_t>(wire.row_bytes[1] / WireOf(quant.format).scale_bytes);
    q.value_row_bytes = wire.row_bytes[0];
    q.values_offset = wire.offset[0];
    q.scales_offset = wire.offset[1];
    if (global_scale.has_value()) {
      const tvm::ffi::Tensor gs = global_scale.value();
      q.global_scale = static_cast<const float*>(BytePtr(gs));
    }
  }

  DeviceGuard guard(send.device().device_id);
  cudaStream_t stream = CurrentStream(send);
  params.send = static_cast<uint8_t*>(BytePtr(send));
  A2A_CUDA_CHECK(LaunchNcclPack(params, IsDType(topk_ids, kDLInt, 64), NumSMs(send.device().device_id), stream));
}

void NcclSelect(TensorView gathered, tvm::ffi::Array<tvm::ffi::Tensor> recv, TensorView recv_counts, int64_t ep_rank,
                int64_t runtime_max_tokens_per_rank, int64_t quant_format, int64_t quant_hidden,
                bool swizzled_scales) {
  for (size_t s = 0; s < recv.size(); ++s) {
    A2A_CHECK(recv[s].defined(), TypeError) << "recv[" << s << "] must be a tensor, got None";
  }
  A2A_CHECK(IsCuda(gathered) && gathered.ndim() == 2, ValueError)
      << "gathered must be a CUDA tensor of shape [ep_size, send bytes]";
  const int64_t ep_size = gathered.size(0), runtime_max = runtime_max_tokens_per_rank;
  CheckNcclSizes(ep_size, runtime_max);
  CheckRank(ep_rank, ep_size);
  const QuantRequest quant = MakeQuantRequest(ToQuantFormat(quant_format), quant_hidden, swizzled_scales);
  const bool quantize = quant.format != QuantFormat::kNone;
  A2A_CHECK(recv.size() <= kNcclMaxSegments && recv.size() >= (quantize ? 2u : 0u), ValueError)
      << "recv must hold one tensor per received segment (values and scales of a quantized payload, then one per "
         "payload): at most " << kNcclMaxSegments << (quantize ? ", at least 2" : "") << ", got " << recv.size();
  int64_t expected[2] = {0, 0};
  if (quantize) NcclQuantRowBytes(quant.format, quant.hidden, quant.swizzled, &expected[0], &expected[1]);
  const QuantWire qwire = WireOf(quant.format);
  const int64_t swizzled_block = qwire.ScaleBlockBytes(quant.hidden, runtime_max, true);
  int64_t payload_rows[kMaxPayloads] = {};  // as NcclLayoutOf reads them: recv[s] is payload s, or s - 1 quantized
  NcclSelectParams params{};
  params.swizzled_segment = quant.swizzled ? 1 : -1;
  params.swizzled_block_bytes = swizzled_block;
  for (size_t s = 0; s < recv.size() && s < kNcclMaxSegments; ++s) {
    const TensorView r = recv[s];
    const std::string name = "recv[" + std::to_string(s) + "]";
    CheckNcclInput(r, name, gathered, "gathered");
    CheckNcclAligned(r, name);
    const bool tiles = quant.swizzled && s == 1;
    A2A_CHECK(tiles ? r.ndim() == 2 && r.size(0) == ep_size && NcclRowBytes(r) == swizzled_block
                    : r.ndim() >= 2 && r.size(0) == ep_size && r.size(1) == runtime_max,
              ValueError)
        << name << " must be [ep_size=" << ep_size << ", "
        << (tiles ? "swizzled scale bytes of one source block" : "runtime_max") << ", ...]";
    const int64_t row = tiles ? expected[1] : NcclRowBytes(r, 2);
    A2A_CHECK(s >= 2 || !quantize || row == expected[s], ValueError)
        << name << " must hold " << expected[s] << "-byte rows (the " << (s == 0 ? "values" : "scales")
        << " of hidden=" << quant.hidden << ")";
    if (!quantize || s >= 2) payload_rows[quantize ? s - 1 : s] = row;
    params.recv[s] = static_cast<uint8_t*>(BytePtr(r));
    params.vec_bytes[s] = NcclVecBytes(row, reinterpret_cast<uintptr_t>(params.recv[s]));
  }
  const int num_payloads = static_cast<int>(recv.size()) - (quantize ? 1 : 0);
  const NcclWireLayout wire = NcclLayoutOf(ep_size, runtime_max, quant, payload_rows, num_payloads);
  CheckNcclBuffer(gathered, "gathered", {ep_size, wire.total_bytes});
  CheckContiguous(gathered, "gathered");
  CheckNcclAligned(gathered, "gathered");
  A2A_CHECK(IsDType(recv_counts, kDLInt, 32) && recv_counts.ndim() == 1 && recv_counts.size(0) == ep_size,
            ValueError)
      << "recv_counts must be int32 of shape [ep_size=" << ep_size << "]";
  CheckNcclInput(recv_counts, "recv_counts", gathered, "gathered");

  DeviceGuard guard(gathered.device().device_id);
  cudaStream_t stream = CurrentStream(gathered);
  params.gathered = static_cast<const uint8_t*>(BytePtr(gathered));
  params.wire = wire;
  params.ep_rank = static_cast<int32_t>(ep_rank);
  params.recv_counts = static_cast<int32_t*>(BytePtr(recv_counts));
  A2A_CUDA_CHECK(LaunchNcclSelect(params, NumSMs(gathered.device().device_id), stream));
}

namespace {

// The partials of a combine: [ep_size, runtime_max, hidden] bf16|fp16 (the FP8 wire), or fp32 too. Returns the
// params with the partials' sizes filled.
NcclCombineParams CheckNcclPartials(const TensorView& partials, int64_t ep_rank, bool fp8_wire) {
  const bool half = IsDType(partials, kDLBfloat, 16) || IsDType(partials, kDLFloat, 16);
  A2A_CHECK(half || (!fp8_wire && IsDType(partials, kDLFloat, 32)), TypeError)
      << "partials must be bfloat16, float16" << (fp8_wire ? " (the FP8 wire)" : " or float32") << ", got dtype "
      << DTypeName(partials.dtype());
  A2A_CHECK(partials.ndim() == 3, ValueError) << "partials must be [ep_size, runtime_max, hidden]";
  A2A_CHECK(IsCuda(partials), ValueError) << "partials must be a CUDA tensor";
  CheckContiguous(partials, "partials");
  if (fp8_wire) CheckNcclAligned(partials, "partials");
  CheckNcclSizes(partials.size(0), partials.size(1));
  CheckRank(ep_rank, partials.size(0));
  const int64_t hidden = partials.size(2);
  A2A_CHECK(hidden >= 1 && (!fp8_wire || hidden % kQuantLaneElems == 0), ValueError)
      << "partials' hidden=" << hidden << " must be "
      << (fp8_wire ? "a positive multiple of 8 (the FP8 wire)" : ">= 1");
  NcclCombineParams p{};
  CombineParams& c = p.c;
  c.ranks = Ranks{nullptr, 0, static_cast<int32_t>(ep_rank), static_cast<int32_t>(partials.size(0))};
  c.input = static_cast<const uint8_t*>(BytePtr(partials));
  c.row_bytes = hidden * ElementBytes(partials);
  c.runtime_max = static_cast<int32_t>(partials.size(1));
  c.hidden = static_cast<int32_t>(hidden);
  c.fp8_wire = fp8_wire;
  c.fp16 = IsDType(partials, kDLFloat, 16);
  p.wire_row_bytes = fp8_wire ? Fp8WireRowBytes(hidden) : c.row_bytes;
  return p;
}

}  // namespace

void NcclCombineWire(TensorView wire, TensorView partials, TensorView recv_counts, int64_t ep_rank) {
  NcclCombineParams p = CheckNcclPartials(partials, ep_rank, true);
  const int64_t ep_size = partials.size(0), rows = ep_size * partials.size(1);
  CheckNcclBuffer(wire, "wire", {rows, p.wire_row_bytes});
  CheckNcclInput(wire, "wire", partials, "partials");
  CheckNcclAligned(wire, "wire");
  A2A_CHECK(IsDType(recv_counts, kDLInt, 32) && recv_counts.ndim() == 1 && recv_counts.size(0) == ep_size,
            ValueError)
      << "recv_counts must be int32 of shape [ep_size=" << ep_size << "]";
  CheckNcclInput(recv_counts, "recv_counts", partials, "partials");

  const int device = partials.device().device_id;
  DeviceGuard guard(device);
  cudaStream_t stream = CurrentStream(partials);
  p.wire = static_cast<uint8_t*>(BytePtr(wire));
  p.c.recv_counts = static_cast<const int32_t*>(BytePtr(recv_counts));
  A2A_CUDA_CHECK(p.c.fp16 ? LaunchNcclCombineWire<__half>(p, NumSMs(device), stream)
                          : LaunchNcclCombineWire<__nv_bfloat16>(p, NumSMs(device), stream));
}

void NcclCombineSum(TensorView out, TensorView returned, TensorView send, TensorView partials, int64_t ep_rank,
                    bool fp8_wire) {
  NcclCombineParams p = CheckNcclPartials(partials, ep_rank, fp8_wire);
  const int64_t ep_size = partials.size(0), runtime_max = partials.size(1), hidden = partials.size(2);
  A2A_CHECK(out.dtype() == partials.dtype(), TypeError) << "out must have the partials' dtype";
  A2A_CHECK(out.ndim() == 2 && out.size(1) == hidden && out.size(0) <= runtime_max, ValueError)
      << "out must be [num_tokens, hidden=" << hidden << "] with num_tokens <= runtime_max=" << runtime_max;
  CheckNcclInput(out, "out", partials, "partials");
  if (fp8_wire) CheckNcclAligned(out, "out");
  CheckNcclBuffer(returned, "returned", {ep_size * runtime_max, p.wire_row_bytes});
  CheckNcclInput(returned, "returned", partials, "partials");
  CheckNcclAligned(returned, "returned");
  const int64_t plane_stride = AlignUp(runtime_max, kNcclWireAlign);
  A2A_CHECK(IsDType(send, kDLUInt, 8) && send.ndim() == 1 && send.size(0) >= (ep_size + 7) / 8 * plane_stride,
            ValueError)
      << "send must be the uint8 send buffer of the dispatch (its mask planes first)";
  CheckNcclInput(send, "send", partials, "partials");
  CheckNcclAligned(send, "send");

  const int device = partials.device().device_id;
  DeviceGuard guard(device);
  cudaStream_t stream = CurrentStream(partials);
  p.c.ranks.workspace = static_cast<uint8_t*>(BytePtr(returned));  // the landing block, at offset 0 of "each rank"
  p.c.num_tokens = static_cast<int32_t>(out.size(0));
  p.c.output = BytePtr(out);
  p.mask = static_cast<const uint8_t*>(BytePtr(send));
  p.plane_stride = plane_stride;
  const int sms = NumSMs(device);
  cudaError_t err;
  if (IsDType(partials, kDLBfloat, 16)) {
    err = LaunchNcclSum<__nv_bfloat16>(p, fp8_wire, sms, stream);
  } else if (p.c.fp16) {
    err = LaunchNcclSum<__half>(p, fp8_wire, sms, stream);
  } else {
    err = LaunchNcclSum<float>(p, fp8_wire, sms, stream);
  }
  A2A_CUDA_CHECK(err);
}

}  // namespace flashinfer_a2a
