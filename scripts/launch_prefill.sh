#!/usr/bin/env bash
# Start one pdserve prefill on this host; all arguments go to `python -m prefill_node`.
# Example: scripts/launch_prefill.sh --model /models/llama --router ROUTER_HOST:8100 --host THIS_HOST
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env
exec python -m prefill_node "$@"
