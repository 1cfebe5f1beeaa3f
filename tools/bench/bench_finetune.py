"""From fine-tune to Q4_K_M, measured: the benchmark fixture (release_builder.BENCHMARK) fine-tuned by clef-finetune's
own `train` on examples/labelled.jsonl, its checkpoint converted with `clef-gguf convert CHECKPOINT --base` to f32,
f16, q8_0 and Q4_K_M, then, in one run:

- records/s of `clef-gguf eval` (f32 and Q4_K_M) against `clef-finetune eval` (its merged release on the CPU, in
  float32 and in bfloat16, its default dtype) on the same --count records, each as a whole command (load included)
  and, for clef-gguf, its own decide time;
- `clef-gguf compare` of f16, q8_0 and Q4_K_M against f32 on the same records: what a user would see;
- `clef-gguf calibrate` of the Q4_K_M file on the same records, 30% held out: NLL and ECE before and after.

    python tools/bench/bench_finetune.py [--count 200] [--out docs/benchmarks/finetune.json]

The records are examples/labelled.jsonl's tickets, each with a customer and an order number in front (seeded), so
that states repeat only as often as a real queue's would: never.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "labelled.jsonl"
CLI = [sys.executable, "-m", "clef_gguf.cli"]
TYPES = ("f32", "f16", "q8_0", "q4_k_m")
NAMES = ["Ana", "Bo", "Chidi", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivo", "Jun"]


def records(count: int, seed: int = 38) -> list[dict]:
    rng = random.Random(seed)
    base = [json.loads(line) for line in EXAMPLES.read_text().splitlines()]
    out = []
    for i in range(count):
        record = json.loads(json.dumps(base[i % len(base)]))
        ticket = record["state"]["ticket"]
        record["state"] = {"customer": rng.choice(NAMES), "order": f"#{rng.randrange(10**5, 10**6)}", "ticket": ticket}
        record["id"] = f"r{i:04d}"
        out.append(record)
    return out


def timed(command: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode not in (0, 8):
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - started, done.stdout


def prepare(work: Path) -> tuple[Path, Path, dict[str, Path]]:
    """The fine-tune (child processes: torch never runs in this one), its merged release and its conversions."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from clef_gguf.testing.release_builder import "
            "BENCHMARK, build_release; build_release(Path(sys.argv[1]), BENCHMARK)",
            str(work / "base"),
        ],
        check=True,
    )
    code = (
        "import sys; from pathlib import Path; from clef_gguf.testing import finetune as f; w = Path(sys.argv[1]); "
        "c = f.train(w / 'base', Path(sys.argv[2]), w / 'run'); f.merge(w / 'base', c, w / 'merged'); print(c)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(work), str(EXAMPLES)], check=True, capture_output=True, text=True)
    checkpoint = Path(done.stdout.strip().splitlines()[-1])
    files = {}
    for file_type in TYPES:
        files[file_type] = work / f"tuned-{file_type}.gguf"
        convert = [*CLI, "convert", str(checkpoint), "--base", str(work / "base"), "-o", str(files[file_type])]
        subprocess.run([*convert, "-t", file_type, "--no-mmproj"], check=True, capture_output=True)
    return checkpoint, work / "merged", files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        _, merged, files = prepare(work)
        data = work / "eval.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in records(args.count)))
        result: dict = {"count": args.count, "eval": {}, "compare": {}}
        for dtype in ("float32", "bfloat16"):
            finetune = [sys.executable, "-m", "clef_gguf.testing.finetune", "eval", "--model", str(merged)]
            finetune += ["--data", str(data), "--output-dir", str(work / dtype), "--dtype", dtype, "--device", "cpu"]
            seconds, _ = timed(finetune)
            overall = json.loads((work / dtype / "tuned_metrics.json").read_text())["metrics"]["overall"]
            result["eval"][f"clef-finetune (torch, {dtype})"] = {
                "seconds": round(seconds, 2),
                "records_per_s": args.count / seconds,
                "accuracy": overall["accuracy"],
                "nll": overall["nll"],
            }
        for file_type in ("f32", "q4_k_m"):
            seconds, out = timed([*CLI, "eval", str(files[file_type]), str(data), "--json"])
            ours = json.loads(out)
            result["eval"][f"clef-gguf {file_type}"] = {
                "seconds": round(seconds, 2),
                "records_per_s": args.count / seconds,
                "decide_records_per_s": ours["records_per_s"],
                "accuracy": ours["metrics"]["overall"]["accuracy"],
                "nll": ours["metrics"]["overall"]["nll"],
            }
        for file_type in ("f16", "q8_0", "q4_k_m"):
            _, out = timed([*CLI, "compare", str(files["f32"]), str(files[file_type]), str(data), "--json"])
            result["compare"][file_type] = json.loads(out)["changes"]
        calibrate = [*CLI, "calibrate", str(files["q4_k_m"]), str(data), "-o", str(work / "calibrated.gguf"), "--holdout", "0.3"]
        _, out = timed([*calibrate, "--json"])
        result["calibrate"] = json.loads(out)
    print_tables(result, args.count)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


def print_tables(result: dict, count: int) -> None:
    """The run's tables: eval's records/s, compare's changes against f32, and calibrate's before and after."""
    base = result["eval"]["clef-finetune (torch, bfloat16)"]["records_per_s"]
    columns = "seconds | records/s | x clef-finetune bf16 (its default) | decide only, records/s | accuracy | nll"
    print(f"| eval of {count} records | {columns} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, e in result["eval"].items():
        print(
            f"| {name} | {e['seconds']} | {e['records_per_s']:.1f} | {e['records_per_s'] / base:.1f} | "
            f"{e.get('decide_records_per_s', '-')} | {e['accuracy']:.4f} | {e['nll']:.4f} |"
        )
    columns = "top answer changed | decided flips | mean abs dp | p99 abs dp | max abs dp | mean KL | max KL"
    print(f"\n| against f32 | questions | {columns} |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for file_type, changes in result["compare"].items():
        c = changes["overall"]
        print(
            f"| {file_type} | {c['n']} | {c['changed']} ({c['changed_share']:.1%}) | {c['flips']} | {c['abs_dp']['mean']:.5f} | "
            f"{c['abs_dp']['p99']:.5f} | {c['abs_dp']['max']:.5f} | {c['kl']['mean']:.2e} | {c['kl']['max']:.2e} |"
        )
    c = result["calibrate"]
    print(f"\ncalibrate Q4_K_M, --holdout 0.3: temperatures {', '.join(f'{k} {v:.3f}' for k, v in c['temperatures'].items())}")
    print("\n| part | n | nll before | nll after | ece before | ece after |\n|---|---:|---:|---:|---:|---:|")
    for part, before in c["before"].items():
        after = c["after"][part]
        print(f"| {part} | {before['n']} | {before['nll']:.4f} | {after['nll']:.4f} | {before['ece']:.4f} | {after['ece']:.4f} |")


if __name__ == "__main__":
    main()
