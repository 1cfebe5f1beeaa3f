"""Benchmark a decision (backbone + native head) against bare llama.cpp, in one run, on one fixture.

Writes a markdown table and a PNG plot (docs/benchmarks/ by default), each ratio
measured in this run on the same random Clef release (hidden >= 256, >= 8 layers):

  (a) decision latency (ClefModel.decide: encode, prefill, head, response) over llama.cpp's
      bare prefill of the same tokens (the backbone as a plain qwen35 GGUF loaded by path,
      a token batch, embeddings on, pooling none, the same n_ctx / n_batch / n_ubatch and
      threads) at 512, 2k, 8k and 16k tokens; targets <= 1.10 at 512, <= 1.05 from 2k;
  (b) 64 questions over 1 question, same state; target <= 1.3;
  (c) decision latency over the reference (transformers + torch, float32, CPU);
  (d) peak RSS of a process that loads and decides, over one that loads the backbone in
      llama.cpp and prefills the same tokens.

Timings are the best of --repeats runs, ours and bare llama.cpp interleaved (a shared
machine's load then hits both alike). Needs the test dependencies (bash tools/test.sh)
and matplotlib (pip install -e ".[bench]"); (c) is skipped where torch is missing.

    python tools/bench/bench_head.py [--n-gpu-layers -1] [--sizes 512 2048 8192 16384] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clef_gguf.testing.bench import cpu_name, interleaved

if TYPE_CHECKING:
    from clef_gguf.testing.bare_llama import BareLlama

ROOT = Path(__file__).resolve().parents[2]

SHORT_TARGET, LONG_TARGET = 1.10, 1.05  # (a) at 512 tokens, and from 2k


@dataclass
class Results:
    machine: str
    device: str
    date: str
    fixture: str
    threads: int
    n_ctx: int
    prefill: list[dict[str, float]] = field(default_factory=list)  # (a), one row per size
    questions: dict[str, float] = field(default_factory=dict)  # (b)
    oracle: list[dict[str, float]] = field(default_factory=list)  # (c)
    rss: dict[str, float] = field(default_factory=dict)  # (d)


# --- Requests -------------------------------------------------------------------------------------------
def state_of(model: Any, tokens: int) -> str:
    """The longest state text whose prompt (with the long-state questions) has at most `tokens` tokens."""
    from clef_gguf.testing.request_suite import long_state_request, long_state_text

    def fits(paragraphs: int) -> bool:
        return len(model.encode(long_state_request(paragraphs)).tokens) <= tokens

    low, high = 1, 2
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:  # fits(low), not fits(high)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return long_state_text(low)


def request_with(state: str, questions: dict[str, Any]) -> dict[str, Any]:
    return {"model": "bench", "state": state, "questions": questions}


def long_state_questions() -> dict[str, Any]:
    from clef_gguf.testing.request_suite import long_state_request

    return long_state_request(1)["questions"]


def many_questions(count: int) -> dict[str, Any]:
    from clef_gguf.testing.request_suite import many_questions_request

    return dict(list(many_questions_request(64)["questions"].items())[:count])


# --- Measuring ------------------------------------------------------------------------------------------
def measure_prefill(model: Any, bare: BareLlama, sizes: list[int], repeats: int) -> list[dict[str, float]]:
    rows = []
    for size in sizes:
        request = request_with(state_of(model, size), long_state_questions())
        prompt = model.encode(request)
        hidden = model.backbone.hidden_states(prompt.tokens)
        n = max(1, repeats if size <= 2048 else repeats // 2)
        t = interleaved(
            {
                "bare": lambda p=prompt: bare.prefill(p.tokens),
                "decide": lambda r=request: model.decide(r),
                "head": lambda h=hidden, p=prompt: model.head(h, p),
            },
            n,
        )
        rows.append({"tokens": len(prompt.tokens), **{k: v * 1000 for k, v in t.items()}, "ratio": t["decide"] / t["bare"]})
        print(f"(a) {len(prompt.tokens):6d} tokens: {rows[-1]}", flush=True)
    return rows


def measure_questions(model: Any, bare: BareLlama, state_tokens: int, repeats: int) -> dict[str, float]:
    """64 questions add their schema to the prompt: bare llama.cpp's prefill of the same two prompts shows that share."""
    state = state_of(model, state_tokens)
    one, many = request_with(state, many_questions(1)), request_with(state, many_questions(64))
    p1, p64 = model.encode(one), model.encode(many)
    t = interleaved(
        {
            "one": lambda: model.decide(one),
            "many": lambda: model.decide(many),
            "bare_one": lambda: bare.prefill(p1.tokens),
            "bare_many": lambda: bare.prefill(p64.tokens),
        },
        repeats,
    )
    h1, h64 = model.backbone.hidden_states(p1.tokens), model.backbone.hidden_states(p64.tokens)
    head = interleaved({"one": lambda: model.head(h1, p1), "many": lambda: model.head(h64, p64)}, repeats)
    out = {
        "tokens_1": len(p1.tokens),
        "tokens_64": len(p64.tokens),
        "ms_1": t["one"] * 1000,
        "ms_64": t["many"] * 1000,
        "ratio": t["many"] / t["one"],
        "bare_ms_1": t["bare_one"] * 1000,
        "bare_ms_64": t["bare_many"] * 1000,
        "bare_ratio": t["bare_many"] / t["bare_one"],
        "head_ms_1": head["one"] * 1000,
        "head_ms_64": head["many"] * 1000,
    }
    print(f"(b) {out}", flush=True)
    return out


def measure_oracle(model: Any, release: Path, sizes: list[int], repeats: int, threads: int) -> list[dict[str, float]]:
    try:
        import torch

        from clef_gguf.testing.oracle import Oracle
    except ImportError:
        print("(c) skipped: torch / transformers are not installed", flush=True)
        return []
    torch.set_num_threads(threads)
    oracle = Oracle(release)
    rows = []
    for size in sizes:
        request = request_with(state_of(model, size), long_state_questions())
        t = interleaved({"decide": lambda r=request: model.decide(r), "oracle": lambda r=request: oracle.answer(r)}, repeats)
        tokens = len(model.encode(request).tokens)
        ms = {k: v * 1000 for k, v in t.items()}
        rows.append({"tokens": tokens, **ms, "ratio": t["decide"] / t["oracle"]})
        print(f"(c) {rows[-1]}", flush=True)
    return rows


# Peak RSS from VmHWM: ru_maxrss would carry the parent's peak over fork + exec.
RSS_CHILD = r"""
import json, sys
mode, path, n_ctx, gpu, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
request = json.loads(sys.stdin.read())
if mode == "clef":
    import clef_gguf
    # One batch, as the bare side.
    model = clef_gguf.load(path, n_gpu_layers=gpu, max_prompt_tokens=n_ctx, n_threads=threads, ubatch=n_ctx)
    model.decide(request["request"])
else:
    from clef_gguf.testing.bare_llama import BareLlama
    BareLlama(path, n_ctx, gpu, threads).prefill(request["tokens"])
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"peak_rss_mib": int(hwm.split()[1]) / 1024}))
"""


def measure_rss(model: Any, clef: Path, plain: Path, size: int, n_ctx: int, gpu: int, threads: int) -> dict[str, float]:
    request = request_with(state_of(model, size), long_state_questions())
    payload = json.dumps({"request": request, "tokens": model.encode(request).tokens})

    def child(mode: str, path: Path) -> float:
        args = [sys.executable, "-c", RSS_CHILD, mode, str(path), str(n_ctx), str(gpu), str(threads)]
        out = subprocess.run(args, input=payload, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]

    ours, bare = child("clef", clef), child("plain", plain)
    out = {"tokens": len(model.encode(request).tokens), "clef_mib": ours, "bare_mib": bare, "ratio": ours / bare}
    print(f"(d) {out}", flush=True)
    return out


# --- Report ---------------------------------------------------------------------------------------------
def machine() -> str:
    cpu = cpu_name() or platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.1f} at start"


def markdown(r: Results) -> str:
    return "\n".join(setting_and_prefill(r) + questions_and_oracle(r) + rss_section(r))


def setting_and_prefill(r: Results) -> list[str]:
    """The heading, the run's setting, and (a)."""
    lines = [
        f"# Native head benchmark: {r.device}",
        "",
        f"- date: {r.date}",
        f"- machine: {r.machine}",
        f"- fixture: {r.fixture}",
        f"- context: n_ctx = n_batch = n_ubatch = {r.n_ctx} for both sides, {r.threads} threads, embeddings on, pooling none",
        "- best of several runs, ours and bare llama.cpp interleaved, all in one run of `python tools/bench/bench_head.py`",
        "",
        "## (a) Decision latency over llama.cpp's bare prefill of the same tokens",
        "",
        "| tokens | bare prefill (ms) | decision (ms) | of which the head (ms) | head / bare | ratio | target |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in r.prefill:
        target = SHORT_TARGET if row["tokens"] < 1024 else LONG_TARGET
        lines.append(
            f"| {row['tokens']:.0f} | {row['bare']:.1f} | {row['decide']:.1f} | {row['head']:.1f} | "
            f"{row['head'] / row['bare']:.3f} | **{row['ratio']:.3f}** | <= {target:.2f} |"
        )
    lines += [
        "",
        "Bare llama.cpp computes its LM head's logits for every prompt token even with embeddings on; clef-gguf's lean",
        "backbone view does not (README), which can make a decision cheaper than the bare prefill. The head's own cost",
        "is the *head / bare* column.",
    ]
    return lines


def questions_and_oracle(r: Results) -> list[str]:
    """(b) and (c)."""
    q = r.questions
    lines = [
        "",
        "## (b) 64 questions over 1 question, same state",
        "",
        "| questions | prompt tokens | decision (ms) | of which the head (ms) | bare prefill of the same prompt (ms) |",
        "| ---: | ---: | ---: | ---: | ---: |",
        f"| 1 | {q['tokens_1']:.0f} | {q['ms_1']:.1f} | {q['head_ms_1']:.1f} | {q['bare_ms_1']:.1f} |",
        f"| 64 | {q['tokens_64']:.0f} | {q['ms_64']:.1f} | {q['head_ms_64']:.1f} | {q['bare_ms_64']:.1f} |",
        "",
        f"Ratio **{q['ratio']:.3f}** (target <= 1.3). The 64 questions' schema adds "
        f"{q['tokens_64'] - q['tokens_1']:.0f} prompt tokens ({q['tokens_64'] / q['tokens_1']:.2f}x the prompt): "
        f"bare llama.cpp's prefill alone grows {q['bare_ratio']:.3f}x, so the head's own share of the ratio is "
        f"{q['ratio'] / q['bare_ratio']:.3f}.",
        "",
        "## (c) Decision latency over the reference (transformers + torch, float32, CPU)",
        "",
    ]
    if r.oracle:
        lines += ["| tokens | decision (ms) | reference (ms) | ratio |", "| ---: | ---: | ---: | ---: |"]
        lines += [f"| {o['tokens']:.0f} | {o['decide']:.1f} | {o['oracle']:.1f} | **{o['ratio']:.3f}** |" for o in r.oracle]
    else:
        lines.append("Not measured: torch / transformers are not installed on this machine.")
    return lines


def rss_section(r: Results) -> list[str]:
    """(d)."""
    d = r.rss
    return [
        "",
        "## (d) Peak RSS, load + one decision, against bare llama.cpp (load + prefill)",
        "",
        "| prompt tokens | clef-gguf (MiB) | bare llama.cpp (MiB) | ratio |",
        "| ---: | ---: | ---: | ---: |",
        f"| {d['tokens']:.0f} | {d['clef_mib']:.1f} | {d['bare_mib']:.1f} | **{d['ratio']:.3f}** |",
        "",
    ]


def plot(r: Results, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [row["tokens"] for row in r.prefill]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("bare", "bare llama.cpp prefill"), ("decide", "decision (clef-gguf)"), ("head", "native head alone")):
        left.plot(tokens, [row[key] for row in r.prefill], marker="o", label=label)
    left.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="ms (best of several)", title=f"Latency on {r.device}")
    left.legend()
    right.plot(tokens, [row["ratio"] for row in r.prefill], marker="o", label="(a) decision / bare prefill")
    right.axhline(1.10, color="gray", linestyle=":", label="target 1.10 (512)")
    right.axhline(1.05, color="gray", linestyle="--", label="target 1.05 (from 2k)")
    right.set(xscale="log", xlabel="prompt tokens", ylabel="ratio", title="Decision over bare prefill")
    right.legend()
    fig.suptitle(f"{r.fixture}\n{r.date}, {r.machine}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


# --- Main -----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--type", default="f32")
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--n-gpu-layers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads, both sides (1: stable timings on a shared machine)")
    parser.add_argument("--questions-state", type=int, default=16384, help="state tokens for (b)")
    parser.add_argument("--oracle-sizes", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--rss-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    parser.add_argument("--from-json", type=Path, help="only write the table and plot again from a run's JSON")
    return parser.parse_args()


def fixture_release(args: argparse.Namespace) -> tuple[Any, str]:
    """The fixture's ReleaseSpec for the hidden width and layers asked for, and its description in the report."""
    from clef_gguf.testing.release_builder import ReleaseSpec

    width = args.hidden // 2
    spec = ReleaseSpec(
        hidden=args.hidden,
        intermediate=2 * args.hidden,
        layers=args.layers,
        head_dim=64,
        head_width=width,
        routing_layers=6,
        head_layers=3,
        head_heads=4,
        head_feedforward=2 * width,
    )
    fixture = (
        f"random Clef release: backbone hidden {args.hidden}, {args.layers} layers (every 4th full attention), "
        f"FFN {2 * args.hidden}, {args.type}; head width {width}, 6 routing + 3 decoder layers (Clef-flash's layout), "
        f"4 heads, FFN {2 * width}"
    )
    return spec, fixture


def main() -> None:
    args = parse_args()
    if args.from_json:
        write(Results(**json.loads(args.from_json.read_text())), args.out)
        return

    import clef_gguf
    from clef_gguf.testing.bare_llama import BareLlama
    from clef_gguf.testing.release_builder import clef_and_backbone

    # Room for the largest prompt: (a)'s, or (b)'s state plus 64 questions' schema (~7k tokens with the fixture's tokenizer).
    n_ctx = max(max(args.sizes), args.questions_state + 8192) + 1024
    spec, fixture = fixture_release(args)
    with tempfile.TemporaryDirectory() as tmp:
        release, clef, plain = clef_and_backbone(Path(tmp), spec, args.type)
        # ubatch = n_ctx: one physical batch, the same context as the bare llama.cpp it is compared with.
        model = clef_gguf.load(
            clef, n_gpu_layers=args.n_gpu_layers, max_prompt_tokens=n_ctx, n_threads=args.threads, ubatch=n_ctx
        )
        bare = BareLlama(plain, n_ctx, args.n_gpu_layers, args.threads)
        results = Results(
            machine=machine(),
            device=model.head.device,
            date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            fixture=fixture,
            threads=args.threads,
            n_ctx=n_ctx,
        )
        print(f"{fixture}\nhead on {results.device}, n_ctx {n_ctx}", flush=True)
        results.prefill = measure_prefill(model, bare, args.sizes, args.repeats)
        results.questions = measure_questions(model, bare, args.questions_state, max(2, args.repeats // 3))
        bare.close()
        if args.n_gpu_layers == 0 and args.oracle_sizes:
            results.oracle = measure_oracle(model, release, args.oracle_sizes, max(2, args.repeats // 2), args.threads)
        results.rss = measure_rss(model, clef, plain, args.rss_size, n_ctx, args.n_gpu_layers, args.threads)
        model.close()
    write(results, args.out)


def write(results: Results, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = "head_" + ("cpu" if results.device == "CPU" else "gpu")
    (out / f"{stem}.md").write_text(markdown(results))
    (out / f"{stem}.json").write_text(json.dumps(asdict(results), indent=1) + "\n")
    plot(results, out / f"{stem}.png")
    print(f"wrote {out / stem}.md, .json and .png")


if __name__ == "__main__":
    main()
