"""Build the demo model shipped in the package: clef_gguf/data/demo.gguf.

A tiny Clef release with RANDOM weights (the test fixture builder, seed 0), converted
to f32. Its answers show the response format, not any judgement. Needs the test
dependencies (torch, transformers, tokenizers, clef-finetune): `bash tools/test.sh`
installs them.

    python tools/build_demo.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from clef_gguf import convert  # noqa: E402
from clef_gguf.data import DEMO_MODEL  # noqa: E402
from clef_gguf.testing.release_builder import ReleaseSpec, build_release  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        release = build_release(Path(tmp) / "clef-demo", ReleaseSpec(seed=0))
        convert(release, DEMO_MODEL, "f32", force=True)
    print(f"wrote {DEMO_MODEL} ({DEMO_MODEL.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
