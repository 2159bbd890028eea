#!/usr/bin/env bash
# Router + N prefill + M decode nodes on this host, in the foreground; Ctrl-C stops them all.
# scripts/launch_local.sh --model DIR --num-prefill N --num-decode M [--port 8000]
#                         [--kv-connector zmq|nccl|shm] [engine flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env
exec pdserve serve "$@"
