#!/usr/bin/env bash
# Install clef-gguf with its test dependencies and the ray extra (tests/test_ray_serve.py), then run every test.
# clef-finetune carries Cloudflare's reference (the test oracle); its declared
# dependencies (torchvision, ...) are not needed for text, hence --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,ray]"
python -m pip install -q --no-deps clef-finetune==0.1.0
python -m ruff check clef_gguf tests tools
python -m pytest "$@"
