#!/usr/bin/env bash
# Install clef-gguf with its test dependencies and the ray extra (tests/test_ray_serve.py), then run every test;
# arguments go to pytest: `bash tools/test.sh -m "not slow"` is the inner loop (a few minutes), no -m every test.
# pytest-xdist runs the tests in two worker processes (tests/conftest.py's SAME_WORKER: the tests that share one);
# `-n 0` runs them in pytest's own process, `-n 4` in four workers where there are more cores.
# clef-finetune carries Cloudflare's reference (the test oracle); its declared
# dependencies (torchvision, ...) are not needed for text, hence --no-deps.
# The install is skipped where this environment already has the one of these sources (the same pyproject.toml,
# CMakeLists.txt and native/: a stamp in the environment): an editable install rebuilds the native library each time.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp="$(python -c 'import sys; print(sys.prefix)')/clef-gguf-test.stamp"
sources="$(find pyproject.toml CMakeLists.txt native -type f | sort | xargs cat | sha256sum | cut -d' ' -f1) $(pwd)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$sources" ] || ! python -c "import clef_gguf, clef_finetune" 2>/dev/null; then
    python -m pip install -q -e ".[test,ray]"
    python -m pip install -q --no-deps clef-finetune==0.1.0
    echo "$sources" > "$stamp"
fi
python -m ruff check clef_gguf tests tools
python -m pytest -n 2 "$@"
