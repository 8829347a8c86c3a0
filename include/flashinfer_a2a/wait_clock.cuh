// The time a spin-wait has waited, summed from the global timer one poll at a time so that a step of the timer is
// never mistaken for a timeout: a step backwards counts as nothing, one forwards as kMaxTimerStepNs at most. Polls
// come microseconds apart (milliseconds when the GPU time-slices between processes: up to 2.4 ms measured on an
// H200), so honest waits add up as before. Plain C++, so that a host test can replay timer readings through it.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define A2A_HOST_DEVICE __host__ __device__
#else
#define A2A_HOST_DEVICE
#endif

namespace flashinfer_a2a {

constexpr uint64_t kMaxTimerStepNs = 100'000'000;  // 100 ms

struct WaitClock {
  uint64_t last;        // the previous reading
  uint64_t waited = 0;  // ns counted so far

  A2A_HOST_DEVICE explicit WaitClock(uint64_t now) : last(now) {}

  // Counts the time since the previous reading; true once more than timeout_ns has been counted.
  A2A_HOST_DEVICE bool Expired(uint64_t now, uint64_t timeout_ns) {
    const int64_t step = static_cast<int64_t>(now - last);
    last = now;
    if (step > 0) {
      waited += static_cast<uint64_t>(step) < kMaxTimerStepNs ? static_cast<uint64_t>(step) : kMaxTimerStepNs;
    }
    return waited > timeout_ns;
  }
};

}  // namespace flashinfer_a2a
