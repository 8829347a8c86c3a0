#!/usr/bin/env bash
# Runs the GPU test suite on a device machine whose image lacks apache-tvm-ffi and nvidia-cutlass: their wheels
# travel in .whl/ (../shared/tools/device_wheels.sh). Usage: bash tests/gpu/run_device.sh [pytest args...]
# Writes logs under $OUT when set.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHINFER_A2A_CACHE_DIR=${FLASHINFER_A2A_CACHE_DIR:-/tmp/fa2a_cache}
out=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())"
python3 - <<'PY' 2>&1 | tee "$out/build.log"
import time
start = time.monotonic()
from flashinfer_a2a.jit import get_a2a_module
get_a2a_module()
print(f"JIT build + load of flashinfer_a2a_ops: {time.monotonic() - start:.1f} s")
PY
python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$out/pytest.log"
# compute-sanitizer on one simulated configuration (ep 4, 64 tokens/rank).
if [ -z "${SKIP_SANITIZER:-}" ]; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool"
    timeout 300 compute-sanitizer --tool "$tool" --print-limit 5 python3 -m tests.gpu.sanitizer_case 2>&1 \
      | grep -v "Host Frame" | tail -8
  done
fi
