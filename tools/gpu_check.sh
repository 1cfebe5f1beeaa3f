#!/usr/bin/env bash
# Parity and benchmarks of clef-gguf on an NVIDIA GPU, on a machine with no network.
#
#   bash tools/gpu_check.sh prepare   # here, with network: writes .gpu/ (about 8 MB, git-ignored)
#   bash tools/gpu_check.sh run       # there, in a copy of this checkout that includes .gpu/
#
# prepare: llama-cpp-python 0.3.36's sdist (76 MB) stripped to what a CUDA build of its
#   libraries needs (no models, docs, tests, examples, tools, other backends; mtmd off)
#   as .gpu/llama_cpp_python-0.3.36.tar.gz, and the pure-Python wheels such a machine may
#   lack (gguf, diskcache, clef-finetune: the reference the parity tests hold us to).
# run: into python3's own environment (the GPU machine is disposable; a virtual environment
#   made from it would not see its torch, transformers, scikit-build-core...), builds
#   llama-cpp-python with GGML_CUDA for this card's architecture only, installs clef-gguf
#   (editable: its native head is compiled against that CUDA ggml), checks the head runs
#   on the GPU, then runs, with n_gpu_layers=-1: the device set (the tests marked `device`, as
#   tools/device_check.sh runs them on Vulkan), a GPU-vs-CPU comparison of every fixture decision,
#   and tools/bench_head.py. Everything it reports
#   lands in $OUT (or .gpu/out): gpu_check.log, head_gpu.md/.json/.png.
#   Budget: 10 minutes including the build. CUDA flash-attention kernels are compiled only
#   with GPU_CHECK_CUDA_FA=ON (they dominate the build time); without them llama.cpp's
#   automatic flash-attention setting falls back to the regular path, for the benchmark's
#   bare llama.cpp and for clef-gguf alike.
#
# On the GPU machine, the checkout copied there with its .gpu/ folder: bash tools/gpu_check.sh run
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_VERSION=0.3.36
BUNDLE=${GPU_CHECK_BUNDLE:-.gpu}
SDIST=llama_cpp_python-$LLAMA_VERSION

# What the build of llama-cpp-python's libraries reads, relative to vendor/llama.cpp.
KEEP_LLAMA=(CMakeLists.txt LICENSE cmake include src common vendor licenses ggml/CMakeLists.txt ggml/cmake ggml/include
    ggml/src/CMakeLists.txt ggml/src/ggml-cpu ggml/src/ggml-cuda)

prepare() {
    local work
    work=$(mktemp -d)
    mkdir -p "$BUNDLE/wheels"
    python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$work"
    tar -xzf "$work/$SDIST.tar.gz" -C "$work"
    local src=$work/$SDIST strip=$work/stripped/$SDIST
    mkdir -p "$strip/vendor/llama.cpp/ggml/src"
    cp -r "$src"/{CMakeLists.txt,pyproject.toml,README.md,LICENSE.md,PKG-INFO,llama_cpp} "$strip/"
    for path in "${KEEP_LLAMA[@]}"; do
        mkdir -p "$(dirname "$strip/vendor/llama.cpp/$path")"
        cp -r "$src/vendor/llama.cpp/$path" "$strip/vendor/llama.cpp/$path"
    done
    # ggml/src's own sources (ggml.c, gguf.cpp, ggml-backend*.cpp, ...), without the other backends' folders.
    find "$src/vendor/llama.cpp/ggml/src" -maxdepth 1 -type f -exec cp {} "$strip/vendor/llama.cpp/ggml/src/" \;
    tar -czf "$BUNDLE/$SDIST.tar.gz" -C "$work/stripped" "$SDIST"
    python -m pip download -q --no-deps --only-binary=:all: gguf==0.19.0 diskcache clef-finetune==0.1.0 -d "$BUNDLE/wheels"
    grep -qx "/$BUNDLE/" .git/info/exclude 2>/dev/null || echo "/$BUNDLE/" >>.git/info/exclude
    rm -rf "$work"
    du -sh "$BUNDLE"
}

cuda_architecture() {
    # "9.0" -> "90-real": machine code for this card only, no PTX for others.
    local cc
    cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
    echo "${cc}-real"
}

run() {
    local out=${OUT:-$BUNDLE/out} start=$SECONDS
    mkdir -p "$out"
    exec > >(tee "$out/gpu_check.log") 2>&1
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
    command -v nvcc >/dev/null || { echo "no nvcc: a CUDA build of llama.cpp needs the CUDA toolkit"; exit 1; }
    local arch
    arch=$(cuda_architecture)
    python3 -m pip --version
    python3 -m pip install -q --no-index --no-deps "$BUNDLE"/wheels/*.whl

    echo "== llama-cpp-python $LLAMA_VERSION with CUDA for $arch ($(nproc) jobs)"
    CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_CUDA_FA=${GPU_CHECK_CUDA_FA:-OFF} -DLLAVA_BUILD=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        python3 -m pip install -q --no-index --no-deps --no-build-isolation "$BUNDLE/$SDIST.tar.gz"
    echo "   built in $((SECONDS - start)) s"

    echo "== clef-gguf (its native head against that ggml)"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
    python3 - <<'EOF'
import clef_gguf
from importlib import resources
model = clef_gguf.load(resources.files("clef_gguf") / "data" / "demo.gguf", n_gpu_layers=-1)
print("demo model's head runs on", model.head.device)
assert model.head.device.startswith("CUDA"), model.head.device
EOF
    echo "   ready after $((SECONDS - start)) s"

    # The device set (tests/conftest.py): every model, head and vision tower the tests load on the GPU.
    # A test module whose packages this machine lacks (the released clients) fails to collect; the rest runs.
    export PYTHONUNBUFFERED=1
    echo "== the device set: python3 -m pytest -m device --on-device"
    python3 -m pytest -m device --on-device -q -p no:cacheprovider --continue-on-collection-errors ||
        echo "!! some tests failed (see above)"
    echo "   tests done after $((SECONDS - start)) s"

    echo "== GPU vs CPU decisions on the fixtures"
    python3 - <<'EOF' || echo "!! the GPU-vs-CPU comparison failed"
import sys, tempfile
from pathlib import Path
from clef_gguf.testing.release_builder import ReleaseSpec, build_release
from clef_gguf.testing.request_suite import all_requests
import clef_gguf

def probabilities(answer):
    return {"true": answer["noul"]} if answer["type"] == "noul" else answer["probabilities"]

with tempfile.TemporaryDirectory() as tmp:
    for file_type in ("f32", "q8_0"):
        release = build_release(Path(tmp) / f"r-{file_type}", ReleaseSpec(seed=0))
        path = clef_gguf.convert(release, Path(tmp) / f"m-{file_type}.gguf", file_type)
        gpu, cpu = clef_gguf.load(path, n_gpu_layers=-1, n_ctx=8192), clef_gguf.load(path, n_ctx=8192)
        worst = 0.0
        for request in all_requests().values():
            a, b = gpu.decide(request)["answers"], cpu.decide(request)["answers"]
            worst = max(worst, *(abs(probabilities(a[q])[k] - v) for q in b for k, v in probabilities(b[q]).items()))
        print(f"{file_type}: max |p_gpu - p_cpu| = {worst:.5f} over the request suite (head on {gpu.head.device})")
EOF

    echo "== benchmarks (n_gpu_layers=-1)"
    python3 tools/bench_head.py --n-gpu-layers -1 --repeats 10 --out "$out" || echo "!! the benchmark failed"
    echo "== done in $((SECONDS - start)) s"
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    *)
        echo "usage: bash tools/gpu_check.sh prepare|run" >&2
        exit 2
        ;;
esac
