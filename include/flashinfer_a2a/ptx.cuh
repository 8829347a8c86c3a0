// PTX helpers: system-scope release/acquire for cross-GPU signals, the global timer, vector copies.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashinfer_a2a {

__device__ __forceinline__ void StoreReleaseSys(uint64_t* addr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ void StoreReleaseSys(uint32_t* addr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

// A strong store at system scope that orders nothing before it: a signal that covers no store of this thread (see
// PublishCombineEpoch). A release store waits first for MEMBAR.SYS, which on H100 costs about 1.5 us even with
// nothing outstanding (one-way flag latency between two H100s 2.48 us with the release, 0.95 us without).
__device__ __forceinline__ void StoreRelaxedSys(uint32_t* addr, uint32_t value) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

__device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* addr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* addr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

// atomicAdd with release and acquire semantics at GPU scope: one instruction where a fence, the add and a fence
// would be three. Its barrier is MEMBAR.GPU, which waits for the stores into this GPU's memory only; the system-scope
// one (MEMBAR.SYS) would cost about 1.5 us more on H100.
__device__ __forceinline__ uint32_t AtomicAddAcqRelGpu(uint32_t* addr, uint32_t value) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(addr), "r"(value) : "memory");
  return old;
}

// Orders this thread's earlier stores (and those a barrier ordered before it) before its later ones at GPU scope.
__device__ __forceinline__ void FenceAcqRelGpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// Adds `value` at addr with release semantics at system scope, returning nothing: the add waits for the thread's
// earlier stores (and those a barrier ordered before it) to be performed, then travels like a store.
__device__ __forceinline__ void RedAddReleaseSys(uint64_t* addr, uint64_t value) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

// Kernels launched by LaunchAfterPrior may start while the kernel before them in the stream is still finishing
// (programmatic dependent launch, sm_90+): each waits here, before it touches memory, until that kernel has completed
// and its writes are visible. A kernel launched without the attribute returns at once.
__device__ __forceinline__ void WaitPriorKernels() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the stream's next kernel (when launched by LaunchAfterPrior) be scheduled now rather than once this kernel's
// blocks have all exited: its blocks take the multiprocessors this one leaves free and wait in WaitPriorKernels,
// which still returns only when this kernel has completed and its writes are visible. The next kernel then starts
// without a launch gap. Only for `allowed` (Ranks::own_gpu).
__device__ __forceinline__ void StartDependents(bool allowed) {
  if (allowed) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Launches kernel<<<blocks, threads, 0, stream>>>(args...) so that it may be scheduled while the stream's previous
// kernel drains; the kernel must call WaitPriorKernels() first.
template <typename... Params, typename... Args>
inline cudaError_t LaunchAfterPrior(void (*kernel)(Params...), int blocks, int threads, cudaStream_t stream,
                                    Args... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(blocks);
  config.blockDim = dim3(threads);
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

// Blocks of `threads` threads of `kernel` that one multiprocessor holds at once (at least 1): a grid-stride kernel
// of this many blocks per multiprocessor runs as one wave, where a fixed 4 per multiprocessor ran 1.33 waves of a
// kernel of which 3 fit (its last blocks alone, the SMs a third busy).
template <typename Kernel>
inline int ResidentBlocksPerSm(Kernel kernel, int threads) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0) != cudaSuccess) blocks = 0;
  return blocks > 1 ? blocks : 1;
}

// The lanes of this warp below the calling one, as a ballot's bits.
__device__ __forceinline__ uint32_t LaneMaskLt() {
  uint32_t mask;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(mask));
  return mask;
}

// Nanoseconds; the same clock on every GPU of a node is not assumed: only differences on one GPU are used.
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// A vector of kBytes bytes, moved with one load and one store instruction.
template <int kBytes>
struct VecOf;
template <>
struct VecOf<16> {
  using Type = uint4;
};
template <>
struct VecOf<8> {
  using Type = uint2;
};
template <>
struct VecOf<4> {
  using Type = uint32_t;
};
template <>
struct VecOf<2> {
  using Type = uint16_t;
};
template <>
struct VecOf<1> {
  using Type = uint8_t;
};

// Largest power-of-two vector width (<= 16 bytes) dividing every value: row sizes and base addresses.
__host__ __device__ inline int VecBytesFor(uint64_t a, uint64_t b, uint64_t c) {
  const uint64_t x = a | b | c;
  if (x % 16 == 0) return 16;
  if (x % 8 == 0) return 8;
  if (x % 4 == 0) return 4;
  if (x % 2 == 0) return 2;
  return 1;
}

}  // namespace flashinfer_a2a
