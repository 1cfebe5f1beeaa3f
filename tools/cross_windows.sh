#!/usr/bin/env bash
# Cross-compile the native head (clef_head.dll) for Windows x86-64 with mingw-w64 (Debian: apt-get install mingw-w64),
# against the ggml that llama-cpp-python 0.3.36 vendors: built here from its sdist (CPU backend, GGML_NATIVE=OFF),
# once, into ~/.cache/clef-gguf/mingw (a rerun takes seconds). Then check what came out: a PE32+ DLL exporting the C API
# clef_gguf/llama/native.py binds, importing ggml.dll and ggml-base.dll (the names of the MSVC-built wheels' DLLs) and
# system DLLs only (the MinGW runtime is linked in: CMakeLists.txt). Built, not run: no Windows here (docs/devices.md).
# PYTHON (default python3) is the environment whose pip fetches the sdist, and whose llama-cpp-python's headers, when
# it has them, must be the ones built against.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout="$PWD"
version=0.3.36
python="${PYTHON:-python3}"
cache="${CLEF_GGUF_CACHE:-$HOME/.cache/clef-gguf}/mingw"
host=x86_64-w64-mingw32
# The -posix compilers: ggml's CPU backend uses std::thread, which the -win32 thread model of Debian's mingw lacks.
cc="$host-gcc-posix" cxx="$host-g++-posix"
for tool in "$cc" "$cxx" "$host-objdump" "$host-windres" cmake; do
    command -v "$tool" >/dev/null || { echo "cross_windows: $tool not found (apt-get install mingw-w64 cmake)" >&2; exit 2; }
done
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
mkdir -p "$cache"
started=$SECONDS
say() { echo "cross_windows: $* ($((SECONDS - started)) s)"; }

# CMake for Windows on the MinGW toolchain; DLLs named as MSVC names them (ggml.dll, not libggml.dll), so that the
# head imports the very names llama-cpp-python's Windows wheels ship.
cat >"$cache/no-lib-prefix.cmake" <<'EOF'
set(CMAKE_SHARED_LIBRARY_PREFIX "")
EOF
cross=(-DCMAKE_SYSTEM_NAME=Windows -DCMAKE_SYSTEM_PROCESSOR=x86_64 -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx"
       -DCMAKE_RC_COMPILER="$host-windres" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PROJECT_INCLUDE="$cache/no-lib-prefix.cmake")

# 1. ggml for Windows, from the sdist's vendored llama.cpp (pip's cache serves the download after the first time).
ggml="$cache/ggml-$version"
if [ ! -f "$ggml/.built" ]; then
    sdist="$cache/llama_cpp_python-$version.tar.gz"
    if [ ! -f "$sdist" ]; then
        "$python" -m pip download -q --no-deps --no-binary :all: -d "$cache" "llama-cpp-python==$version"
    fi
    rm -rf "$cache/src-$version" "$cache/ggml-build-$version" "$ggml"
    mkdir -p "$cache/src-$version"
    tar -xzf "$sdist" -C "$cache/src-$version" --strip-components=1 "llama_cpp_python-$version/vendor/llama.cpp/ggml"
    # The sdist leaves out ggml.pc.in, which ggml's CMake configures when built on its own: a pkg-config file, unused.
    echo "Name: ggml" >"$cache/src-$version/vendor/llama.cpp/ggml/ggml.pc.in"
    say "ggml $version unpacked"
    # Debian 12's mingw-w64 (10) lacks THREAD_POWER_THROTTLING_STATE, which ggml-cpu uses where _WIN32_WINNT is 0x0602
    # (Windows 8) or more: this ggml, only linked against, targets Windows 7's API. The head's build is not touched.
    cmake -S "$cache/src-$version/vendor/llama.cpp/ggml" -B "$cache/ggml-build-$version" "${generator[@]}" "${cross[@]}" \
        -DCMAKE_INSTALL_PREFIX="$ggml" -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DGGML_BACKEND_DL=OFF \
        -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DCMAKE_C_FLAGS=-D_WIN32_WINNT=0x0601 \
        -DCMAKE_CXX_FLAGS=-D_WIN32_WINNT=0x0601 >"$cache/ggml-configure.log"
    cmake --build "$cache/ggml-build-$version" -j "$(nproc)" >"$cache/ggml-build.log"
    cmake --install "$cache/ggml-build-$version" >/dev/null
    rm -rf "$cache/src-$version" "$cache/ggml-build-$version"  # (what a rerun needs is installed in $ggml)
    touch "$ggml/.built"
    say "ggml built for Windows into $ggml"
fi

# The headers built against are llama-cpp-python's own, where PYTHON has it (the wheel installs them in site-packages).
wheel_include="$("$python" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llama_cpp"); print(pathlib.Path(s.origin).parent.parent / "include")' 2>/dev/null || true)"
if [ -n "$wheel_include" ] && [ -f "$wheel_include/ggml.h" ]; then
    for header in "$ggml"/include/*.h; do
        cmp -s "$header" "$wheel_include/$(basename "$header")" || { echo "cross_windows: $(basename "$header") differs from $wheel_include's" >&2; exit 1; }
    done
    say "ggml's headers are those of the installed llama-cpp-python ($wheel_include)"
fi

# 2. The head, in a build folder of its own per checkout (incremental: a rerun recompiles what changed).
build="$cache/clef_head-$(printf %s "$checkout" | sha256sum | cut -c1-12)"
cmake -S "$checkout" -B "$build" "${generator[@]}" "${cross[@]}" --no-warn-unused-cli -DCLEF_GGML_DIR="$ggml/lib/cmake/ggml" >"$cache/head-configure.log"
cmake --build "$build" >"$cache/head-build.log" || { tail -n 40 "$cache/head-build.log" >&2; exit 1; }

# 3. What came out.
dll_name="$(sed -n 's/^LIBRARY_NAMES = .*"win32": "\([^"]*\)".*/\1/p' clef_gguf/llama/native.py)"
dll="$build/$dll_name"
[ -n "$dll_name" ] && [ -f "$dll" ] || { echo "cross_windows: no $dll_name in $build (native.py's LIBRARY_NAMES)" >&2; exit 1; }
dump="$("$host-objdump" -p "$dll")"
grep -q "file format pei-x86-64" <<<"$dump" && grep -qE "^Magic[[:space:]]+020b" <<<"$dump" \
    || { echo "cross_windows: $dll is not a PE32+ x86-64 file" >&2; exit 1; }
grep -qx $'\tDLL' <<<"$dump" || { echo "cross_windows: $dll is not a DLL (its characteristics)" >&2; exit 1; }
exported="$(awk '/\[Ordinal\/Name Pointer\] Table/{on=1; next} on && /^\t\[/{print $NF} on && /^$/{on=0}' <<<"$dump" | sort -u)"
# The C API: every function the headers export, and every one native.py binds.
wanted="$( (grep -ohE '^CLEF_(HEAD|CPU)_API [^(]*\(' native/*.h | sed -E 's/.*[ *]([a-z_0-9]+)\($/\1/'
            sed -n 's/^    "\(clef_[a-z_0-9]*\)": .*/\1/p' clef_gguf/llama/native.py) | sort -u)"
missing="$(comm -23 <(echo "$wanted") <(echo "$exported"))"
[ -z "$missing" ] || { echo "cross_windows: $dll does not export: $(echo $missing)" >&2; exit 1; }
imports="$(sed -n 's/^[[:space:]]*DLL Name: //p' <<<"$dump" | sort -u)"
foreign="$(grep -viE '^(ggml|ggml-base|kernel32|msvcrt|ucrtbase|api-ms-win-.*)\.dll$' <<<"$imports" || true)"
[ -z "$foreign" ] || { echo "cross_windows: $dll needs DLLs a Windows install lacks: $(echo $foreign)" >&2; exit 1; }
say "$dll: PE32+ DLL, exports $(echo "$wanted" | wc -l) functions of the C API, imports $(echo $imports)"
