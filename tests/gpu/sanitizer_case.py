"""One simulated configuration (ep 4, 64 tokens/rank) for compute-sanitizer:
``compute-sanitizer --tool memcheck python -m tests.gpu.sanitizer_case`` (likewise racecheck)."""

from .cases import Case, run_case

if __name__ == "__main__":
    run_case(Case(4, 8, 2048, 32, [64, 64, 64, 64], 64, zero_copy=False), timeout_s=60.0)
    run_case(Case(4, 8, 2048, 32, [64, 0, 17, 64], 64, zero_copy=True, caller_out=True), timeout_s=60.0)
    print("sanitizer case done")
