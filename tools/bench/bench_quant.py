"""Quantization figures, measured in one run (a script, not a timed test).

  * per --type, on a fixture whose rows are multiples of 256 (so K-quants apply):
    file size, and agreement with f32 over the request suite: top option on the
    questions where f32's top two differ by more than 0.1, and the largest |dp|;
  * conversion of a synthetic release of at least --big-gib GiB to q4_k_m in a fresh
    process: wall time and peak RSS (VmHWM), against the release's size.

Needs the test dependencies (bash tools/test.sh installs them).

    python tools/bench/bench_quant.py [--big-gib 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TYPES = ["f32", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0", "iq4_nl"]
CHILD = r"""
import json, sys, time

from clef_gguf.testing.processes import memory_mib  # VmHWM: this process image's peak (ru_maxrss has the parent's)


import clef_gguf
t = time.perf_counter()
clef_gguf.convert(sys.argv[1], sys.argv[2], sys.argv[3])
print(json.dumps({"seconds": time.perf_counter() - t, "peak_rss_mib": memory_mib(field="VmHWM")}))
"""


def _probabilities(answer: dict) -> dict[str, float]:
    return answer.get("probabilities") or {"true": answer["noul"], "false": 1 - answer["noul"]}


def agreement(reference: dict, other: dict) -> tuple[int, int, float]:
    decisive = same = 0
    worst = 0.0
    for qid, expected in reference["answers"].items():
        p, q = _probabilities(expected), _probabilities(other["answers"][qid])
        worst = max(worst, *(abs(p[k] - q[k]) for k in p))
        top = sorted(p.values(), reverse=True)
        if top[0] - top[1] > 0.1:
            decisive += 1
            same += max(p, key=p.get) == max(q, key=q.get)
    return same, decisive, worst


def per_type(tmp: Path) -> None:
    import clef_gguf
    from clef_gguf.testing.release_builder import ReleaseSpec, build_release
    from clef_gguf.testing.request_suite import all_requests

    spec = ReleaseSpec(
        seed=2, hidden=256, intermediate=512, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64, head_width=64
    )
    release = build_release(tmp / "k256", spec)
    requests = list(all_requests().values())
    answers = {}
    print("| type | file KiB | top option agrees with f32 | max abs dp |")
    print("|---|---:|---:|---:|")
    for file_type in TYPES:
        path = clef_gguf.convert(release, tmp / f"k256-{file_type}.gguf", file_type)
        with clef_gguf.load(path, max_prompt_tokens=8192) as model:
            answers[file_type] = [model.decide(r) for r in requests]
        same = decisive = 0
        worst = 0.0
        for ref, other in zip(answers["f32"], answers[file_type], strict=True):
            s, d, w = agreement(ref, other)
            same, decisive, worst = same + s, decisive + d, max(worst, w)
        print(f"| {file_type} | {path.stat().st_size / 1024:.0f} | {same}/{decisive} | {worst:.4f} |")


def big_conversion(tmp: Path, gib: float) -> None:
    from clef_gguf.testing.release_builder import ReleaseSpec, build_release

    layers = max(4, int(gib * 16) // 4 * 4)  # ~17M float32 parameters a layer
    spec = ReleaseSpec(seed=3, hidden=1024, intermediate=4096, heads=8, kv_heads=2, head_dim=128, layers=layers,
                       linear_key_heads=8, linear_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
                       head_width=256, max_shard_bytes=1 << 30)  # fmt: skip
    t = time.perf_counter()
    release = build_release(tmp / "big", spec)
    size = sum(p.stat().st_size for p in release.glob("*.safetensors"))
    built = time.perf_counter() - t
    print(f"\nsynthetic release: {layers} layers, hidden 1024, {size / 2**30:.2f} GiB of safetensors (built in {built:.0f} s)")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(release), str(tmp / "big.gguf"), "q4_k_m"], capture_output=True, text=True
    )
    if out.returncode:
        raise SystemExit(out.stderr)
    run = json.loads(out.stdout.strip().splitlines()[-1])
    rss, out_mib = run["peak_rss_mib"], (tmp / "big.gguf").stat().st_size / 2**20
    ratio = rss / (size / 2**20)
    print(
        f"convert to q4_k_m: {run['seconds']:.1f} s, peak RSS {rss:.0f} MiB ({ratio:.2f} x the release), output {out_mib:.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-gib", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        per_type(Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        big_conversion(Path(tmp), args.big_gib)


if __name__ == "__main__":
    main()
