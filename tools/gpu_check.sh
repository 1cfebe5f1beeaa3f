#!/usr/bin/env bash
# Parity and benchmarks of clef-gguf on an NVIDIA GPU, on a machine with no network.
#
#   bash tools/gpu_check.sh prepare   # here, with network: writes .gpu/ (git-ignored)
#   bash tools/gpu_check.sh run       # there, in a copy of this checkout that includes .gpu/
#
# With the CUDA wheel that tools/cuda_build.sh builds here (~/.cache/clef-gguf/cuda/wheels-90-real), prepare puts it
# in .gpu/cuda (xz-compressed: 29 MB), and run installs it: nothing of llama.cpp is compiled on the GPU machine, and its
# minutes go to measuring. Without it, run builds from the stripped sdist (about 8 minutes of the budget on 16 cores).
#
# prepare: llama-cpp-python 0.3.36's sdist (76 MB) stripped to what a CUDA build of its
#   libraries needs (no models, docs, tests, examples, other backends, no tools but mtmd: the
#   vision tower's libmtmd) as .gpu/llama_cpp_python-0.3.36.tar.gz, and, as CPython 3.12 wheels
#   (that machine's python3), what clef-gguf and its tests need and its image lacks (the device
#   tool's KINDS.md lists what it has): the server's FastAPI stack, gguf, diskcache, clef-finetune
#   (the reference the parity tests hold us to). 9 MB in all.
# run: into python3's own environment (the GPU machine is disposable; a virtual environment
#   made from it would not see its torch, transformers, scikit-build-core...), builds
#   llama-cpp-python with GGML_CUDA for this card's architecture only, installs clef-gguf
#   (editable: its native head is compiled against that CUDA ggml), checks the head runs
#   on the GPU, then runs, with n_gpu_layers=-1, the quick checks first: tools/compare_devices.py
#   (the request suite on the GPU against the CPU), tools/bench/bench_batch.py (tickets alone against
#   batched: what batching gives on a GPU), then the device set (the tests marked
#   `device`, as tools/device_check.sh runs them on Vulkan) and tools/bench/bench_head.py, each cut off
#   where the budget ends (GPU_CHECK_BUDGET seconds from the start, default 570: the device tool
#   runs a command for 10 minutes at most), so that one call brings back what it got to.
#   Everything it reports lands in $OUT (or .gpu/out): gpu_check.log, head_gpu.md/.json/.png.
#   CUDA flash-attention kernels are compiled only
#   with GPU_CHECK_CUDA_FA=ON (they dominate the build time); without them llama.cpp's
#   automatic flash-attention setting falls back to the regular path, for the benchmark's
#   bare llama.cpp and for clef-gguf alike.
#
# rehearse: here, with no GPU, what run does once installed, in this machine's python3 as it is (nothing installed):
#   the head check (the CPU reported, not refused), each measuring program started with its arguments and --help (its
#   imports and its options), and the device set's pytest on PYTEST ARGS (e.g. a few node ids; tests/test_device_set.py
#   runs it so): what breaks run without a GPU shows here, not in a GPU machine's minutes.
#
# On the GPU machine, the checkout copied there with its .gpu/ folder: bash tools/gpu_check.sh run
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_VERSION=0.3.36
BUNDLE=${GPU_CHECK_BUNDLE:-.gpu}
SDIST=llama_cpp_python-$LLAMA_VERSION

# What the build of llama-cpp-python's libraries reads, relative to vendor/llama.cpp.
KEEP_LLAMA=(CMakeLists.txt LICENSE cmake include src common vendor licenses ggml/CMakeLists.txt ggml/cmake ggml/include
    ggml/src/CMakeLists.txt ggml/src/ggml-cpu ggml/src/ggml-cuda tools/mtmd)
# What the NVIDIA image's python3 (3.12) lacks of clef-gguf's dependencies and its tests', each at the version this
# project is tested with (fastapi imports opentelemetry-api; pydantic needs typing-extensions 4.16).
WHEELS=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 typing-extensions==4.16.0 opentelemetry-api==1.45.2 uvicorn==0.54.0 httptools==0.9.0
    backports.zstd==1.8.0 gguf==0.19.0 diskcache==5.6.3 clef-finetune==0.1.0)

prepare() {
    local work wheel
    work=$(mktemp -d)
    mkdir -p "$BUNDLE/wheels"
    wheel=$(ls "${CLEF_CUDA_CACHE:-$HOME/.cache/clef-gguf/cuda}"/wheels-90-real/llama_cpp_python-$LLAMA_VERSION-*.whl 2>/dev/null | head -1 || true)
    if [[ -n $wheel ]]; then
        # The wheel holds each library three times (libx.so, .so.0, .so.0.x.y: a wheel has no links), which xz's
        # 64 MiB window folds into one: 107 MB in, 29 MB out, and the bundle travels in 64 MiB at most.
        mkdir -p "$BUNDLE/cuda"
        xz -9 -T2 -c "$wheel" >"$BUNDLE/cuda/$(basename "$wheel").xz"
        du -h "$wheel" "$BUNDLE"/cuda/*.xz
    fi
    local server=${CLEF_CUDA_CACHE:-$HOME/.cache/clef-gguf/cuda}/build-llama-server-90-real/bin
    if [[ -x $server/llama-server ]]; then
        # llama-server and llama-quantize CUDA-built here (tools/cuda_build.sh --server), the peer on the GPU: the two
        # programs and their libraries, each found beside them ($ORIGIN), xz-packed.
        local staged=$work/llama-bin
        mkdir -p "$staged"
        cp -P "$server"/llama-server "$server"/llama-quantize "$server"/lib*.so* "$staged/"
        for f in "$staged"/*; do
            [[ -L $f ]] || "${CLEF_CUDA_CACHE:-$HOME/.cache/clef-gguf/cuda}/tools/bin/patchelf" --set-rpath '$ORIGIN' "$f"
        done
        tar -cJf "$BUNDLE/cuda/llama-server.tar.xz" -C "$work" llama-bin
        du -h "$BUNDLE/cuda/llama-server.tar.xz"
    fi
    # The sdist, stripped, for a run without the prebuilt wheel (it builds there): left out when the wheel is packed,
    # which keeps the bundle (with llama-server's) within the device tool's 64 MiB.
    if [[ -z $wheel ]]; then
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
    fi
    python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$BUNDLE/wheels" "${WHEELS[@]}"
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

    if ls "$BUNDLE"/cuda/llama_cpp_python-*.whl.xz >/dev/null 2>&1; then
        echo "== llama-cpp-python $LLAMA_VERSION with CUDA, prebuilt (tools/cuda_build.sh; this card: $arch)"
        local packed
        packed=$(ls "$BUNDLE"/cuda/llama_cpp_python-*.whl.xz | head -1)
        python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
            "$packed" "/tmp/$(basename "${packed%.xz}")"
        python3 -m pip install -q --no-index --no-deps --force-reinstall "/tmp/$(basename "${packed%.xz}")"
    else
        echo "== llama-cpp-python $LLAMA_VERSION with CUDA for $arch ($(nproc) jobs)"
        CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$arch -DGGML_CUDA_FA=${GPU_CHECK_CUDA_FA:-OFF}" \
            CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
            python3 -m pip install -q --no-index --no-deps --no-build-isolation "$BUNDLE/$SDIST.tar.gz"
    fi
    echo "   installed after $((SECONDS - start)) s"
    if [[ -f $BUNDLE/cuda/llama-server.tar.xz ]]; then  # llama-server CUDA, for the comparisons on the GPU
        rm -rf "$BUNDLE/bin" && tar -xJf "$BUNDLE/cuda/llama-server.tar.xz" -C "$BUNDLE" && mv "$BUNDLE/llama-bin" "$BUNDLE/bin"
        LD_LIBRARY_PATH=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))'):${LD_LIBRARY_PATH:-}
        export LD_LIBRARY_PATH
        "$BUNDLE/bin/llama-server" --version 2>&1 | tail -2
    fi

    echo "== clef-gguf (its native head against that ggml)"
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
    measure run "$out" "$start"
}

rehearse() {
    local out=${OUT:-$BUNDLE/out}
    mkdir -p "$out"
    exec > >(tee "$out/gpu_check.log") 2>&1
    echo "== rehearsal: no GPU; $(python3 -c 'import sys; print(sys.prefix)') as installed, nothing installed"
    measure rehearse "$out" "$SECONDS" "$@"
}

measure() {
    # What run does once installed ($1 run), or its rehearsal without a GPU ($1 rehearse, then the device set's
    # pytest arguments): the head check, then each step cut off where the budget ends.
    local mode=$1 out=$2 start=$3
    shift 3
    MODE=$mode python3 - <<'EOF'
import os

import clef_gguf
from importlib import resources
model = clef_gguf.load(resources.files("clef_gguf") / "data" / "demo.gguf", n_gpu_layers=-1)
print("demo model's head runs on", model.head.device)
assert model.head.device.startswith("CUDA") or os.environ["MODE"] == "rehearse", model.head.device
EOF
    echo "   ready after $((SECONDS - start)) s"
    local help=()
    [[ $mode == rehearse ]] && help=(--help)  # each program parses its arguments, then stops

    # Each step is cut off where the budget ends (timeout's status 124), so that the log says how far it got.
    export PYTHONUNBUFFERED=1
    local budget=${GPU_CHECK_BUDGET:-570} failed=0
    step() {
        local name=$1 left=$((budget - SECONDS + start))
        shift
        echo "== $name ($left s of the budget left)"
        if ((left < 20)); then
            echo "!! not run: the budget is spent"
            return
        fi
        timeout "$left" "$@" || {
            echo "!! $name: exit status $? (124: cut off by the budget)"
            failed=$((failed + 1))
        }
        echo "   after $((SECONDS - start)) s"
    }
    step "GPU vs CPU decisions on the fixtures" python3 tools/compare_devices.py "${help[@]}"
    step "four tickets alone and batched" python3 tools/bench/bench_batch.py --types f32 q4_k_m --rounds 9 --n-gpu-layers -1 \
        "${help[@]}"
    # The device set (tests/conftest.py): every model, head and vision tower the tests load on the GPU. A test
    # module whose packages this machine lacks (the released clients) fails to collect; the rest runs.
    step "the device set" python3 -m pytest -m device --on-device -q -p no:cacheprovider --continue-on-collection-errors "$@"
    step "the head against bare llama.cpp" python3 tools/bench/bench_head.py --n-gpu-layers -1 --repeats 10 --out "$out" \
        "${help[@]}"
    # Clef-flash's shapes (random weights, written in a minute): plan for 8 GiB, what the card holds once loaded, and
    # the seeds' request (three questions) on the GPU; against llama-server where a CUDA one is in .gpu/bin.
    step "Clef-flash-shaped Q4_K_M on the GPU" python3 tools/shaped_model.py /tmp/shaped --plan --vram 8GiB --time \
        --n-gpu-layers -1 --bin "$BUNDLE/bin" "${help[@]}"
    echo "== done in $((SECONDS - start)) s, $failed steps failed"
    ((failed == 0))  # (run's log says which; a rehearsal's exit status says whether)
}

case "${1:-}" in
    prepare) prepare ;;
    run) run ;;
    rehearse) rehearse "${@:2}" ;;
    *)
        echo "usage: bash tools/gpu_check.sh prepare|run|rehearse [PYTEST ARGS...]" >&2
        exit 2
        ;;
esac
