"""The device spin-waits count time with WaitClock (include/flashinfer_a2a/wait_clock.cuh): a step of the global timer,
backwards or far forwards, must never read as a timeout, while real waiting (polls microseconds apart, or milliseconds
when the GPU time-slices between processes) adds up to the timeout as before. The header is plain C++: this test
compiles it into a host program and replays timer readings through it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

INCLUDE = Path(__file__).resolve().parents[1] / "include"
PROGRAM = r"""
#include <cstdio>
#include "flashinfer_a2a/wait_clock.cuh"
// stdin: timeout_ns start_ns, then readings; stdout: per reading "waited expired"
int main() {
  unsigned long long timeout, start, now;
  if (scanf("%llu %llu", &timeout, &start) != 2) return 2;
  flashinfer_a2a::WaitClock clock(start);
  while (scanf("%llu", &now) == 1) {
    const bool expired = clock.Expired(now, timeout);
    printf("%llu %d\n", static_cast<unsigned long long>(clock.waited), expired ? 1 : 0);
  }
  return 0;
}
"""
MS, S = 1_000_000, 1_000_000_000
START = 1_764_000_000 * S  # a global timer reading: nanoseconds since the epoch


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("needs a C++ compiler")
    folder = tmp_path_factory.mktemp("wait_clock")
    (folder / "main.cpp").write_text(PROGRAM)
    binary = folder / "wait_clock"
    subprocess.run([compiler, "-std=c++17", "-O2", f"-I{INCLUDE}", "-o", str(binary), str(folder / "main.cpp")],
                   check=True)

    def run(timeout_ns: int, readings: list[int]) -> list[tuple[int, bool]]:
        text = " ".join(str(v) for v in [timeout_ns, START, *readings])
        out = subprocess.run([str(binary)], input=text, capture_output=True, text=True, check=True).stdout
        return [(int(w), e == "1") for w, e in (line.split() for line in out.splitlines())]

    return run


def test_steady_polls_expire_just_after_the_timeout(replay):
    readings = [START + 1000 * i for i in range(1, 2003)]  # a poll every microsecond
    got = replay(2 * MS, readings)
    assert [w for w, _ in got] == [1000 * i for i in range(1, 2003)]
    assert [e for _, e in got] == [False] * 2000 + [True] * 2  # expired once more than 2 ms was counted


def test_time_slice_gaps_count_in_full(replay):
    readings = [START + 2_400_000 * i for i in range(1, 6)]  # descheduled 2.4 ms between polls
    got = replay(10 * MS, readings)
    assert [w for w, _ in got] == [2_400_000 * i for i in range(1, 6)]
    assert [e for _, e in got] == [False, False, False, False, True]


def test_a_step_backwards_counts_as_nothing(replay):
    # 1 us, then the timer steps back 5 s (an unsigned difference would read as 584 years), then 1 us polls again
    readings = [START + 1000, START + 1000 - 5 * S, START + 2000 - 5 * S, START + 3000 - 5 * S]
    assert replay(10 * S, readings) == [(1000, False), (1000, False), (2000, False), (3000, False)]


def test_a_step_forwards_counts_as_at_most_100_ms(replay):
    readings = [START + 1000, START + 1000 + 20 * S, START + 2000 + 20 * S]  # the timer jumps 20 s ahead
    got = replay(10 * S, readings)
    assert got == [(1000, False), (1000 + 100 * MS, False), (2000 + 100 * MS, False)]
