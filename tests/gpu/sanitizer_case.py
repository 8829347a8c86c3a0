"""Simulated configurations (ep 4, 64 tokens/rank; the one-kernel combine on ep 2; the quantizing dispatch and the
FP8-wire combine) for compute-sanitizer:
``compute-sanitizer --tool memcheck python -m tests.gpu.sanitizer_case`` (likewise racecheck)."""

import torch

from .cases import Case, run_case
from .test_quant_dispatch import test_fp8_wire_combine_matches_reference, test_quantizing_dispatch_matches_reference

if __name__ == "__main__":
    run_case(Case(4, 8, 2048, 32, [64, 64, 64, 64], 64, zero_copy=False), timeout_s=60.0)
    run_case(Case(4, 8, 2048, 32, [64, 0, 17, 64], 64, zero_copy=True, caller_out=True), timeout_s=60.0)
    # The one-kernel combine: 2 ranks x 8 tokens, few blocks, so simulated ranks cannot starve each other.
    run_case(Case(2, 8, 2048, 32, [8, 5], 8, zero_copy=True, one_gpu_per_rank=True), timeout_s=60.0)
    for fmt, swizzled in (("fp8_block", False), ("mxfp8", True), ("nvfp4", False)):
        test_quantizing_dispatch_matches_reference(fmt, swizzled, "ep3-odd-fp16")
    test_quantizing_dispatch_matches_reference("nvfp4", True, "ep2-misaligned")
    test_fp8_wire_combine_matches_reference(3, 136, torch.bfloat16, True)
    test_fp8_wire_combine_matches_reference(2, 2880, torch.float16, False)
    print("sanitizer case done")
