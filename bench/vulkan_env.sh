#!/usr/bin/env bash
# Vulkan environment: a virtual environment (.venv-vulkan) holding llama-cpp-python built with
# llama.cpp's Vulkan backend and edgespec installed editable, for the `gpu` tests and a Vulkan
# node. Works on any Vulkan device; without a GPU, Mesa's lavapipe (llvmpipe) is a Vulkan 1.3
# device that runs on the CPU.
#
#   bash bench/vulkan_env.sh                      # from the repository root
#   .venv-vulkan/bin/pytest -m gpu tests/         # the gpu tests on that venv
#
# Needs (Debian/Ubuntu; installed here when run as root and missing):
#   apt-get install mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools
#
# llama.cpp's Vulkan backend needs Vulkan headers of 1.3.261 or newer (VK_EXT_layer_settings);
# Debian 12 ships 1.3.239. Where the system's are older, the script fetches Debian 13's
# libvulkan-dev with apt (its own package lists under the cache; the system's apt state is
# left alone), unpacks only its headers into the cache and builds against them. The loader
# and drivers stay the system's. VULKAN_INCLUDE=DIR names other headers.
#
# pip's wheel cache is keyed by the sdist, not by CMAKE_ARGS: a plain `pip install` could reuse
# a CPU wheel or poison the cache with a Vulkan one. So the wheel is built with pip's cache off
# into this script's own cache ($EDGESPEC_HOME/wheels/vulkan, default
# ~/.cache/edgespec/wheels/vulkan) and installed from there; a second run reinstalls from it
# in seconds (23 s here). The first build compiles llama.cpp's Vulkan shaders: 20 minutes on
# 2 shared cores here (docs/experiments.md 16).
#
# Environment: VENV (default .venv-vulkan), LLAMA_CPP_VERSION (default 0.3.36),
# REBUILD=1 (ignore the cached wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv-vulkan}
VER=${LLAMA_CPP_VERSION:-0.3.36}
CACHE=${EDGESPEC_HOME:-$HOME/.cache/edgespec}/wheels/vulkan
PKGS="mesa-vulkan-drivers libvulkan-dev glslc spirv-headers vulkan-tools"

missing=()
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  else
    echo "vulkan_env: missing packages; run: sudo apt-get install ${missing[*]}" >&2; exit 2
  fi
fi
vulkaninfo --summary 2>/dev/null | grep -E "deviceName|apiVersion" \
  || { echo "vulkan_env: vulkaninfo sees no Vulkan device" >&2; exit 2; }

mkdir -p "$CACHE"
hdr_version() { sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\).*/\1/p' "$1/vulkan/vulkan_core.h" 2>/dev/null; }
INC=${VULKAN_INCLUDE:-/usr/include}
if [ "$(hdr_version "$INC" || echo 0)" -lt 261 ] 2>/dev/null || [ -z "$(hdr_version "$INC")" ]; then
  INC="$CACHE/vulkan-headers/usr/include"
  if [ -z "$(hdr_version "$INC")" ]; then
    echo "vulkan_env: system Vulkan headers are older than 1.3.261; fetching Debian 13's" >&2
    A="$CACHE/apt"
    mkdir -p "$A/lists/partial" "$A/cache/archives/partial"
    echo "deb http://deb.debian.org/debian trixie main" > "$A/sources.list"
    O=(-o Dir::Etc::SourceList="$A/sources.list" -o Dir::Etc::SourceParts=/dev/null
       -o Dir::State::Lists="$A/lists" -o Dir::Cache="$A/cache" -o APT::Get::List-Cleanup=0)
    apt-get "${O[@]}" -q update >/dev/null
    (cd "$A" && apt-get "${O[@]}" -q download libvulkan-dev/trixie >/dev/null)
    dpkg -x "$(ls "$A"/libvulkan-dev_*.deb | head -1)" "$CACHE/vulkan-headers"
  fi
fi
echo "vulkan_env: Vulkan headers $(hdr_version "$INC") from $INC" >&2
wheel=$(ls "$CACHE"/llama_cpp_python-"$VER"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ] || [ "${REBUILD:-0}" = 1 ]; then
  rm -f "$CACHE"/llama_cpp_python-"$VER"-*.whl
  echo "vulkan_env: building llama-cpp-python $VER with GGML_VULKAN (long: shader compile)" >&2
  start=$(date +%s)
  CMAKE_ARGS="-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$INC" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    python3 -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python \
    -w "$CACHE" "llama-cpp-python==$VER"
  echo "vulkan_env: wheel built in $(( $(date +%s) - start ))s" >&2
  wheel=$(ls "$CACHE"/llama_cpp_python-"$VER"-*.whl | head -1)
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# The Vulkan wheel first (no pip cache), so that edgespec's requirement finds it satisfied.
"$VENV/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps "$wheel"
"$VENV/bin/pip" install -q -e ".[test]"
# Vulkan hides CPU-type devices (lavapipe) unless named: device 0 is lavapipe where it is the
# only one, the first GPU elsewhere.
GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0} "$VENV/bin/python" - <<'EOF'
from edgespec.llm import devices
found = devices.list_devices()
gpus = [d for d in found if d.kind != "cpu"]
print("vulkan_env: llama.cpp devices:", [f"{d.name} ({d.description}, {d.kind})" for d in found])
raise SystemExit(0 if gpus else "vulkan_env: llama.cpp sees no GPU device (built without Vulkan?)")
EOF
