// Host-only check of the one-kernel combines' grids (FusedCombineFor, FusedFp8CombineFor in combine.cuh) over many
// shapes: whenever a rule picks one kernel, the grid is safe and covers the pull; whenever it declines, no safe grid
// could have. Run by tests/test_combine_grid.py; prints "<cases> cases, <violations> violations" and the first few
// violations.
#include <algorithm>
#include <cstdio>
#include <string>

#include "flashinfer_a2a/combine.cuh"

namespace {

using flashinfer_a2a::FusedCombineFor;
using flashinfer_a2a::FusedFp8CombineFor;
using flashinfer_a2a::FusedCombineShape;

int violations = 0;

void Violation(const char* what, long long warps, int num_sms, int device_sms, int ep, bool own_gpu, bool wide,
               const FusedCombineShape& s) {
  if (++violations <= 5) {
    std::printf("%s: warps=%lld num_sms=%d device_sms=%d ep_size=%d one_gpu_per_rank=%d wide_fan_out=%d -> "
                "blocks=%d threads=%d\n",
                what, warps, num_sms, device_sms, ep, own_gpu, wide, s.blocks, s.threads);
  }
}

// What the rule promises, stated without its arithmetic: the most blocks that may wait at once, and the items one
// warp may pull in turn.
long long MaxBlocks(int num_sms, int device_sms, int ep, bool own_gpu) {
  if (own_gpu) return num_sms;
  long long blocks = 0;  // the largest count whose blocks on every rank leave a multiprocessor free
  while (blocks + 1 <= num_sms && (blocks + 1) * ep < device_sms) ++blocks;
  return blocks;
}

// What a rule promises for one shape: at most max_blocks blocks of min_warps to max_warps warps, each warp pulling at
// most items_per_warp items. Judge checks a grid against it: the grid is safe and covers the pull, and a rule
// declines only where no such grid exists.
struct Promise {
  long long max_blocks, items_per_warp, min_warps, max_warps;
};
template <typename Violation>
void Judge(const FusedCombineShape& s, long long items, const Promise& w, Violation violation) {
  const bool possible = w.max_blocks >= 1 && items <= w.max_blocks * w.max_warps * w.items_per_warp;
  if (s.blocks == 0) {
    if (possible) violation("declined although a safe grid exists");
    return;
  }
  if (!possible) violation("one kernel although no safe grid exists");
  if (s.blocks < 1 || s.blocks > w.max_blocks) violation("blocks out of range");
  if (s.threads % 32 != 0 || s.threads < w.min_warps * 32 || s.threads > w.max_warps * 32) {
    violation("threads out of range");
  }
  const long long grid_warps = static_cast<long long>(s.blocks) * (s.threads / 32);
  if ((items + grid_warps - 1) / grid_warps > w.items_per_warp) violation("a warp pulls too many items");
  if (static_cast<long long>(s.blocks - 1) * (s.threads / 32) >= items) violation("a block without items");
}

// With a GPU per rank on the whole GPU the blocks have exactly 4 warps where tokens fan out wide and 8 where not,
// twice that where those would leave a warp more than 8 items, each pulling up to kOwnGpuFusedItems items; under an
// SM budget 8 to 32 warps, an item each; where ranks share a GPU 8 to 32 warps, up to kSharedGpuFusedItems items
// each.
void Check(long long warps, int num_sms, int device_sms, int ep, bool own_gpu, bool wide) {
  const FusedCombineShape s = FusedCombineFor(warps, num_sms, device_sms, ep, own_gpu, wide);
  const bool whole = own_gpu && num_sms == device_sms;
  const long long narrow = wide ? 4 : 8, deep = warps > static_cast<long long>(num_sms) * narrow * 8;
  const long long min_warps = whole ? (deep ? 2 * narrow : narrow) : flashinfer_a2a::kCombineWarps;
  const Promise promise{MaxBlocks(num_sms, device_sms, ep, own_gpu),
                        whole ? flashinfer_a2a::kOwnGpuFusedItems : own_gpu ? 1 : flashinfer_a2a::kSharedGpuFusedItems,
                        min_warps, whole ? min_warps : flashinfer_a2a::kFusedCombineMaxThreads / 32};
  Judge(s, warps, promise,
        [&](const char* what) { Violation(what, warps, num_sms, device_sms, ep, own_gpu, wide, s); });
}

// Over the FP8 wire blocks have kCombineWarps to kFusedFp8MaxWarps warps (every one quantizes, then pulls) and a
// warp pulls one item, wherever the ranks run; at most as many blocks as above, since they wait too.
void CheckFp8(long long items, int num_sms, int device_sms, int ep, bool own_gpu) {
  const FusedCombineShape s = FusedFp8CombineFor(items, num_sms, device_sms, ep, own_gpu);
  const Promise promise{MaxBlocks(num_sms, device_sms, ep, own_gpu), 1, flashinfer_a2a::kCombineWarps,
                        flashinfer_a2a::kFusedFp8MaxWarps};
  Judge(s, items, promise, [&](const char* what) {
    Violation((std::string("fp8: ") + what).c_str(), items, num_sms, device_sms, ep, own_gpu, false, s);
  });
}

}  // namespace

int main() {
  long long cases = 0;
  const int device_sms_list[] = {78, 114, 132, 148};
  const int ep_list[] = {1, 2, 3, 4, 5, 8, 16, 32, 72, 200};
  for (int device_sms : device_sms_list) {
    // Budgets from 1 up, then the whole GPU.
    for (int num_sms = 1; num_sms <= device_sms; num_sms = num_sms == device_sms ? device_sms + 1
                                                           : std::min(device_sms, num_sms + (num_sms < 8 ? 1 : 7))) {
      for (int ep : ep_list) {
        for (int own_gpu = 0; own_gpu < 2; ++own_gpu) {
          for (int wide = 0; wide <= own_gpu; ++wide) {  // the fan-out only shapes a GPU per rank's grid
            for (long long warps = 1; warps <= 40000; warps += (warps < 600 ? 1 : 37)) {
              Check(warps, num_sms, device_sms, ep, own_gpu != 0, wide != 0);
              ++cases;
              if (!wide) {
                CheckFp8(warps, num_sms, device_sms, ep, own_gpu != 0);
                ++cases;
              }
            }
          }
        }
      }
    }
  }
  std::printf("%lld cases, %d violations\n", cases, violations);
  return violations == 0 ? 0 : 1;
}
