// The per-rank workspace layout: the single definition of where everything lives.
//
// Each rank owns one workspace of `bytes_per_rank` bytes, mapped into every peer's address space:
//
//   [ RankMetadata | EPLB statistics | push flags | routing record | dispatch receive region | combine region ]
//
// - RankMetadata: epochs, the grid-completion counter, the error record (written by this rank), and the signal
//   slots peers store into (indexed by the writer's rank).
// - EPLB statistics: [ep_size, kMaxEplbExperts] int32, row r the statistics rank r's last dispatch carried here
//   (the first eplb_stats_num_experts of each row are used). A fixed width keeps the sizes of a workspace free of it.
// - push flags: [ep_size, max_num_tokens] uint32, the epoch of the last pushed combine in which that rank landed
//   its row for local token slot s here (see combine_push.cuh). Cleared with the metadata at initialization.
// - routing record: [max_num_tokens, top_k] int32, written by this rank's dispatch and read by its combine. Entry
//   (t, k) packs (rank << kRouteSlotBits) | slot for the k-th distinct target rank of local token t in increasing
//   rank order; -1 ends the list.
// - dispatch receive region: payload p of the current dispatch is received into [ep_size, runtime_max, row_bytes_p]
//   (source rank major), each payload starting on a 128-byte boundary.
// - combine region: [ep_size, runtime_max, combine_row_bytes], the expert outputs peers pull during combine; a
//   pushed combine lands the peers' rows right after them, [ep_size, runtime_max, landing row bytes] (the partial
//   row, or Fp8WireRowBytes over the FP8 wire).
//
// Plain C++ (no CUDA runtime calls): the host entry points and the kernels include it alike.
#pragma once

#include <cstddef>
#include <cstdint>

namespace flashinfer_a2a {

constexpr int kMaxRanks = 72;      // one GB200 NVL72 NVLink domain
constexpr int kMaxTopK = 32;
constexpr int kMaxPayloads = 8;
constexpr int64_t kAlignBytes = 128;  // a full L2 line: peers' signal slots and regions never share one by accident
constexpr int kMaxEplbExperts = 1024;  // EPLB statistics a dispatch carries per rank, at most
constexpr int kRouteSlotBits = 24;    // slots < 2^24 tokens per rank; ranks < 2^7 in the bits above

enum class ErrorCode : int32_t {
  kNone = 0,
  kTimeout = 1,             // a spin-wait on `peer` expired
  kInvalidExpertId = 2,     // a top-k id outside [-1, num_experts); detail = flat index into topk_ids
  kRuntimeMaxMismatch = 3,  // `peer` dispatched with another runtime_max_tokens_per_rank; detail = its value
  kCallLayoutMismatch = 4,  // `peer` dispatched another call layout; detail = its fingerprint XOR this rank's
};

enum class Phase : int32_t { kNone = 0, kDispatch = 1, kCombine = 2 };

// First error seen on this rank. Kernels skip every wait once `code` is set, so one lost peer costs one timeout,
// not one per call; re-initializing the workspace clears it.
struct ErrorRecord {
  int32_t code;   // ErrorCode
  int32_t phase;  // Phase
  int32_t peer;   // the rank involved, -1 if none
  uint32_t epoch;
  int64_t detail;
};

struct alignas(kAlignBytes) RankMetadata {
  // Written by this rank only.
  // Dispatches completed since initialize. A combine runs the epoch of its dispatch (calls alternate), so it has no
  // counter of its own to advance when it ends.
  alignas(kAlignBytes) uint32_t dispatch_epoch;
  uint32_t blocks_done;                          // completion counter of the running kernel; 0 between launches
  uint32_t combine_published;                    // epoch a combine's claiming block has published to the peers
  uint32_t combine_claim;                        // rows claimed by the running pushed combine's pushers; 0 between
  uint32_t combine_reduce_claim;                 // token chunks claimed by its reducers; 0 between launches
  // Ranks outside the active set (bit r = rank r), written by this rank's host between steps: no kernel sends to,
  // signals or waits on them. Read by every kernel at its start, so a CUDA graph follows the set in force at replay.
  // Zero (every rank active) after initialize.
  uint32_t inactive_ranks[(kMaxRanks + 31) / 32];
  alignas(kAlignBytes) ErrorRecord error;
  // Written by peers, indexed by the writing rank.
  // The arrival word of that rank's running dispatch: its blocks add (1 << 32) | their tokens sent here, the first
  // block the units to make kDispatchArrivalUnits (dispatch.cuh); cleared by this rank once complete.
  alignas(kAlignBytes) uint64_t dispatch_signal[kMaxRanks];
  // Words a peer stores as (epoch << 32) | value (Tagged), which the receiver checks beside the arrival word: tagged
  // with their epoch, they can be loaded with it instead of after its acquire.
  alignas(kAlignBytes) uint64_t peer_runtime_max[kMaxRanks];     // its runtime_max_tokens_per_rank
  alignas(kAlignBytes) uint64_t peer_call_layout[kMaxRanks][2];  // its CallLayout fingerprint: low, high 32 bits
  alignas(kAlignBytes) uint32_t combine_signal[kMaxRanks];   // epoch whose combine input that rank has published
};

// Fingerprint of a dispatch call's layout, published with its arrivals so a receiver can refuse rows laid out
// differently from its own call (int64 ids on one rank, int32 on another: every row lands at the wrong offsets).
// Fields sit in bit ranges of their own, so the XOR of two fingerprints names the fields that differ:
//   bits 0-5 top_k (columns of topk_ids), bit 6 int64 ids, bits 7-8 QuantFormat, bit 9 swizzled scales,
//   bits 10-13 number of payloads, bits 14-31 hash of the payload dtypes, bits 32-63 hash of their row bytes.
struct CallLayoutField {
  const char* name;
  int shift;
  int bits;
};
constexpr CallLayoutField kCallLayoutFields[] = {
    {"top_k", 0, 6},           {"topk_ids dtype", 6, 1},        {"quant_format", 7, 2},
    {"swizzled_scales", 9, 1}, {"number of payloads", 10, 4},   {"payload dtypes", 14, 18},
    {"payload row bytes", 32, 32},
};

// FNV-1a, 64-bit: a step per value, no tables; folded to the width of its field.
constexpr uint64_t kFnvOffset = 14695981039346656037ull;
constexpr uint64_t Fnv1a(uint64_t hash, uint64_t value) {
  for (int i = 0; i < 8; ++i) hash = (hash ^ ((value >> (8 * i)) & 0xffu)) * 1099511628211ull;
  return hash;
}

constexpr int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// The sizes a workspace is built for (all per rank).
struct WorkspaceConfig {
  int32_t ep_size;
  int64_t max_num_tokens;            // most tokens any rank dispatches in one call
  int32_t top_k;                     // most experts per token
  int64_t dispatch_bytes_per_token;  // sum of the row bytes of every dispatched payload
  int64_t combine_bytes_per_token;   // row bytes of one combine partial (hidden * element size)
};

struct WorkspaceLayout {
  int64_t metadata_offset;
  int64_t eplb_offset;
  int64_t push_flags_offset;
  int64_t routing_offset;
  int64_t dispatch_offset;
  int64_t combine_offset;
  int64_t total_bytes;
};

inline WorkspaceLayout ComputeLayout(const WorkspaceConfig& c) {
  WorkspaceLayout l{};
  l.metadata_offset = 0;
  l.eplb_offset = AlignUp(static_cast<int64_t>(sizeof(RankMetadata)), kAlignBytes);
  const int64_t eplb_bytes = c.ep_size * int64_t{kMaxEplbExperts} * static_cast<int64_t>(sizeof(int32_t));
  l.push_flags_offset = AlignUp(l.eplb_offset + eplb_bytes, kAlignBytes);
  const int64_t push_flag_bytes = c.ep_size * c.max_num_tokens * static_cast<int64_t>(sizeof(uint32_t));
  l.routing_offset = AlignUp(l.push_flags_offset + push_flag_bytes, kAlignBytes);
  const int64_t routing_bytes = c.max_num_tokens * c.top_k * static_cast<int64_t>(sizeof(int32_t));
  l.dispatch_offset = AlignUp(l.routing_offset + routing_bytes, kAlignBytes);
  // Each payload starts on a 128-byte boundary: at most kAlignBytes of padding after each of kMaxPayloads.
  const int64_t dispatch_bytes =
      c.ep_size * c.max_num_tokens * c.dispatch_bytes_per_token + kMaxPayloads * kAlignBytes;
  l.combine_offset = AlignUp(l.dispatch_offset + dispatch_bytes, kAlignBytes);
  const int64_t combine_bytes = c.ep_size * c.max_num_tokens * c.combine_bytes_per_token;
  l.total_bytes = AlignUp(l.combine_offset + combine_bytes, kAlignBytes);
  return l;
}

// Byte offsets (within a rank's workspace) of each receive region of one dispatch call, given the bytes of one
// source block of each (runtime_max rows of a payload, or a swizzled scale block). Fits inside the dispatch region
// whenever every block_bytes sums to at most max_num_tokens * dispatch_bytes_per_token.
inline void ComputeRecvOffsets(const WorkspaceLayout& l, int32_t ep_size, const int64_t* block_bytes,
                               int num_regions, int64_t* offsets) {
  int64_t offset = l.dispatch_offset;
  for (int p = 0; p < num_regions; ++p) {
    offsets[p] = offset;
    offset = AlignUp(offset + ep_size * block_bytes[p], kAlignBytes);
  }
}

// Quantized wire formats a dispatch can quantize its first payload into (values and one scale per block of
// elements; defined in quant.cuh and flashinfer_a2a/reference/quant.py). The values arrive in one receive region
// and the scales in the next.
enum class QuantFormat : int32_t { kNone = 0, kFp8Block = 1, kMxfp8 = 2, kNvfp4 = 3 };

struct QuantWire {
  int32_t block;              // elements per scale
  int32_t scale_bytes;        // fp32 for FP8 block scales, one byte (UE8M0 / UE4M3) otherwise
  int32_t elements_per_byte;  // 2 for packed E2M1

  int64_t ValueBytes(int64_t hidden) const { return (hidden + elements_per_byte - 1) / elements_per_byte; }
  int64_t ScaleCols(int64_t hidden) const { return (hidden + block - 1) / block; }
  // One source block's scales: [rows, cols] row-major, or the 128x4-tile layout (rows padded to 128, columns to 4).
  int64_t ScaleBlockBytes(int64_t hidden, int64_t rows, bool swizzled) const {
    const int64_t cols = ScaleCols(hidden);
    return swizzled ? AlignUp(rows, 128) * AlignUp(cols, 4) : rows * cols * scale_bytes;
  }
};

constexpr QuantWire WireOf(QuantFormat f) {
  return f == QuantFormat::kFp8Block ? QuantWire{128, 4, 1}
         : f == QuantFormat::kMxfp8  ? QuantWire{32, 1, 1}
                                     : QuantWire{16, 1, 2};
}

// How combine moves the partials: pulled by each token's owner after every rank published them, or pushed by the
// rank that computed them into their owners' workspaces (combine_push.cuh; needs a landing row per token after the
// partials, see PushCombineRowBytes, and no two ranks on one GPU). The caller names it; sizes never imply it.
enum class CombineMode : int32_t { kPull = 0, kPush = 1 };

// One partial row over the FP8 wire of combine: hidden E4M3 bytes, then an fp32 scale per 128 elements, padded to
// 16 bytes (the stride of a pushed combine's landing rows).
constexpr int64_t Fp8WireRowBytes(int64_t hidden) { return AlignUp(hidden + 4 * ((hidden + 127) / 128), 16); }

// Combine bytes per token a pushed combine needs: the partial row, then its landing row (the partial as it is, or
// over the FP8 wire its values and scales).
constexpr int64_t PushCombineRowBytes(int64_t row_bytes, int64_t hidden, bool fp8_wire) {
  return row_bytes + (fp8_wire ? Fp8WireRowBytes(hidden) : row_bytes);
}

// Byte offset of scale (row, col) within a source block in the 128x4-tile layout (tiles_per_row = cols / 4,
// rounded up): tile (row / 128, col / 4) is 512 contiguous bytes, holding (row, col) at (row % 32) * 16 +
// (row % 128 / 32) * 4 + col % 4.
constexpr int64_t SwizzledScaleOffset(int64_t row, int64_t col, int64_t tiles_per_row) {
  return ((row / 128) * tiles_per_row + col / 4) * 512 + (row % 32) * 16 + (row % 128 / 32) * 4 + col % 4;
}

}  // namespace flashinfer_a2a
