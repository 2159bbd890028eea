#!/usr/bin/env bash
# Run the pdserve test suite: create or reuse a venv, install what is missing, run pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/common -k scheduler).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env test
# PDSERVE_TEST_WORKERS=2: that many pytest-xdist workers, each running whole modules, the slow
# folders first (tests/conftest.py); pytest-xdist comes with the test extra (pyproject.toml).
if [ -n "${PDSERVE_TEST_WORKERS:-}" ]; then
  set -- -n "$PDSERVE_TEST_WORKERS" --dist loadgroup --no-loadscope-reorder "$@"
fi
# Build the AVX2 GGUF kernel (kernels/cpu_quant.py) once before the nodes the tests start need
# it: a cold build takes minutes, longer than a node's readiness wait; cached by its source hash.
python -c "from pdserve.kernels import cpu_quant; cpu_quant.available()"
exec python -m pytest "$@"
