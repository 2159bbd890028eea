#!/usr/bin/env bash
# Start one pdserve decode on this host; all arguments go to `pdserve decode`.
# Example: scripts/launch_decode.sh --model /models/llama --router ROUTER_HOST:8100 --host THIS_HOST
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env
exec pdserve decode "$@"
