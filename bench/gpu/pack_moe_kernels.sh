#!/bin/bash
# Packs vLLM 0.26.0's MoE kernels (_moe_C_stable_libtorch.abi3.so), which ../shared/gpu/pack_vllm.sh strips,
# into .gpu/moe-1/part (40 MB xz, 47 MB unpacked), from the wheel pack_vllm.sh downloaded (or a fresh download).
# Too large to ride with another chunk, so it takes a call of its own on the warm machine, carrying
# [".gpu/tools", ".gpu/moe-1"] (unpack.sh stashes it as /tmp/gpu-chunks/moe-1); once vLLM is unpacked:
#   xz -d < /tmp/gpu-chunks/moe-1 > /tmp/vllm-site/vllm/_moe_C_stable_libtorch.abi3.so
set -euo pipefail
REPO=$(git rev-parse --show-toplevel)
W=${W:-/tmp/trellis-gpu-build/vllm}
WHEEL=$(ls "$W"/whl/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)
if [[ -z $WHEEL ]]; then
  mkdir -p "$W/whl"
  python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
    --platform manylinux_2_28_x86_64 -d "$W/whl" vllm==0.26.0
  WHEEL=$(ls "$W"/whl/vllm-0.26.0-*.whl | head -1)
fi
mkdir -p "$REPO/.gpu/moe-1"
unzip -p "$WHEEL" vllm/_moe_C_stable_libtorch.abi3.so | xz -6 -T2 > "$REPO/.gpu/moe-1/part"
grep -qx "/.gpu/" "$REPO/.git/info/exclude" 2>/dev/null || echo "/.gpu/" >> "$REPO/.git/info/exclude"
ls -la "$REPO/.gpu/moe-1/part"
