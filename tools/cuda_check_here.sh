#!/usr/bin/env bash
# clef-gguf installed over the CUDA wheel that tools/cuda_build.sh makes, on this machine: no GPU, no NVIDIA driver.
# What a user of that wheel sees here must be clear: `import clef_gguf` works, and `clef-gguf demo` at
# -ngl 0 and -ngl -1 says in one line that this is a CUDA build without a driver, never a crash or the loader's
# traceback. .ci/run runs this where the wheel is built (~/.cache/clef-gguf/cuda), as it runs the Vulkan quick set.
#
#   bash tools/cuda_check_here.sh [--arch 90-real]
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${CLEF_CUDA_CACHE:-$HOME/.cache/clef-gguf/cuda}
ARCH=90-real
[[ ${1:-} == --arch ]] && ARCH=$2
WHEEL=$(ls "$CACHE/wheels-${ARCH//;/_}"/llama_cpp_python-0.3.36-*.whl 2>/dev/null | head -1 || true)
if [[ -z $WHEEL || ! -f $CACHE/wheels-${ARCH//;/_}/.runpath ]]; then
    echo "no CUDA wheel for $ARCH in $CACHE: bash tools/cuda_build.sh makes it" >&2
    exit 2
fi
VENV=$(mktemp -d)/venv
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --no-cache-dir)
"${PIP[@]}" --upgrade pip
# The wheel, CUDA 13's runtime and cuBLAS (NVIDIA's wheels, where its RUNPATH looks), then clef-gguf compiled against
# that wheel's ggml (no build isolation: an isolated build would fetch the CPU llama-cpp-python).
"${PIP[@]}" "$WHEEL" "cuda-toolkit[cudart,cublas]==13.0.2" scikit-build-core
"${PIP[@]}" --no-build-isolation ".[test]"
"${PIP[@]}" --no-deps clef-finetune==0.1.0
# --noconftest: the suite's conftest loads models; these tests load none, and check the load that cannot happen.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --noconftest -rs tests/test_no_driver.py
