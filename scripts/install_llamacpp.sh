#!/usr/bin/env bash
# llama-cpp-python's OpenAI server, for `pdserve bench compare --systems ...,llamacpp`, built
# from source with SIMD flags read from this CPU. Usage:
#   bash scripts/install_llamacpp.sh [PYTHON]   (default: .venv/bin/python, pdserve's venv:
#                                                the benchmark starts `PYTHON -m llama_cpp.server`)
# Not GGML_NATIVE: a build on one host may run on another. AVX512 only where /proc/cpuinfo has
# avx512f (without it those kernels are illegal instructions, e.g. on AVX2-only EPYCs); AMX
# always off: its kernels crashed at the first decode. Takes minutes of compiling; not in CI.
set -euo pipefail

PY="${1:-.venv/bin/python}"
VERSION="${LLAMACPP_VERSION:-0.3.36}"
FLAGS="$(grep -m1 '^flags' /proc/cpuinfo || true)"

# on when this CPU has the instruction set, off otherwise
has() { [[ " $FLAGS " == *" $1 "* ]] && echo ON || echo OFF; }

ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_FMA=$(has fma)"
ARGS+=" -DGGML_F16C=$(has f16c) -DGGML_AVX512=$(has avx512f)"
if [ "$(has avx512f)" = ON ]; then
  ARGS+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
else
  ARGS+=" -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
fi
ARGS+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"

echo "CMAKE_ARGS=$ARGS"
export PIP_DISABLE_PIP_VERSION_CHECK=1
CMAKE_ARGS="$ARGS" "$PY" -m pip install --no-binary llama-cpp-python --no-cache-dir \
  "llama-cpp-python[server]==${VERSION}"
"$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
