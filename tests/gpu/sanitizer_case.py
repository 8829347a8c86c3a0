"""Simulated configurations (ep 4, 64 tokens/rank; the one-kernel combine on ep 2) for compute-sanitizer:
``compute-sanitizer --tool memcheck python -m tests.gpu.sanitizer_case`` (likewise racecheck)."""

from .cases import Case, run_case

if __name__ == "__main__":
    run_case(Case(4, 8, 2048, 32, [64, 64, 64, 64], 64, zero_copy=False), timeout_s=60.0)
    run_case(Case(4, 8, 2048, 32, [64, 0, 17, 64], 64, zero_copy=True, caller_out=True), timeout_s=60.0)
    # The one-kernel combine: 2 ranks x 8 tokens, few blocks, so simulated ranks cannot starve each other.
    run_case(Case(2, 8, 2048, 32, [8, 5], 8, zero_copy=True, one_gpu_per_rank=True), timeout_s=60.0)
    print("sanitizer case done")
