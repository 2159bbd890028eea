#!/usr/bin/env bash
# Start one pdserve prefill on this host; all arguments go to `pdserve prefill`.
# Example: scripts/launch_prefill.sh --model /models/llama --router ROUTER_HOST:8100 --host THIS_HOST
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env
exec pdserve prefill "$@"
