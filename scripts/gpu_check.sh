#!/usr/bin/env bash
# One GPU session's checks (docs/gpu.md): install what the GPU machine lacks, run
# `pdserve bench gpu`, then the CUDA tests (PDSERVE_TEST_DEVICE=cuda). Wheels of the Python
# packages missing there are installed from .whl/ when present (docs/gpu.md says which).
# Logs and results go to $OUT (default ./gpu-out).
#   BENCH_S=360 TEST_S=240 BENCH_ARGS="--parts ..." scripts/gpu_check.sh [TEST PATH...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "${BENCH_S:-360}" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout "${BENCH_S:-360}" python3 -m pdserve.bench.gpu --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log"
fi
if [ $# -gt 0 ]; then
    # -v names each result as it lands (pytest-xdist prints its summary only at the end, and a
    # run cut by the timeout loses it); junit.xml holds every failure's traceback.
    PDSERVE_TEST_DEVICE=cuda timeout "${TEST_S:-240}" python3 -m pytest -v -p no:cacheprovider \
        -p no:benchmark --timeout 120 --junitxml "$OUT/junit.xml" "$@" > "$OUT/tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -40
fi
