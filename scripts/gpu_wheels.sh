#!/usr/bin/env bash
# Download into .whl/ the Python 3.12 wheels the GPU machine lacks (docs/gpu.md), for the device
# tool to carry; scripts/gpu_check.sh installs them there. nixl-cu13 is repacked without its
# nixl_ep_cu13 extension modules (unused, 94 MB) so the tree stays under the 64 MiB carried.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
platforms=()
for tag in manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_26 manylinux_2_27 \
           manylinux_2_28 manylinux_2_31 manylinux_2_34; do
    platforms+=(--platform "${tag}_x86_64")
done
for pkg in pyzmq fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
           typing-extensions uvicorn xgrammar apache-tvm-ffi gguf opentelemetry-api \
           importlib-metadata nixl-cu13; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" --platform any -d .whl "$pkg"
done
nixl=$(ls .whl/nixl_cu13-*.whl)
if unzip -l "$nixl" | grep -q 'nixl_ep_cu13/'; then
    tmp=$(mktemp -d)
    unzip -q "$nixl" -d "$tmp"
    rm -rf "$tmp"/nixl_ep_cu13
    record=$(ls "$tmp"/nixl_cu13-*.dist-info/RECORD)
    grep -v '^nixl_ep_cu13/' "$record" > "$record.new" && mv "$record.new" "$record"
    rm "$nixl"
    (cd "$tmp" && zip -q -r -9 "$OLDPWD/$nixl" .)
    rm -rf "$tmp"
fi
du -sh .whl
