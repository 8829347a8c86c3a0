// Fused quantization in dispatch: the first payload (bf16|fp16 hidden states) is quantized while it is sent.
//
// A warp takes a piece of 1024 elements of one token: each lane loads 8 consecutive elements per round, 4 rounds.
// Every scale block (128, 32 or 16 elements) is a whole group of 16, 4 or 2 lanes of one round, so its maximum
// takes a few shuffles. The piece's scales are then gathered into a few lanes (small scattered stores would cost
// an NVLink transaction each). The piece is loaded and quantized once and its values and scales are stored to
// every target rank, like a plain payload piece. quant.cuh holds the conversions.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "float_convert.cuh"
#include "protocol.cuh"
#include "quant.cuh"

namespace flashinfer_a2a {

constexpr int kQuantLaneElems = 8;
constexpr int kQuantRounds = 4;
constexpr int kQuantPieceElems = 32 * kQuantLaneElems * kQuantRounds;

struct DispatchQuant {
  QuantFormat format;
  bool fp16;        // fp16 input, else bf16
  bool vectorized;  // hidden % 8 == 0 and a 16-byte aligned input: whole 8-element loads and stores
  bool swizzled;    // scales in the 128x4-tile layout, per source block
  int32_t hidden;
  int32_t scale_cols;
  int64_t value_row_bytes;
  int64_t values_offset;  // receive regions within every rank's workspace
  int64_t scales_offset;
  int64_t scale_block_bytes;  // one source block of scales
  const float* global_scale;  // NVFP4: a device fp32 scalar
};

// One lane's 8 elements, quantized: fp8 bytes (values[0] low four, values[1] high four) or eight E2M1 codes in
// values[0] (element i in bits 4i..4i+3), and its block's scale byte (MXFP8, NVFP4; FP8 block scales are gathered
// straight from the lanes that computed them).
struct LaneQuant {
  uint32_t values[2];
  uint8_t scale_bits;  // UE8M0 or UE4M3
};

// NVFP4: the factor the elements of a block with scale byte sf are multiplied by, Nvfp4Inverse(sf, global_scale), for
// every byte, filled once per thread block: each lane looks its block's up instead of dividing (and decoding sf).
constexpr int kNvfp4Inverses = 256;
__device__ __forceinline__ void FillNvfp4Inverses(const DispatchQuant& q, float* table) {
  const float global_scale = *q.global_scale;
  for (int sf = threadIdx.x; sf < kNvfp4Inverses; sf += blockDim.x) {
    table[sf] = quant::Nvfp4Inverse(static_cast<uint8_t>(sf), global_scale);
  }
}

// One lane's eight 16-bit values (bf16|fp16, T), as fp32.
template <typename T>
__device__ __forceinline__ void UnpackLaneElems(const uint4& raw, float (&x)[kQuantLaneElems]) {
  const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kQuantLaneElems; ++i) x[i] = FloatConvert<T>::ToFloat(h[i]);
}

// The largest magnitude of one lane's elements, as fmaxf(0, |x_0|, ..., |x_7|) gives it (a packed maximum returns
// the other operand for a NaN; a pair of NaNs leaves NaN, which the last maximum with 0 drops).
template <typename T>
__device__ __forceinline__ float LaneAbsMax(const uint4& raw) {
  using Convert = FloatConvert<T>;
  typename Convert::Pair p[kQuantLaneElems / 2];
  memcpy(p, &raw, sizeof(p));
  const auto m = __hmax2(__hmax2(__habs2(p[0]), __habs2(p[1])), __hmax2(__habs2(p[2]), __habs2(p[3])));
  return fmaxf(fmaxf(0.0f, Convert::Low(m)), Convert::High(m));
}

// The magnitudes of one lane's elements, still packed, a NaN as 0 (a packed maximum of |x| and 0).
template <typename T>
__device__ __forceinline__ uint4 PackedMagnitudes(const uint4& raw) {
  using Convert = FloatConvert<T>;
  typename Convert::Pair pairs[kQuantLaneElems / 2];
  memcpy(pairs, &raw, sizeof(pairs));
#pragma unroll
  for (int k = 0; k < kQuantLaneElems / 2; ++k) pairs[k] = __hmax2(__habs2(pairs[k]), Convert::ZeroPair());
  uint4 magnitudes;
  memcpy(&magnitudes, pairs, sizeof(pairs));
  return magnitudes;
}

// Scale columns of one piece: 8 fp32 FP8 block scales, 32 UE8M0 or 64 UE4M3 bytes.
template <QuantFormat F>
constexpr int kPieceScales = kQuantPieceElems / WireOf(F).block;

// A piece's scale bytes (MXFP8, NVFP4) gathered into the low lanes, so they leave in a few wide stores instead of one
// store per block: lane j gets the bytes of columns 4j..4j+3. (FP8 block scales: lane j < 8 gets column j's fp32
// scale, from QuantizeRounds.)
template <QuantFormat F>
__device__ __forceinline__ uint32_t GatherPieceScales(const LaneQuant (&lq)[kQuantRounds], int lane) {
  static_assert(F == QuantFormat::kMxfp8 || F == QuantFormat::kNvfp4, "FP8 block scales: QuantizeRounds");
  constexpr int kGroup = WireOf(F).block / kQuantLaneElems;  // block b of a round is quantized by lanes b * kGroup..
  constexpr int kBlocksPerRound = 32 / kGroup;
  // Each lane packs its blocks' bytes of the four rounds into one word (round u in byte u). Lane j's columns
  // 4j..4j+3 all lie in one round (a round has a multiple of 4 blocks), so four shuffles of that word and three byte
  // selects gather them (a shuffle per round and column before: 16).
  static_assert(kQuantRounds == 4 && kBlocksPerRound % 4 == 0, "one round's byte per shuffled word");
  uint32_t rounds = 0;
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) rounds |= uint32_t{lq[u].scale_bits} << (8 * u);
  uint32_t v[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = __shfl_sync(0xffffffffu, rounds, ((4 * lane + k) % kBlocksPerRound) * kGroup);
  const uint32_t u = (4 * lane / kBlocksPerRound) % 4;  // (lanes past the piece's columns: any round, unused)
  const uint32_t pick = u | (u + 4) << 4;                 // byte u of the first word, then byte u of the second
  return __byte_perm(__byte_perm(v[0], v[1], pick), __byte_perm(v[2], v[3], pick), 0x5410);
}

// One butterfly step that serves two rounds: each lane of the pair (lane, lane ^ mask) keeps one of `first` and
// `second` (the second where keep_second) and sends its partner the other, so one shuffle gives each lane the
// larger of its own and its partner's value of the round it keeps.
__device__ __forceinline__ float KeptMax(bool keep_second, float first, float second, int mask) {
  return fmaxf(keep_second ? second : first, __shfl_xor_sync(0xffffffffu, keep_second ? first : second, mask));
}

// The block maxima of all four rounds over a group of kGroup lanes (4 or more) that hold one scale block of each
// round, transposed: lane returns the whole maximum of round (lane % kGroup) / (kGroup / 4) of its group. The first
// two butterfly steps send half the rounds each (the ones the partner keeps), so a group reduces four values in
// log2(kGroup) + 1 shuffles instead of 4 * log2(kGroup), and the scale is then computed once per lane, not once per
// round.
template <int kGroup>
__device__ __forceinline__ float TransposedRoundMax(const float (&m)[kQuantRounds], int lane) {
  static_assert(kQuantRounds == 4 && kGroup >= 4 && (kGroup & (kGroup - 1)) == 0, "four rounds over 4+ lanes");
  const bool upper = lane & (kGroup / 2);  // keeps rounds 2 and 3
  const float keep0 = KeptMax(upper, m[0], m[2], kGroup / 2);
  const float keep1 = KeptMax(upper, m[1], m[3], kGroup / 2);
  float round_max = KeptMax(lane & (kGroup / 4), keep0, keep1, kGroup / 4);  // the odd round of the two, or the even
#pragma unroll
  for (int mask = kGroup / 8; mask >= 1; mask /= 2) {
    round_max = fmaxf(round_max, __shfl_xor_sync(0xffffffffu, round_max, mask));
  }
  return round_max;
}

// The values of all rounds of a lane (FP8 block or MXFP8), from the scale (FP8: and its inverse) or exponent each
// lane of the group computed for one round (QuantizeRounds). kFinite (FP8): every block of the piece has a finite
// scale, so each quotient needs no division fallback.
template <typename T, QuantFormat F, bool kFinite>
__device__ __forceinline__ void QuantizeRoundValues(const uint4 (&raw)[kQuantRounds], int lane, float scale,
                                                    float inverse, int exponent, LaneQuant (&lq)[kQuantRounds]) {
  constexpr int kGroup = WireOf(F).block / kQuantLaneElems;  // lanes per scale block
  const int group = lane & ~(kGroup - 1);
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) {
    const int holder = group + u * (kGroup / 4);  // a lane of the group that computed round u's scale
    float x[kQuantLaneElems];
    UnpackLaneElems<T>(raw[u], x);
    uint2 values;
    if constexpr (F == QuantFormat::kFp8Block) {
      const float s = __shfl_sync(0xffffffffu, scale, holder), inv = __shfl_sync(0xffffffffu, inverse, holder);
      values = kFinite ? quant::Fp8BlockValuesFinite(x, s, inv) : quant::Fp8BlockValues(x, s, inv);
    } else {
      const int e = __shfl_sync(0xffffffffu, exponent, holder);
      lq[u].scale_bits = quant::MxScaleByte(e);
      values = quant::Mxfp8Values(x, e);
    }
    lq[u].values[0] = values.x;
    lq[u].values[1] = values.y;
  }
}

// FP8 block or MXFP8 for all rounds of a lane: the block maxima reduced transposed (TransposedRoundMax), each lane
// computing the scale of one round, which the lanes of the group then read from each other. Returns the piece's
// scales gathered (GatherPieceScales): FP8 lane j < 8 reads column j's scale from the lane that computed it.
// kFiniteSplit (FP8): a piece whose scales are all finite (every piece but one holding an infinity) takes the
// quotients alone, in one stretch of code, instead of testing for the fallback in each round and jumping over its
// divisions. The dispatch, whose warps each quantize a piece or a few, uses it; the combines keep the per-round test
// (with the split there too, the two-kernel FP8-wire combine took 2.1 us more at 1024 tokens, its loop larger). 2
// H100s, slowest rank, two rounds each, before -> after: FP8 dispatch 13.6 -> 13.1 us at 1 token, 17.1 -> 16.5 at 128,
// 47.7 -> 46.6 at 1024, 196.3 -> 194.9 at 8192; fp8-fused pair 16.3 -> 16.0, 22.8 -> 22.3, 85.0 -> 84.0, 433.9 ->
// 431.7; 4 H100s, pair 18.7 -> 18.3 at 1 token, 20.9 -> 20.4 at 16, 27.8 -> 27.3 at 64, 41.7 -> 41.3 at 128.
template <typename T, QuantFormat F, bool kFiniteSplit = false>
__device__ __forceinline__ uint32_t QuantizeRounds(const uint4 (&raw)[kQuantRounds], int lane,
                                                   LaneQuant (&lq)[kQuantRounds]) {
  static_assert(F == QuantFormat::kFp8Block || F == QuantFormat::kMxfp8, "NVFP4: QuantizeNvfp4Rounds");
  constexpr int kGroup = WireOf(F).block / kQuantLaneElems;  // lanes per scale block
  float amax[kQuantRounds];
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) amax[u] = LaneAbsMax<T>(raw[u]);
  const float round_max = TransposedRoundMax<kGroup>(amax, lane);
  float scale = 0.0f, inverse = 0.0f;
  int exponent = 0;
  if constexpr (F == QuantFormat::kFp8Block) {
    scale = quant::Fp8BlockScale(round_max);
    inverse = __frcp_rn(scale);
  } else {
    exponent = quant::MxExponent(round_max);
  }
  constexpr bool kSplit = kFiniteSplit && F == QuantFormat::kFp8Block;
  if (kSplit && __all_sync(0xffffffffu, inverse != 0.0f)) {
    QuantizeRoundValues<T, F, true>(raw, lane, scale, inverse, exponent, lq);
  } else {
    QuantizeRoundValues<T, F, false>(raw, lane, scale, inverse, exponent, lq);
  }
  if constexpr (F == QuantFormat::kFp8Block) {
    constexpr int kBlocksPerRound = 32 / kGroup;  // column j: round j / kBlocksPerRound, block j % kBlocksPerRound
    const int holder = (lane % kBlocksPerRound) * kGroup + (lane / kBlocksPerRound) % kQuantRounds * (kGroup / 4);
    return __float_as_uint(__shfl_sync(0xffffffffu, scale, holder));
  } else {
    return GatherPieceScales<F>(lq, lane);
  }
}

// NVFP4 for all rounds of a lane. A block (16 elements) is held by a pair of lanes, so both would compute its scale;
// instead, for each two rounds the even lane computes the first round's scale and the odd lane the second's, and
// they swap (one scale computation where there were two: it divides). The codes are rounded from the magnitudes
// and take the inputs' sign bits (quant::Nvfp4Codes). Returns the piece's scale bytes gathered (GatherPieceScales).
template <typename T>
__device__ __forceinline__ uint32_t QuantizeNvfp4Rounds(const uint4 (&raw)[kQuantRounds], float global_scale,
                                                        const float* nvfp4_inverse, int lane,
                                                        LaneQuant (&lq)[kQuantRounds]) {
  static_assert(kQuantRounds % 2 == 0 && WireOf(QuantFormat::kNvfp4).block == 2 * kQuantLaneElems, "lane pairs");
  const bool odd = lane & 1;
#pragma unroll
  for (int u = 0; u < kQuantRounds; u += 2) {
    const float amax = KeptMax(odd, LaneAbsMax<T>(raw[u]), LaneAbsMax<T>(raw[u + 1]), 1);
    const uint8_t mine = quant::Nvfp4ScaleBits(amax, global_scale);
    const uint8_t theirs = static_cast<uint8_t>(__shfl_xor_sync(0xffffffffu, mine, 1));
    lq[u].scale_bits = odd ? theirs : mine;
    lq[u + 1].scale_bits = odd ? mine : theirs;
#pragma unroll
    for (int v = 0; v < 2; ++v) {
      float a[kQuantLaneElems];
      UnpackLaneElems<T>(PackedMagnitudes<T>(raw[u + v]), a);
      lq[u + v].values[0] =
          quant::Nvfp4Codes(a, nvfp4_inverse[lq[u + v].scale_bits], quant::E2m1Signs(raw[u + v]));
    }
  }
  return GatherPieceScales<QuantFormat::kNvfp4>(lq, lane);
}

// One lane's 8 elements of a bf16|fp16 row from element e0, as 16 raw bytes (zeros past the row's end).
template <typename T>
__device__ __forceinline__ uint4 LoadLaneElems(const T* row, int64_t e0, int hidden, bool vectorized) {
  if (vectorized && e0 + kQuantLaneElems <= hidden) return *reinterpret_cast<const uint4*>(row + e0);
  uint4 raw = make_uint4(0, 0, 0, 0);
  T* h = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kQuantLaneElems; ++i) {
    if (e0 + i < hidden) h[i] = row[e0 + i];
  }
  return raw;
}

// Stores one lane's values, all eight, at dst (aligned to their size).
template <QuantFormat F>
__device__ __forceinline__ void StoreLaneValues(uint8_t* dst, const LaneQuant& lq) {
  if constexpr (WireOf(F).elements_per_byte == 2) {
    *reinterpret_cast<uint32_t*>(dst) = lq.values[0];
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(lq.values[0], lq.values[1]);
  }
}

// Stores one lane's values at element e0 of a received row (bytes past the row's end are never written).
template <QuantFormat F>
__device__ __forceinline__ void StoreLaneValues(uint8_t* row, int64_t e0, int hidden, bool vectorized,
                                                const LaneQuant& lq) {
  constexpr int kPerByte = WireOf(F).elements_per_byte;
  uint8_t* dst = row + e0 / kPerByte;
  if (vectorized && e0 + kQuantLaneElems <= hidden) {
    StoreLaneValues<F>(dst, lq);
    return;
  }
  const int64_t left = hidden - e0 + kPerByte - 1;  // elements from e0 on, rounded up to whole bytes
  const int bytes = static_cast<int>(left < kQuantLaneElems ? left : kQuantLaneElems) / kPerByte;
#pragma unroll
  for (int i = 0; i < kQuantLaneElems / kPerByte; ++i) {
    if (i < bytes) dst[i] = static_cast<uint8_t>(lq.values[i / 4] >> (8 * (i % 4)));
  }
}

// Stores the gathered scales of a piece whose first column is c0, for row `slot` of source block `src_rank`. In the
// swizzled layout the padding columns (up to a multiple of 4) get zeros: their blocks lie past the row's end, so
// they quantized nothing and their scale bytes are 0.
template <QuantFormat F>
__device__ __forceinline__ void StorePieceScales(const DispatchQuant& q, uint8_t* base, int src_rank, int64_t src_row,
                                                 int64_t slot, int c0, uint32_t word, int lane) {
  uint8_t* scales = base + q.scales_offset;
  if constexpr (F == QuantFormat::kFp8Block) {
    const int col = c0 + lane;
    if (lane < kPieceScales<F> && col < q.scale_cols) {
      reinterpret_cast<uint32_t*>(scales)[src_row * q.scale_cols + col] = word;
    }
    return;
  }
  const int col = c0 + 4 * lane;
  if (lane >= kPieceScales<F> / 4) return;
  if (q.swizzled) {
    const int64_t tiles_per_row = (q.scale_cols + 3) / 4;
    if (col < tiles_per_row * 4) {
      *reinterpret_cast<uint32_t*>(scales + src_rank * q.scale_block_bytes +
                                   SwizzledScaleOffset(slot, col, tiles_per_row)) = word;
    }
    return;
  }
  uint8_t* dst = scales + src_row * q.scale_cols + col;
  if (q.scale_cols % 4 == 0) {  // whole, aligned words
    if (col < q.scale_cols) *reinterpret_cast<uint32_t*>(dst) = word;
    return;
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (col + k < q.scale_cols) dst[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

// Stores piece `piece` of a row, quantized (this lane's values in lq, the gathered scales in `scales`), as row `row`
// of the values and scales regions of q at `base`: a received row of source block `src_rank` at `slot` (the dispatch
// below), or a row of the nccl transport's send buffer (nccl_pack.cuh, unswizzled: src_rank and slot unused).
// kWhole: the piece lies inside a row of whole, aligned lanes (every piece of hidden 7168), so its values go at fixed
// offsets without a test each.
template <QuantFormat F, bool kWhole>
__device__ __forceinline__ void StorePieceRow(const DispatchQuant& q, uint8_t* base, int src_rank, int64_t row,
                                              int64_t slot, int piece, const LaneQuant (&lq)[kQuantRounds],
                                              uint32_t scales, int lane) {
  constexpr int kLaneBytes = kQuantLaneElems / WireOf(F).elements_per_byte;
  uint8_t* values = base + q.values_offset + row * q.value_row_bytes;
  uint8_t* lane_values = values + (piece * (kQuantPieceElems / kQuantLaneElems) + lane) * kLaneBytes;
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) {
    const int e0 = piece * kQuantPieceElems + (u * 32 + lane) * kQuantLaneElems;
    if (kWhole) {
      StoreLaneValues<F>(lane_values + u * 32 * kLaneBytes, lq[u]);
    } else if (e0 < q.hidden) {
      StoreLaneValues<F>(values, e0, q.hidden, q.vectorized, lq[u]);
    }
  }
  StorePieceScales<F>(q, base, src_rank, row, slot, piece * kPieceScales<F>, scales, lane);
}

// StorePieceRow to each of the `num_targets` (rank, slot) entries held by lanes 0..num_targets-1 in `entry`.
template <QuantFormat F, bool kWhole>
__device__ __forceinline__ void StorePiece(const DispatchQuant& q, const Ranks& ranks, int64_t runtime_max, int piece,
                                           const LaneQuant (&lq)[kQuantRounds], uint32_t scales, int32_t entry,
                                           int num_targets, int lane) {
  const int64_t src_block = static_cast<int64_t>(ranks.ep_rank) * runtime_max;
  int j = FirstRouteAfterOwn(entry, num_targets, ranks, lane);
  for (int i = 0; i < num_targets; ++i, j = NextRoute(j, num_targets)) {
    const int32_t e = __shfl_sync(0xffffffffu, entry, j);
    const int64_t slot = RouteSlot(e);
    StorePieceRow<F, kWhole>(q, ranks.Base(RouteRank(e)), ranks.ep_rank, src_block + slot, slot, piece, lq, scales,
                             lane);
  }
}

// What QuantizePiece does between issuing its loads and the first conversion, by default nothing.
struct NothingAfterLoads {
  __device__ __forceinline__ void operator()() const {}
};

// Quantizes piece `piece` of token t (elements of type T) and hands it to store(whole, lq, scales): this lane's values
// in lq, the piece's scales gathered into the low lanes, `whole` a std::bool_constant telling StorePieceRow's kWhole.
// after_loads() runs once the piece's loads are issued, so that a load of its own overlaps theirs. kFiniteSplit: as
// QuantizeRounds's.
template <typename T, QuantFormat F, bool kFiniteSplit, typename Store, typename AfterLoads>
__device__ __forceinline__ void QuantizePiece(const DispatchQuant& q, const uint8_t* payload, int64_t t, int piece,
                                              int lane, const float* nvfp4_inverse, Store store,
                                              AfterLoads after_loads) {
  const T* row = reinterpret_cast<const T*>(payload) + t * q.hidden;
  uint4 raw[kQuantRounds];  // every load in flight before the first conversion
#pragma unroll
  for (int u = 0; u < kQuantRounds; ++u) {
    raw[u] = LoadLaneElems<T>(row, piece * kQuantPieceElems + (u * 32 + lane) * kQuantLaneElems, q.hidden,
                              q.vectorized);
  }
  after_loads();
  LaneQuant lq[kQuantRounds];
  uint32_t scales;  // gathered into the low lanes
  if constexpr (F == QuantFormat::kNvfp4) {
    scales = QuantizeNvfp4Rounds<T>(raw, *q.global_scale, nvfp4_inverse, lane, lq);
  } else {
    scales = QuantizeRounds<T, F, kFiniteSplit>(raw, lane, lq);
  }
  if (q.vectorized && (piece + 1) * kQuantPieceElems <= q.hidden) {
    store(std::true_type{}, lq, scales);
  } else {
    store(std::false_type{}, lq, scales);
  }
}

// QuantizePiece of a bf16|fp16 payload (q.fp16).
template <QuantFormat F, bool kFiniteSplit = false, typename Store, typename AfterLoads = NothingAfterLoads>
__device__ __forceinline__ void QuantizeTokenPiece(const DispatchQuant& q, const uint8_t* payload, int64_t t,
                                                   int piece, int lane, const float* nvfp4_inverse, Store store,
                                                   AfterLoads after_loads = {}) {
  if (q.fp16) {
    QuantizePiece<__half, F, kFiniteSplit>(q, payload, t, piece, lane, nvfp4_inverse, store, after_loads);
  } else {
    QuantizePiece<__nv_bfloat16, F, kFiniteSplit>(q, payload, t, piece, lane, nvfp4_inverse, store, after_loads);
  }
}

// Where a piece goes: lane j holds the j-th (rank, slot) entry of its token's routing record, `count` of them.
struct PieceTargets {
  int32_t entry = -1;
  int count = 0;
};

// Quantizes piece `piece` of token t and stores it to each of the PieceTargets that load_targets() returns, which
// runs once the piece's loads are in flight: the two round trips overlap, as in the plain copy. 2 H100s, pair of the
// slowest rank, routes loaded first -> after the piece's loads (both with the kernels of one block a multiprocessor,
// DispatchKernelOf): FP8 1 token 17.2-17.4 -> 16.8 us, 128 tokens 23.2-23.3 -> 22.8; at 8192 tokens (two blocks a
// multiprocessor) the NVFP4 dispatch 127.0 -> 125.2 us and the FP8 one 195.7 -> 196.6.
template <QuantFormat F, typename LoadTargets>
__device__ __forceinline__ void DispatchQuantizePiece(const DispatchQuant& q, const Ranks& ranks,
                                                      int64_t runtime_max, const uint8_t* payload, int64_t t,
                                                      int piece, int lane, const float* nvfp4_inverse,
                                                      LoadTargets load_targets) {
  PieceTargets to;
  QuantizeTokenPiece<F, /*kFiniteSplit=*/true>(
      q, payload, t, piece, lane, nvfp4_inverse,
      [&](auto whole, const LaneQuant(&lq)[kQuantRounds], uint32_t scales) {
        StorePiece<F, decltype(whole)::value>(q, ranks, runtime_max, piece, lq, scales, to.entry, to.count, lane);
      },
      [&] { to = load_targets(); });
}

}  // namespace flashinfer_a2a
