#!/usr/bin/env bash
# Build llama-server and llama-quantize from the pinned llama.cpp source
# (tools/llama_cpp_source.sh): llama.cpp's own Clef support, the other side of the
# interop checks (tools/interop_llama_server.py). Prints the directory holding the two binaries (stdout's
# last line); everything else goes to stderr.
#
#   CLEF_LLAMA_BUILD  build dir (default $HOME/.cache/clef-gguf/llama-build). Outside the
#                     repo on purpose: the build is ~25 minutes on 2 cores and must
#                     survive checkouts and `git clean`, and it is no part of the package.
#   CLEF_LLAMA_SRC    source cache dir, passed through to tools/llama_cpp_source.sh.
#   NICE              niceness of the compile (default 0; the background build uses 19 so
#                     that it does not slow the tests of whoever shares the machine).
#
# Idempotent: CMake configures once (a CMakeCache.txt in the build dir), and ninja
# rebuilds only what is out of date, so a second run is a no-op (0.1 s measured).
#
# Measured: 29 minutes on 2 shared cores (218 steps), in the background with
#   NICE=19 nohup bash tools/build_llama_server.sh > ~/.cache/clef-gguf/llama-build.log 2>&1 &
# Binaries: $CLEF_LLAMA_BUILD/bin/llama-server and .../bin/llama-quantize (with their
# libllama/libggml*.so beside them, found through the binaries' RPATH).
#
# Flags (docs/format.md, "llama-server"): GGML_NATIVE=ON because without it the CPU code is
# AVX2-only, slower than llama-cpp-python's native build that we compare against; no
# tests/examples/app/UI and no OpenSSL, since only the two binaries are wanted and the
# machines are offline (the prebuilt web UI would be downloaded).
#
# AMX: on an Intel Xeon with AMX (amx_int8 in /proc/cpuinfo) this native llama-server aborts
# while loading a Q4_K_M clef file (GGML_ASSERT(*cur_backend_id != -1) in
# ggml_backend_sched_split_graph); start it with --no-repack there, which loads and answers
# (FACTS.md, "AMX"). This machine is such a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$(bash tools/llama_cpp_source.sh)
BUILD=${CLEF_LLAMA_BUILD:-$HOME/.cache/clef-gguf/llama-build}
NICE=${NICE:-0}

if [[ ! -f $BUILD/CMakeCache.txt ]]; then
    nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF >&2
fi
nice -n "$NICE" ninja -C "$BUILD" llama-server llama-quantize >&2
for b in llama-server llama-quantize; do
    [[ -x $BUILD/bin/$b ]] || { echo "no $BUILD/bin/$b after the build" >&2; exit 1; }
done
echo "$BUILD/bin"
