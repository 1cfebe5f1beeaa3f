#!/usr/bin/env bash
# The device set on Vulkan: the tests marked `device` (parity, head, state cache, batching, plan, images,
# the clients against `serve`), with every model, head and vision tower on the device (tests/conftest.py).
#
#   bash tools/vulkan_env.sh             # once: the Vulkan build of llama-cpp-python, in its own venv
#   bash tools/device_check.sh [VENV] [--quick] [--rehearse] [PYTEST ARGS...]
#
# --quick runs one case of each path (tests/conftest.py DEVICE_QUICK) instead of the whole set.
# --rehearse runs it all where there is no device, in VENV as it is installed (no reinstall): where a device is
# required it says there is none and goes on, on the CPU, which ignores the offload asked for. What breaks the
# script or the device set's configuration then shows without a device (tests/test_device_set.py runs it in CI).
#
# On lavapipe (Mesa's software Vulkan device) the first run compiles ggml's shaders into the Mesa cache
# below (minutes per model shape on 2 cores); later runs, and every later process, reuse it. lavapipe is
# 30-50x slower than the CPU backend: this checks that the device path is right, not how fast it is.
set -euo pipefail
HELP=$(sed -n '2,/^set /s/^# \{0,1\}//p' "$0")  # the comment above: the usage
cd "$(dirname "$0")/.."
VENV=$HOME/.cache/clef-gguf/vulkan-venv
if [ $# -gt 0 ] && [ -d "$1" ]; then
    VENV=$1
    shift
fi
MARK=device
REHEARSE=0
while [ $# -gt 0 ]; do
    case $1 in
        --quick) MARK=device_quick ;;
        --rehearse) REHEARSE=1 ;;
        -h|--help) echo "$HELP"; exit 0 ;;
        *) break ;;
    esac
    shift
done
# lavapipe compiles each pipeline with LLVM once: Mesa's disk cache below keeps the result for every later process
# (measured, demo model on every layer: 452 s for a cold process's load and first decision, 1.6 s for the next one's).
# Not GALLIVM_PERF=nopt: its cold compile was no shorter (436 s), and its shaders ran 1.7x slower (0.75 s a decision).
# ggml-vulkan skips CPU-type devices (lavapipe is one) unless they are named.
export GGML_VK_VISIBLE_DEVICES=${GGML_VK_VISIBLE_DEVICES:-0}
export MESA_SHADER_CACHE_DIR=${MESA_SHADER_CACHE_DIR:-$HOME/.cache/clef-gguf/vulkan/shaders}
export MESA_SHADER_CACHE_MAX_SIZE=${MESA_SHADER_CACHE_MAX_SIZE:-4G}
PY=$VENV/bin/python
[ -x "$PY" ] || { echo "no $PY: run bash tools/vulkan_env.sh first" >&2; exit 2; }
start=$SECONDS
# The checkout's native head, compiled against this venv's ggml (a C++ change since the last run is picked up).
if [ "$REHEARSE" = 0 ]; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
else
    echo "rehearsal: $VENV as installed"
fi
vulkaninfo --summary 2>/dev/null | grep -E "deviceName|driverInfo" || true
REHEARSE=$REHEARSE "$PY" - <<'EOF'
import os

import clef_gguf
from clef_gguf.data import DEMO_MODEL

with clef_gguf.load(DEMO_MODEL, n_gpu_layers=-1) as model:
    print("the demo's head runs on", model.head.device)
    if model.head.device == "CPU":
        assert os.environ["REHEARSE"] == "1", "no device: is this venv's llama-cpp-python built with a device backend?"
        print("rehearsal: no device here; the device set runs on the CPU, the offload asked for and ignored")
EOF
"$PY" -m pytest -m "$MARK" --on-device -q -p no:cacheprovider --durations 10 "$@"
echo "device set: $((SECONDS - start)) s"
