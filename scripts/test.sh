#!/usr/bin/env bash
# Run the pdserve test suite: create or reuse a venv, install what is missing, run pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/common -k scheduler).
set -euo pipefail
cd "$(dirname "$0")/.."
# Two pytest-xdist workers by default, each running whole modules, the slow folders first
# (tests/conftest.py): the suite in one process keeps about one of two cores busy
# (docs/testing.md). PDSERVE_TEST_WORKERS=N for N workers, 1 for one pytest process.
workers="${PDSERVE_TEST_WORKERS:-2}"
case "$workers" in
  '' | *[!0-9]* | 0*)
    echo "PDSERVE_TEST_WORKERS must be a number of workers, 1 or more (1: no xdist), not '$workers'" >&2
    exit 2
    ;;
esac
if [ "$workers" -gt 1 ]; then
  set -- -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"
fi
source scripts/_env.sh
pdserve_env test
# Build the C++ kernels (kernels/cpu_quant.py's GGUF GEMV/GEMM, kernels/cpu_attention.py's
# decode attention and K/V store, kernels/cpu_fused.py's bf16 elementwise ops) once before the
# nodes the tests start need them: a cold build takes minutes, longer than a node's readiness
# wait; each is cached by its source's hash.
python -c "from pdserve.kernels import cpu_attention, cpu_fused, cpu_quant
cpu_quant.available(); cpu_attention.available(); cpu_fused.available()"
# -m would put the repository root first on sys.path, ahead of site-packages: its top-level
# folders (kernels/, ...) would shadow distributions' packages of the same name (Python >= 3.11;
# tests/conftest.py sets the same for every child, tests/test_kernels_name.py checks it).
export PYTHONSAFEPATH=1
exec python -m pytest "$@"
