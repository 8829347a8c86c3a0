// Shared pieces of the tvm-ffi entry points: argument checks that name the argument, the device guard, the stream.
#pragma once

#include <cuda_runtime.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <cstdint>
#include <string>

namespace flashinfer_a2a {

using tvm::ffi::TensorView;

// A caller's mistake: raises `ErrorKind` with just the message streamed after it. TVM_FFI_CHECK would prefix it
// with "Check failed: (<the C++ condition>) is false:", which names our variables, not the caller's arguments.
#define A2A_CHECK(cond, ErrorKind) \
  if (TVM_FFI_PREDICT_FALSE(!(cond))) TVM_FFI_THROW(ErrorKind)

#define A2A_CUDA_CHECK(expr)                                                                          \
  do {                                                                                                \
    cudaError_t a2a_err_ = (expr);                                                                    \
    A2A_CHECK(a2a_err_ == cudaSuccess, RuntimeError) << #expr << ": " << cudaGetErrorString(a2a_err_); \
  } while (0)

// Address of the first element (DLPack allows the data pointer and a byte offset to split it).
inline void* BytePtr(const TensorView& t) { return static_cast<uint8_t*>(t.data_ptr()) + t.byte_offset(); }

inline bool IsCuda(const TensorView& t) { return t.device().device_type == kDLCUDA; }

inline std::string DTypeName(DLDataType d) {
  return "(code=" + std::to_string(d.code) + ", bits=" + std::to_string(d.bits) + ", lanes=" +
         std::to_string(d.lanes) + ")";
}

inline bool IsDType(const TensorView& t, DLDataTypeCode code, int bits) {
  return t.dtype().code == code && t.dtype().bits == bits && t.dtype().lanes == 1;
}

inline int64_t ElementBytes(const TensorView& t) { return (t.dtype().bits * t.dtype().lanes + 7) / 8; }

inline int64_t NumBytes(const TensorView& t) { return t.numel() * ElementBytes(t); }

inline void CheckContiguous(const TensorView& t, const char* name) {
  A2A_CHECK(t.IsContiguous(), ValueError) << name << " must be contiguous";
}

inline void CheckSameDevice(const TensorView& t, const TensorView& ref, const char* name, const char* ref_name) {
  A2A_CHECK(t.device().device_type == ref.device().device_type && t.device().device_id == ref.device().device_id,
                ValueError)
      << name << " must be on the same device as " << ref_name;
}

// Validates the `[ep_size] int32` counts tensor of a dispatch or combine, on the workspace's device.
inline void CheckRecvCounts(const TensorView& recv_counts, const TensorView& workspace, int64_t ep_size) {
  A2A_CHECK(IsDType(recv_counts, kDLInt, 32) && recv_counts.ndim() == 1 && recv_counts.size(0) == ep_size, ValueError)
      << "recv_counts must be int32 of shape [ep_size=" << ep_size << "]";
  CheckContiguous(recv_counts, "recv_counts");
  CheckSameDevice(recv_counts, workspace, "recv_counts", "workspace");
}

// Validates the `[ep_size, bytes_per_rank] uint8` workspace whose row r addresses rank r's workspace.
inline void CheckWorkspace(const TensorView& workspace, int64_t ep_size, int64_t required_bytes) {
  A2A_CHECK(IsDType(workspace, kDLUInt, 8), TypeError)
      << "workspace must be uint8, got dtype " << DTypeName(workspace.dtype());
  A2A_CHECK(workspace.ndim() == 2 && workspace.size(0) == ep_size, ValueError)
      << "workspace must have shape [ep_size=" << ep_size << ", bytes_per_rank]";
  A2A_CHECK(workspace.stride(1) == 1, ValueError) << "workspace rows must be contiguous";
  A2A_CHECK(workspace.size(1) >= required_bytes, ValueError)
      << "workspace has " << workspace.size(1) << " bytes per rank, the layout needs " << required_bytes
      << " (see get_workspace_size)";
  A2A_CHECK(reinterpret_cast<uintptr_t>(BytePtr(workspace)) % 128 == 0 && workspace.stride(0) % 128 == 0,
                ValueError)
      << "workspace rows must start on 128-byte boundaries";
}

inline void CheckRank(int64_t ep_rank, int64_t ep_size) {
  A2A_CHECK(ep_rank >= 0 && ep_rank < ep_size, ValueError)
      << "ep_rank must be in [0, ep_size=" << ep_size << "), got " << ep_rank;
}

// Sets the current device for the scope, restoring the previous one on exit (neither call when it is already
// current: every eager launch goes through here).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    A2A_CUDA_CHECK(cudaGetDevice(&previous_));
    changed_ = previous_ != device;
    if (changed_) A2A_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// The caller's current stream (tvm-ffi takes it from torch's current stream when the call passes a torch tensor;
// a call that passes none gets the stream nothing set, the legacy default one: every launching entry takes one).
inline cudaStream_t CurrentStream(const TensorView& t) {
  return static_cast<cudaStream_t>(TVMFFIEnvGetStream(kDLCUDA, t.device().device_id));
}

}  // namespace flashinfer_a2a
