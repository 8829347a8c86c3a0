// What the combine kernels share: their parameters, the routing preamble of a token's sum, and the epoch
// handshake with the peers (see combine.cuh for the kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "protocol.cuh"

namespace flashinfer_a2a {

constexpr int kCombineThreads = 256;
constexpr int kCombineWarps = kCombineThreads / 32;

struct CombineParams {
  Ranks ranks;
  int32_t num_tokens;   // local tokens of the matching dispatch
  int32_t runtime_max;  // runtime_max_tokens_per_rank of the matching dispatch
  int32_t route_stride; // columns of the routing record
  int64_t routing_offset;
  int64_t combine_offset;      // combine region within every rank's workspace
  int64_t row_bytes;           // hidden * element bytes
  const uint8_t* input;        // [ep_size, runtime_max, hidden] to publish; null when already in the region
  int32_t input_vec_bytes;     // vector width for copying `input`
  const int32_t* recv_counts;  // [ep_size] valid rows per source block of `input`
  void* output;                // [num_tokens, hidden]
  uint64_t timeout_ns;
  bool fp8_wire;  // partials for other ranks travel as FP8 with a scale per 128 elements (bf16|fp16 only)
  bool fp16;      // fp16 partials, else bf16 (fp8_wire only)
  int32_t hidden;
  // Pushed FP8 wire (fp8_wire, one GPU per rank): each rank lands the rows it computed in their owners' workspaces.
  bool push;
  int64_t landing_offset;     // [ep_size (source), runtime_max, Fp8WireRowBytes(hidden)] in every workspace
  int64_t push_flags_offset;  // [ep_size (source), max_num_tokens] uint32 in every workspace
  int32_t max_num_tokens;
};

// Tells every peer that this rank's combine input for `epoch` is in place (the block's threads share the stores).
__device__ __forceinline__ void PublishCombineEpoch(const CombineParams& p, uint32_t epoch) {
  for (int r = threadIdx.x; r < p.ranks.ep_size; r += kCombineThreads) {
    StoreReleaseSys(&p.ranks.Meta(r)->combine_signal[p.ranks.ep_rank], epoch);
  }
}

// Waits (bounded) until every peer has published `epoch`, recording a timeout per missing peer. Returns whether
// one of this thread's peers timed out; the acquires cover only this thread until a barrier extends them.
__device__ __forceinline__ bool WaitCombinePeers(const CombineParams& p, RankMetadata* meta, uint32_t epoch) {
  bool timed_out = false;
  for (int src = threadIdx.x; src < p.ranks.ep_size; src += kCombineThreads) {
    if (!WaitUntil([&] { return EpochReached(LoadAcquireSys(&meta->combine_signal[src]), epoch); },
                   p.timeout_ns)) {
      RecordError(meta, ErrorCode::kTimeout, Phase::kCombine, src, epoch, 0);
      timed_out = true;
    }
  }
  return timed_out;
}

// The ranks local token t went to, for a pull: lane j holds the j-th (rank, slot) entry of the routing record (-1
// past the last, or everywhere once the combine failed); `count` entries in all.
struct TokenSources {
  int32_t entry;
  int count;
};

__device__ __forceinline__ TokenSources LoadTokenSources(const CombineParams& p, bool failed, int64_t t, int lane) {
  const int32_t* routing = reinterpret_cast<const int32_t*>(p.ranks.Base(p.ranks.ep_rank) + p.routing_offset);
  const int32_t entry = (!failed && lane < p.route_stride) ? routing[t * p.route_stride + lane] : -1;
  return {entry, CountRoutes(entry, p.ranks.ep_size, p.runtime_max)};
}

}  // namespace flashinfer_a2a
