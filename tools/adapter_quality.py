"""What serving a fine-tune as an adapter over a quantized base does to its decisions, from `compare`.

    python tools/adapter_quality.py [--out DIR] [--data examples/labelled.jsonl]

On the k256 fixture (rows of 256: K-quants apply, not their fallbacks), clef-finetune's own `train` makes a
fine-tune; it is converted to a merged f32 file, a merged Q4_K_M file, and f16 and q8_0 adapter files over a
Q4_K_M base. `compare` then measures each adapter pairing against the merged Q4_K_M file and against f32, on DATA,
and prints docs/finetune.md's table (markdown).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import clef_gguf
from clef_gguf.conversion.adapter import convert_adapter
from clef_gguf.quality.compare import compare
from clef_gguf.settings import ModelSpec
from clef_gguf.testing import finetune
from clef_gguf.testing.release_builder import RELEASES, build_release

ROOT = Path(__file__).resolve().parent.parent


def build(out: Path, data: Path) -> dict[str, Path]:
    release = build_release(out / "release", RELEASES["k256"])
    checkpoint = finetune.train(release, data, out / "run")
    files = {
        "merged f32": clef_gguf.convert(checkpoint, out / "merged-f32.gguf", "f32", base=release, mmproj=False),
        "merged Q4_K_M": clef_gguf.convert(checkpoint, out / "merged-q4_k_m.gguf", "q4_k_m", base=release, mmproj=False),
        "base Q4_K_M": clef_gguf.convert(release, out / "base-q4_k_m.gguf", "q4_k_m", mmproj=False),
    }
    for kind in ("f16", "q8_0"):
        files[f"adapter {kind}"] = convert_adapter(checkpoint, release, out / f"tune-{kind}.adapter.gguf", kind)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--data", type=Path, default=ROOT / "examples" / "labelled.jsonl")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="adapter-quality-"))
    files = build(out, args.data)
    rows = [
        "| B | against A | answers changed | decided flips | max \\|Δp\\| | mean \\|Δp\\| | max KL |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    pairs = [
        ("merged Q4_K_M", None, "merged f32"),
        ("base Q4_K_M", "adapter f16", "merged f32"),
        ("base Q4_K_M", "adapter q8_0", "merged f32"),
        ("base Q4_K_M", "adapter f16", "merged Q4_K_M"),
        ("base Q4_K_M", "adapter q8_0", "merged Q4_K_M"),
    ]
    for base, adapter, against in pairs:
        a = ModelSpec.of(files[against], max_prompt_tokens=4096)
        b = ModelSpec.of(files[base], max_prompt_tokens=4096, adapter=files.get(adapter or ""))
        result = compare(a, b, args.data)
        c = result["changes"]["overall"]
        name = f"{base} + {adapter}" if adapter else base
        rows.append(
            f"| {name} | {against} | {c['changed']} of {c['n']} | {c['flips']} | {c['abs_dp']['max']:.4f} | "
            f"{c['abs_dp']['mean']:.5f} | {c['kl']['max']:.2e} |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
