// The module's C ABI: every function flashinfer_a2a exports through tvm-ffi, on one screen.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/optional.h>
#include <tvm/ffi/string.h>

namespace flashinfer_a2a {

using tvm::ffi::Array;
using tvm::ffi::Map;
using tvm::ffi::Optional;
using tvm::ffi::String;
using tvm::ffi::Tensor;
using tvm::ffi::TensorView;

// workspace.cu
int64_t GetWorkspaceSize(int64_t ep_size, int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                         int64_t combine_bytes_per_token);
Array<int64_t> GetDispatchLayout(int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
                                 int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token,
                                 int64_t runtime_max_tokens_per_rank, Array<int64_t> payload_row_bytes,
                                 int64_t quant_format, int64_t quant_hidden, bool swizzled_scales);
Map<String, int64_t> GetMetainfoIndexPairs();
Map<String, int64_t> GetConstants();
void Initialize(TensorView workspace, TensorView metainfo, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                int64_t top_k, int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token);
// dispatch.cu
void Dispatch(TensorView workspace, TensorView topk_ids, Array<Tensor> payloads, TensorView recv_counts,
              int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
              int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token, int64_t runtime_max_tokens_per_rank,
              int64_t num_experts, double timeout_s, int64_t quant_format, Optional<Tensor> global_scale,
              bool swizzled_scales, int64_t phase, int64_t num_sms, bool one_gpu_per_rank,
              Optional<Tensor> eplb_local_stats);
tvm::ffi::Function BindDispatch(Tensor workspace, Tensor recv_counts, int64_t ep_rank, int64_t ep_size,
                                int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                                int64_t combine_bytes_per_token, int64_t num_experts, int64_t num_sms,
                                bool one_gpu_per_rank);
void DispatchRecv(TensorView workspace, TensorView recv_counts, int64_t ep_rank, int64_t ep_size,
                  int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                  int64_t combine_bytes_per_token, int64_t runtime_max_tokens_per_rank, double timeout_s);
tvm::ffi::Function BindDispatchRecv(Tensor workspace, int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens,
                                    int64_t top_k, int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token);
// combine.cu
void Combine(TensorView workspace, Optional<Tensor> partials, TensorView recv_counts, TensorView out,
             int64_t ep_rank, int64_t ep_size, int64_t max_num_tokens, int64_t top_k,
             int64_t dispatch_bytes_per_token, int64_t combine_bytes_per_token, int64_t runtime_max_tokens_per_rank,
             double timeout_s, bool one_gpu_per_rank, int64_t quant_format, int64_t combine_mode, int64_t phase,
             int64_t num_sms);
tvm::ffi::Function BindCombine(Tensor workspace, Tensor recv_counts, int64_t ep_rank, int64_t ep_size,
                               int64_t max_num_tokens, int64_t top_k, int64_t dispatch_bytes_per_token,
                               int64_t combine_bytes_per_token, bool one_gpu_per_rank, int64_t num_sms);
void SanitizeExpertIds(TensorView recv_topk_ids, TensorView recv_counts, int64_t invalid_id);
// nccl.cu: the nccl transport's kernels
Array<int64_t> GetNcclWireLayout(int64_t ep_size, int64_t runtime_max_tokens_per_rank, int64_t quant_format,
                                 int64_t quant_hidden, bool swizzled_scales, Array<int64_t> payload_row_bytes);
void NcclPack(TensorView send, TensorView topk_ids, Array<Tensor> payloads, int64_t ep_size,
              int64_t runtime_max_tokens_per_rank, int64_t num_experts, int64_t quant_format,
              Optional<Tensor> global_scale, bool swizzled_scales);
void NcclSelect(TensorView gathered, Array<Tensor> recv, TensorView recv_counts, int64_t ep_rank,
                int64_t runtime_max_tokens_per_rank, int64_t quant_format, int64_t quant_hidden, bool swizzled_scales);
void NcclCombineWire(TensorView wire, TensorView partials, TensorView recv_counts, int64_t ep_rank);
void NcclCombineSum(TensorView out, TensorView returned, TensorView send, TensorView partials, int64_t ep_rank,
                    bool fp8_wire);

}  // namespace flashinfer_a2a

TVM_FFI_DLL_EXPORT_TYPED_FUNC(get_workspace_size, flashinfer_a2a::GetWorkspaceSize);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(get_dispatch_layout, flashinfer_a2a::GetDispatchLayout);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(get_metainfo_index_pairs, flashinfer_a2a::GetMetainfoIndexPairs);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(get_constants, flashinfer_a2a::GetConstants);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(initialize, flashinfer_a2a::Initialize);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dispatch, flashinfer_a2a::Dispatch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(dispatch_recv, flashinfer_a2a::DispatchRecv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bind_dispatch, flashinfer_a2a::BindDispatch);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bind_dispatch_recv, flashinfer_a2a::BindDispatchRecv);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(combine, flashinfer_a2a::Combine);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(bind_combine, flashinfer_a2a::BindCombine);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(sanitize_expert_ids, flashinfer_a2a::SanitizeExpertIds);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(get_nccl_wire_layout, flashinfer_a2a::GetNcclWireLayout);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(nccl_pack, flashinfer_a2a::NcclPack);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(nccl_select, flashinfer_a2a::NcclSelect);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(nccl_combine_wire, flashinfer_a2a::NcclCombineWire);
TVM_FFI_DLL_EXPORT_TYPED_FUNC(nccl_combine_sum, flashinfer_a2a::NcclCombineSum);
