"""Prefill time with and without ggml's CPU_REPACK weights, on the CPU at hand.

On an AMX Xeon clef-gguf keeps AMX out of the placement (llama/cpu_buffers.py) and
routes to CPU_REPACK what it runs; this measures what that routing is worth, and what
turning every extra buffer type off (the simple alternative) would cost. Each figure
is a fresh process loading the exported backbone (a plain qwen35 GGUF) by path, as bare
llama.cpp does, placed by `cpu_buffers.for_gguf(repack=...)`; the two placements are
interleaved round by round and medians are reported.

    python tools/bench/bench_cpu_repack.py [--hidden 1024 --layers 8] [--tokens 512 2048] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, time
import llama_cpp as L
from clef_gguf.llama import cpu_buffers
from clef_gguf.testing.bare_llama import bare_context
path, repack, n_tokens, threads, repeats = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
model, ctx = bare_context(path, n_tokens, threads=threads, repack=repack)
placed = cpu_buffers.for_gguf(path, repack=repack)  # (what the report says of the placement)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
tokens = (L.llama_token * n_tokens)(*[(7 * i + 3) % n_vocab for i in range(n_tokens)])
times = []
for _ in range(repeats):
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    t = time.perf_counter()
    assert L.llama_decode(ctx, L.llama_batch_get_one(tokens, n_tokens)) == 0
    L.llama_synchronize(ctx)
    times.append(time.perf_counter() - t)
print(json.dumps({"seconds": min(times), "repacked": len(placed.repacked), "extra": placed.use_extra_bufts}))
"""


def prepare(root: Path, hidden: int, layers: int, file_type: str) -> Path:
    import clef_gguf
    from clef_gguf.format.header import GGUFFile
    from clef_gguf.llama.qwen35_view import write_backbone_gguf
    from clef_gguf.testing.release_builder import ReleaseSpec, build_release

    spec = ReleaseSpec(
        seed=3,
        hidden=hidden,
        intermediate=2 * hidden,
        layers=layers,
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        head_width=64,
    )
    release = root / "release"
    if not release.exists():
        build_release(release, spec)
    clef = clef_gguf.convert(release, root / f"clef-{file_type}.gguf", file_type)
    f = GGUFFile.open(clef)
    plain = root / f"backbone-{file_type}.gguf"
    write_backbone_gguf(f, plain)
    f.close()
    return plain


def measure(path: Path, repack: bool, tokens: int, threads: int) -> dict[str, float]:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), "1" if repack else "0", str(tokens), str(threads), "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--types", nargs="+", default=["q8_0", "q4_k_m"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    from clef_gguf.llama import cpu_buffers

    print(f"CPU extra buffer types: {', '.join(cpu_buffers.extra_buffer_types()) or 'none'}")
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for file_type in args.types:
            plain = prepare(Path(tmp), args.hidden, args.layers, file_type)
            for tokens in args.tokens:
                runs: dict[bool, list[dict]] = {True: [], False: []}
                for _ in range(args.rounds):
                    for repack in (True, False):
                        runs[repack].append(measure(plain, repack, tokens, args.threads))
                med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
                rows.append((file_type, tokens, runs[True][0]["repacked"], med[True], med[False]))
        print(f"hidden {args.hidden}, {args.layers} layers, {args.threads} thread(s), medians of {args.rounds}")
        print("| type | tokens | weights in CPU_REPACK | with CPU_REPACK | without | without / with |")
        print("|---|---:|---:|---:|---:|---:|")
        for file_type, tokens, repacked, on, off in rows:
            print(f"| {file_type} | {tokens} | {repacked} | {on * 1000:.0f} ms | {off * 1000:.0f} ms | {off / on:.2f} |")


if __name__ == "__main__":
    main()
