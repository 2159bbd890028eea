#!/usr/bin/env bash
# One-command demo: install what is missing, build a tiny model, start router + 1 prefill +
# 1 decode node, stream a few requests, shut down. Arguments go to `pdserve demo`
# (--model DIR for a real checkpoint, --kv-connector zmq|nccl|shm, --max-tokens N).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_env.sh
pdserve_env test
exec pdserve demo "$@"
