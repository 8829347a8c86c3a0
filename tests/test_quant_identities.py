"""The shortcuts of include/flashinfer_a2a/quant.cuh are exact: tests/quant_identities.c checks the FP8 block
quotient (reciprocal and one correction) for every bf16 and fp16 input pair and 10^8 random fp32 pairs, the FP8 block
scale taken the same way and the MXFP8 exponent from bits for every non-negative fp32 block maximum, and Hopper's
E2M1 rounding for all 2^32 fp32 inputs, against the reference's definitions. The six checks run as parallel processes
(about a minute and a half on two cores); tests/gpu/test_quant_conversions.py runs the device code itself."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SOURCE = Path(__file__).with_name("quant_identities.c")

# check -> cases it must report (the exhaustive ones are exact counts; the random one draws 10^8 and keeps most)
CHECKS = {
    "fp8_bf16": 1065402240,  # finite bf16 amax >= 0, every bf16 x with |x| <= amax
    "fp8_fp16": 1007713280,
    "fp8_fp32": 90_000_000,
    "fp8_scale": 0x7F800001,  # every amax from +0 to inf
    "mx_exponent": 0x7F800002,  # every amax from +0 to inf, and a NaN
    "e2m1": 1 << 32,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[int, str]]:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    binary = tmp_path_factory.mktemp("quant_identities") / "quant_identities"
    subprocess.run([compiler, "-O2", "-ffp-contract=off", "-std=c11", "-o", str(binary), str(SOURCE), "-lm"],
                   check=True)
    procs = {name: subprocess.Popen([str(binary), name], stdout=subprocess.PIPE, text=True) for name in CHECKS}
    return {name: (proc.wait(), proc.stdout.read()) for name, proc in procs.items()}


@pytest.mark.parametrize("check", list(CHECKS))
def test_shortcut_equals_the_reference(results, check):
    returncode, output = results[check]
    match = re.fullmatch(rf"{check}: (\d+) cases, (\d+) differ\n", output)
    assert match, output
    cases, differ = int(match[1]), int(match[2])
    assert differ == 0 and returncode == 0, output
    if check == "fp8_fp32":
        assert cases >= CHECKS[check], output
    else:
        assert cases == CHECKS[check], output
