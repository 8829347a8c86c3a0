// Host-side workspace configuration shared by the entry points: validated construction of WorkspaceConfig.
#pragma once

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/optional.h>

#include <flashinfer_a2a/workspace_layout.cuh>

#include "common.h"

namespace flashinfer_a2a {

inline WorkspaceConfig MakeWorkspaceConfig(int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
                                           int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token) {
  A2A_CHECK(ep_size >= 1 && ep_size <= kMaxRanks, ValueError)
      << "ep_size must be in [1, " << kMaxRanks << "], got " << ep_size;
  A2A_CHECK(max_num_tokens >= 1 && max_num_tokens < (int64_t{1} << kRouteSlotBits), ValueError)
      << "max_num_tokens must be in [1, " << (int64_t{1} << kRouteSlotBits) << "), got " << max_num_tokens;
  A2A_CHECK(top_k >= 1 && top_k <= kMaxTopK, ValueError)
      << "top_k must be in [1, " << kMaxTopK << "], got " << top_k;
  A2A_CHECK(dispatch_bytes_per_token >= 0, ValueError)
      << "dispatch_bytes_per_token must be >= 0, got " << dispatch_bytes_per_token;
  A2A_CHECK(combine_bytes_per_token >= 0, ValueError)
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
  A2A_CHECK(IsCuda(workspace), ValueError) << "workspace must be a CUDA tensor";
  CheckWorkspace(workspace, config.ep_size, layout.total_bytes);
  return layout;
}

// What a dispatch quantizes: its first payload, [num_tokens, hidden] bf16|fp16, into `format`.
struct QuantRequest {
  QuantFormat format = QuantFormat::kNone;
  int64_t hidden = 0;
  bool swizzled = false;  // scales in the 128x4-tile layout
};

inline QuantFormat ToQuantFormat(int64_t format) {
  A2A_CHECK(format >= 0 && format <= 3, ValueError)
      << "quant_format must be 0 (none), 1 (fp8_block), 2 (mxfp8) or 3 (nvfp4), got " << format;
  return static_cast<QuantFormat>(format);
}

inline QuantRequest MakeQuantRequest(QuantFormat format, int64_t hidden, bool swizzled) {
  QuantRequest q{format, hidden, swizzled};
  if (q.format == QuantFormat::kNone) {
    A2A_CHECK(!swizzled, ValueError) << "swizzled_scales needs a quant_format";
    return q;
  }
  A2A_CHECK(hidden >= 1 && hidden < (int64_t{1} << 30), ValueError)
      << "the hidden size to quantize must be in [1, 2^30), got " << hidden;
  A2A_CHECK(!swizzled || q.format != QuantFormat::kFp8Block, ValueError)
      << "swizzled_scales needs one-byte scales (mxfp8 or nvfp4); fp8_block scales are fp32";
  return q;
}

// The quantization a dispatch (or the nccl transport's pack) asks for, checked: payloads[0] bf16|fp16 [num_tokens,
// hidden], and a float32 global scale of one element, on ref's device, exactly when the format is NVFP4.
inline QuantRequest CheckQuantPayload(QuantFormat format, const tvm::ffi::Array<tvm::ffi::Tensor>& payloads,
                                      const tvm::ffi::Optional<tvm::ffi::Tensor>& global_scale, const TensorView& ref,
                                      const char* ref_name, bool swizzled_scales) {
  int64_t hidden = 0;
  if (format != QuantFormat::kNone) {
    A2A_CHECK(!payloads.empty() && TensorView(payloads[0]).ndim() == 2 &&
                  (IsDType(payloads[0], kDLBfloat, 16) || IsDType(payloads[0], kDLFloat, 16)),
              TypeError)
        << "payloads[0] (the hidden states to quantize) must be [num_tokens, hidden] bfloat16 or float16";
    hidden = TensorView(payloads[0]).size(1);
  }
  const bool nvfp4 = format == QuantFormat::kNvfp4;
  A2A_CHECK(global_scale.has_value() == nvfp4, ValueError)
      << (nvfp4 ? "quant_format nvfp4 needs global_scale" : "global_scale is only used by quant_format nvfp4");
  if (nvfp4) {
    const tvm::ffi::Tensor gs_tensor = global_scale.value();
    const TensorView gs = gs_tensor;
    A2A_CHECK(IsDType(gs, kDLFloat, 32) && gs.numel() == 1, ValueError)
        << "global_scale must be a float32 tensor of one element";
    CheckSameDevice(gs, ref, "global_scale", ref_name);
  }
  return MakeQuantRequest(format, hidden, swizzled_scales);
}

// The receive regions of one dispatch: one per payload, except that a quantized first payload arrives as two
// (values, then scales).
struct RecvRegions {
  int count = 0;
  int64_t offsets[kMaxPayloads] = {};
};

// Checks a dispatch's runtime_max and payload row sizes against the workspace's sizes, and places its receive
// regions.
template <typename RowBytes>
inline RecvRegions PlanRecvRegions(const WorkspaceConfig& config, const WorkspaceLayout& layout, int64_t runtime_max,
                                   const RowBytes& payload_row_bytes, const QuantRequest& quant) {
  A2A_CHECK(runtime_max >= 0 && runtime_max <= config.max_num_tokens, ValueError)
      << "runtime_max_tokens_per_rank must be in [0, max_num_tokens=" << config.max_num_tokens << "], got "
      << runtime_max;
  const int64_t num_payloads = static_cast<int64_t>(payload_row_bytes.size());
  const bool quantize = quant.format != QuantFormat::kNone;
  const int64_t max_payloads = quantize ? kMaxPayloads - 1 : kMaxPayloads;
  A2A_CHECK(num_payloads <= max_payloads, ValueError)
      << "at most " << max_payloads << " payloads per dispatch"
      << (quantize ? " that quantizes (the hidden states arrive as values and scales)" : "") << ", got "
      << num_payloads;
  A2A_CHECK(!quantize || num_payloads >= 1, ValueError) << "a quantizing dispatch needs the hidden states as "
                                                               "payloads[0]";
  RecvRegions regions;
  int64_t block_bytes[kMaxPayloads];
  int64_t token_bytes = 0, total_block_bytes = 0;
  auto add = [&](int64_t row, int64_t block) {
    block_bytes[regions.count++] = block;
    token_bytes += row;
    total_block_bytes += block;
  };
  for (int64_t p = 0; p < num_payloads; ++p) {
    const int64_t row = payload_row_bytes[p];
    A2A_CHECK(row >= 1, ValueError) << "payload " << p << " has empty rows";
    if (p == 0 && quantize) {
      A2A_CHECK(row == 2 * quant.hidden, ValueError)
          << "payloads[0] must be [num_tokens, hidden=" << quant.hidden << "] bf16 or fp16 to quantize";
      const QuantWire wire = WireOf(quant.format);
      add(wire.ValueBytes(quant.hidden), runtime_max * wire.ValueBytes(quant.hidden));
      add(wire.ScaleCols(quant.hidden) * wire.scale_bytes,
          wire.ScaleBlockBytes(quant.hidden, runtime_max, quant.swizzled));
    } else {
      add(row, runtime_max * row);
    }
  }
  A2A_CHECK(token_bytes <= config.dispatch_bytes_per_token, ValueError)
      << "payloads need " << token_bytes << " bytes per token, the workspace was sized for dispatch_bytes_per_token="
      << config.dispatch_bytes_per_token;
  A2A_CHECK(total_block_bytes <= config.max_num_tokens * config.dispatch_bytes_per_token, ValueError)
      << "swizzled scales pad each source block to 128 rows: the payloads need " << total_block_bytes
      << " bytes per source block, the workspace holds max_num_tokens * dispatch_bytes_per_token = "
      << config.max_num_tokens * config.dispatch_bytes_per_token;
  ComputeRecvOffsets(layout, config.ep_size, block_bytes, regions.count, regions.offsets);
  return regions;
}

}  // namespace flashinfer_a2a
