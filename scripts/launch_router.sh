#!/usr/bin/env bash
# Start one pdserve router on this host; all arguments go to `pdserve router`.
# Example: scripts/launch_router.sh --model /models/llama --host 0.0.0.0 --port 8000 --control-port 8100
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env
exec pdserve router "$@"
