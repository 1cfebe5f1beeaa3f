"""Time header-only `clef-gguf validate` on a large Clef file with a Clef-flash-sized header.

    python tools/bench/bench_validate.py OUT_DIR [--hidden 1024] [--type f32] [--runs 5]

Builds a random release in the Clef-flash layout (32 layers, 6 + 3 head) with a 248,320-token
vocabulary, converts it, then swaps 247,000 merges into the header (the fixture tokenizer has
~540; a real Qwen3.5 one ~247k) so that the header is as large as a real Clef file's. Needs the
test dependencies (torch, transformers), a few GB of memory and disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from clef_gguf import convert  # noqa: E402
from clef_gguf.check.validate import validate  # noqa: E402
from clef_gguf.format.header import GGUFFile  # noqa: E402
from clef_gguf.testing.gguf_bytes import kv_str_array, kvs_of  # noqa: E402
from clef_gguf.testing.release_builder import CLEF_FLASH_LAYOUT, build_release, build_tokenizer  # noqa: E402

VOCAB = 248_320  # Qwen3.5's padded vocabulary
MERGES = 247_000


def with_merges(src: Path, dst: Path, n: int) -> Path:
    """`src` with `n` synthetic merges: same tensors and data, a header the size of a real one."""
    f = GGUFFile.open(src)
    try:
        merges = [f"m{i} x{i}" for i in range(n)]
        kvs = kvs_of(f, replace={"tokenizer.ggml.merges": kv_str_array("tokenizer.ggml.merges", merges)})
        infos = b"".join(bytes(f.map[t.start : t.end]) for t in f.header.tensors.values())
        header = bytes(f.map[:24]) + b"".join(kvs) + infos
        header += bytes(-len(header) % f.header.alignment)
        with dst.open("wb") as out, src.open("rb") as data:
            out.write(header)
            data.seek(f.header.data_offset)
            shutil.copyfileobj(data, out, 64 << 20)
    finally:
        f.close()
    return dst


def timed(path: Path, runs: int) -> str:
    times = []
    for _ in range(runs):
        report = validate(path)
        times.append(report.seconds)
    size = path.stat().st_size
    return (
        f"{path.name}: {size / 2**30:.2f} GiB, header {report.header_size / 2**20:.1f} MiB, {report.verdict.value}; "
        f"header-only validate median {statistics.median(times):.3f} s (min {min(times):.3f}, max {max(times):.3f}, {runs} runs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--type", default="f32")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    spec = dataclasses.replace(
        CLEF_FLASH_LAYOUT,
        hidden=args.hidden,
        intermediate=3 * args.hidden,
        heads=8,
        kv_heads=2,
        head_dim=128,
        linear_key_heads=4,
        linear_value_heads=8,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        head_width=256,
        head_heads=4,
        head_feedforward=512,
        dtype="bfloat16",
        vocab_padding=VOCAB - len(build_tokenizer()),  # the embeddings padded to Qwen3.5's vocabulary
    )
    started = time.perf_counter()
    release = args.out / "release"
    if not (release / "config.json").exists():
        build_release(release, spec)
    clef = args.out / f"clef-large-{args.type}.gguf"
    if not clef.exists():
        convert(release, clef, args.type)
    real_header = args.out / f"clef-large-{args.type}-merges.gguf"
    if not real_header.exists():
        with_merges(clef, real_header, MERGES)
    print(f"built in {time.perf_counter() - started:.0f} s")
    print(timed(clef, args.runs))
    print(timed(real_header, args.runs))


if __name__ == "__main__":
    main()
