// Host-only check of the plain dispatch's launch (DispatchLaunchShapeFor and PlanDispatchCopies in dispatch.cuh) over
// many shapes: narrower launches only where tokens fan out wide on the whole GPU, never more blocks than the SM
// budget allows, a block per token below 2 * kWideFanOutMinBlocks tokens, blocks of 2 tokens or more and at least
// kWideFanOutMinBlocks of them from there; and every row cut into pieces that cover it exactly. Run by
// tests/test_dispatch_shape.py; prints "<cases> cases, <violations> violations" and the first few violations.
#include <cstdint>
#include <cstdio>

#include "flashinfer_a2a/dispatch.cuh"

namespace {

namespace fa = flashinfer_a2a;

int violations = 0;

void Violation(const char* what, int format, int grid_sms, int device_sms, int tokens, bool wide,
               const fa::DispatchLaunchShape& s) {
  if (++violations <= 5) {
    std::printf("%s: format=%d grid_sms=%d device_sms=%d tokens=%d wide_fan_out=%d -> max_blocks=%d "
                "piece_vectors=%d\n",
                what, format, grid_sms, device_sms, tokens, wide, s.max_blocks, s.piece_vectors);
  }
}

void CheckShape(fa::QuantFormat f, int grid_sms, int device_sms, int tokens, bool wide) {
  const fa::DispatchLaunchShape s = fa::DispatchLaunchShapeFor(f, grid_sms, device_sms, tokens, wide);
  auto violation = [&](const char* what) {
    Violation(what, static_cast<int>(f), grid_sms, device_sms, tokens, wide, s);
  };
  const int most = fa::DispatchMaxBlocks(f, grid_sms);
  const bool narrow = wide && f == fa::QuantFormat::kNone && grid_sms == device_sms;
  if (!narrow) {
    if (s.max_blocks != most || s.piece_vectors != fa::kDispatchPieceVectors) violation("changed a full launch");
    return;
  }
  if (s.piece_vectors != fa::kWideFanOutPieceVectors) violation("full pieces in a narrow launch");
  if (s.max_blocks < 1 || s.max_blocks > most) violation("blocks out of range");
  const int blocks = fa::DispatchGridSize(tokens, s.max_blocks);
  const int chunk = fa::DispatchChunk(tokens, s.max_blocks);
  if (tokens < 2 * fa::kWideFanOutMinBlocks) {
    // (no tokens: one block, which still publishes and waits)
    if (blocks != std::max(1, std::min(tokens, most))) violation("not a block per token below the threshold");
  } else if (chunk < 2 || blocks < fa::kWideFanOutMinBlocks) {
    violation("not blocks of 2 tokens from the threshold");
  }
}

// The pieces of a row of `row` bytes at `address`: they cover the row, and the last one starts inside it.
void CheckPieces(int64_t row, uintptr_t address, int piece_vectors, int tokens, int max_blocks) {
  fa::DispatchParams p{};
  p.num_payloads = 1;
  p.payload[0] = reinterpret_cast<const uint8_t*>(address);
  p.row_bytes[0] = row;
  p.piece_vectors = piece_vectors;
  fa::PlanDispatchCopies(p, tokens, max_blocks, 0);
  if (p.num_small == 1) {  // a row under one warp store, copied with other tokens' rows
    if (row >= 32 * p.vec_bytes[0] && ++violations <= 5) std::printf("row=%lld grouped as small\n", (long long)row);
    return;
  }
  const int64_t piece = p.PieceBytes(p.vec_bytes[0]);
  const int64_t expected_vectors = p.vec_bytes[0] == 16 ? piece_vectors : fa::kDispatchPieceVectors;
  if (piece != 32 * expected_vectors * p.vec_bytes[0] || p.pieces[0] * piece < row ||
      (p.pieces[0] - 1) * piece >= row || p.pieces_per_token != p.pieces[0]) {
    if (++violations <= 5) {
      std::printf("row=%lld address=%llu piece_vectors=%d -> vec=%d pieces=%d of %lld bytes\n", (long long)row,
                  (unsigned long long)address, piece_vectors, p.vec_bytes[0], p.pieces[0], (long long)piece);
    }
  }
}

}  // namespace

int main() {
  long long cases = 0;
  const fa::QuantFormat formats[] = {fa::QuantFormat::kNone, fa::QuantFormat::kFp8Block, fa::QuantFormat::kNvfp4};
  const int device_sms_list[] = {78, 132, 148};
  for (fa::QuantFormat f : formats) {
    for (int device_sms : device_sms_list) {
      // Budgets of 1 to 8 SMs, then every 13th, then the last few up to the whole GPU.
      for (int grid_sms = 1; grid_sms <= device_sms;
           grid_sms += (grid_sms < 8 || grid_sms + 13 > device_sms) ? 1 : 13) {
        for (int tokens = 0; tokens <= 20000; tokens += (tokens < 300 ? 1 : 97)) {
          for (int wide = 0; wide < 2; ++wide) {
            CheckShape(f, grid_sms, device_sms, tokens, wide != 0);
            ++cases;
          }
        }
      }
    }
  }
  for (int64_t row = 1; row <= 20000; row += (row < 600 ? 1 : 29)) {
    for (uintptr_t address : {uintptr_t{1} << 20, (uintptr_t{1} << 20) + 4, (uintptr_t{1} << 20) + 1}) {
      for (int piece_vectors : {fa::kWideFanOutPieceVectors, fa::kDispatchPieceVectors}) {
        for (int tokens : {1, 64, 4096}) {
          CheckPieces(row, address, piece_vectors, tokens, 132);
          ++cases;
        }
      }
    }
  }
  std::printf("%lld cases, %d violations\n", cases, violations);
  return violations == 0 ? 0 : 1;
}
