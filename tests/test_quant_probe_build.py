"""The device conversions of the quantized wire formats (include/flashinfer_a2a/quant.cuh, CUTLASS numeric types)
compile for sm_90a and sm_100a; tests/gpu/test_quant_conversions.py runs them against the reference."""

import pytest

from .gpu.quant_probe import probe_spec
from .jit.jit_testing import set_jit_env


def test_quant_conversions_compile_for_hopper_and_blackwell(tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        set_jit_env(mp, {"FLASHINFER_A2A_CUDA_ARCH_LIST": "9.0a 10.0a",
                         "FLASHINFER_A2A_CACHE_DIR": str(tmp_path / "cache"),
                         "FLASHINFER_A2A_AOT_DIR": str(tmp_path / "no_aot")})
        spec = probe_spec()
        assert spec.build()
        assert spec.jit_library_path.is_file()
