#!/usr/bin/env bash
# Run the pdserve test suite: create or reuse a venv, install what is missing, run pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/common -k scheduler).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env test
exec python -m pytest "$@"
