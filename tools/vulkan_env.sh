#!/usr/bin/env bash
# A virtual environment whose llama-cpp-python 0.3.36 has ggml's Vulkan backend, on Mesa 25's lavapipe
# (a software Vulkan device: the one device backend a machine with no GPU can run), and clef-gguf over it.
#
#   bash tools/vulkan_env.sh [VENV]        # default VENV: ~/.cache/clef-gguf/vulkan-venv
#   bash tools/device_check.sh [VENV]      # then: the device test set on that device
#
# Offline but for the package registries (PyPI, Debian's archive). Needs root for apt. Idempotent: a step
# whose result is there is skipped. About 15 minutes the first time on 2 cores.
#   - Debian 12's Vulkan headers (1.3.239) do not build ggml-vulkan ('LayerSettingEXT' is not a member of
#     'vk'): Debian 13's libvulkan-dev 1.4.309 is downloaded and unpacked into a folder, for its headers only.
#   - Debian 12's lavapipe (Mesa 22.3) segfaults in the head's first graph compute: Mesa 25's, from
#     bookworm-backports, is installed instead.
#   - The Vulkan build of llama-cpp-python is made with --no-cache-dir: in pip's wheel cache, a later CPU
#     install of the same version would pick it up.
#   - clef-gguf is installed editable with --no-build-isolation, so that its native head is compiled against
#     this venv's ggml (with ggml-vulkan), not against a CPU build in an isolated build environment.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-$HOME/.cache/clef-gguf/vulkan-venv}
CACHE=$HOME/.cache/clef-gguf/vulkan
HEADERS=$CACHE/vulkan-headers
LLAMA_VERSION=0.3.36
mkdir -p "$CACHE"
start=$SECONDS

apt_sources() {  # a private apt state for one suite: the machine's own sources are not changed by it
    local name=$1 suite=$2
    mkdir -p "$CACHE/apt-$name/lists/partial" "$CACHE/apt-$name/parts"
    cat >"$CACHE/apt-$name/parts/$name.sources" <<EOF
Types: deb
URIs: http://deb.debian.org/debian
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    echo -o "Dir::Etc::SourceList=/dev/null" -o "Dir::Etc::SourceParts=$CACHE/apt-$name/parts" \
        -o "Dir::State::Lists=$CACHE/apt-$name/lists"
}

echo "== Vulkan loader, glslc, SPIR-V headers, vulkaninfo; Mesa 25's lavapipe from bookworm-backports"
# ggml-vulkan's CMake asks for SPIRV-HeadersConfig.cmake (spirv-headers) beside glslc.
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq glslc libvulkan-dev vulkan-tools spirv-headers >/dev/null
if ! dpkg-query -W -f '${Version}' mesa-vulkan-drivers 2>/dev/null | grep -q '^25\.'; then
    # The backports suite is added to the machine's sources for this one install (its dependencies come from
    # there too), then the file is removed: later apt commands see Debian 12 only.
    apt_sources backports bookworm-backports >/dev/null
    cp "$CACHE/apt-backports/parts/backports.sources" /etc/apt/sources.list.d/clef-gguf-backports.sources
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers >/dev/null
    rm /etc/apt/sources.list.d/clef-gguf-backports.sources
    apt-get update -qq
fi
dpkg-query -W -f 'mesa-vulkan-drivers ${Version}\n' mesa-vulkan-drivers

echo "== Vulkan headers 1.4 (Debian 13's libvulkan-dev, unpacked into $HEADERS)"
if [ ! -f "$HEADERS/usr/include/vulkan/vulkan.hpp" ]; then
    opts=$(apt_sources trixie trixie)
    # shellcheck disable=SC2086
    apt-get $opts update -qq
    rm -rf "$CACHE/deb" && mkdir -p "$CACHE/deb"
    # shellcheck disable=SC2086
    (cd "$CACHE/deb" && apt-get $opts download libvulkan-dev/trixie)
    dpkg-deb -x "$CACHE"/deb/libvulkan-dev_*.deb "$HEADERS"
fi
grep -m1 -o 'VK_HEADER_VERSION [0-9]*' "$HEADERS/usr/include/vulkan/vulkan_core.h"

echo "== llama-cpp-python $LLAMA_VERSION with GGML_VULKAN into $VENV"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY=$VENV/bin/python
if ! "$PY" -c 'import llama_cpp, pathlib, sys; sys.exit(not list(pathlib.Path(llama_cpp.__file__).parent.glob("lib/libggml-vulkan*")))' 2>/dev/null; then
    "$PY" -m pip install -q --upgrade pip
    CMAKE_ARGS="-DGGML_VULKAN=on -DVulkan_INCLUDE_DIR=$HEADERS/usr/include" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip install -q --no-cache-dir --no-binary llama-cpp-python "llama-cpp-python==$LLAMA_VERSION"
fi
echo "   llama-cpp-python ready after $((SECONDS - start)) s"

echo "== clef-gguf over it (editable, its native head compiled against this ggml)"
"$PY" -m pip install -q --no-cache-dir "scikit-build-core>=0.10"
"$PY" -m pip install -q --no-cache-dir --no-build-isolation -e ".[test]"
"$PY" -m pip install -q --no-deps clef-finetune==0.1.0
echo "== ready after $((SECONDS - start)) s: bash tools/device_check.sh $VENV"
