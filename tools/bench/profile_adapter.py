"""Where an adapter's cost goes in one request: its nodes' fixed cost against its arithmetic.

    python tools/bench/profile_adapter.py [--fixture benchmark|wide] [--ranks 1 16 64] [--rounds 15] [--type q4_k_m]
        [--batch 1 2] [--threads N]
        [--only NAME --rounds 3]   # one model's requests alone (base, r1, r16 ...): for valgrind --tool=callgrind

In process, a batch of --batch distinct requests at a time (state cache off; default: one, and two as a server
batches them) at the default threads: the fixture's --type base, and over it one PEFT fine-tune per rank of --ranks
as an f16 adapter (random LoRA on every linear clef-finetune targets), each batch decided by the base and by each
adapter in turn (interleaved: a loaded machine's drift falls on each alike), medians of wall and process CPU time,
and the prefill alone (the prompts' embeddings and their llama_decode, with the adapter applied). A batch's prefill is
one llama_decode, as the server's is: the base's cost per token falls with the batch's tokens, an adapter's products
do not (their kernels' cost is per output value). Beside them, from the files: the LoRA pairs (each adds four
graph nodes to a decode: two products, a scale and an add, llama.cpp's build_lora_mm) and the multiply-adds the
pairs add per token against the base's linears. A cost that does not grow with the rank is the nodes'; the rest is
the products'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from clef_gguf.testing.adapter_bench import FIXTURES, body, build_in_child


def arithmetic(base: Path, adapter: Path) -> dict[str, float]:
    """The adapter's LoRA pairs, and the multiply-adds per token its products add over the base's linears they wrap."""
    from gguf import GGUFReader

    shapes = {t.name: [int(d) for d in t.shape] for t in GGUFReader(base).tensors}
    pairs, lora_macs, linear_macs = 0, 0, 0
    for t in GGUFReader(adapter).tensors:
        if t.name.endswith(".lora_a"):
            pairs += 1
            weight = t.name.removesuffix(".lora_a")
            n_in, rank = (int(d) for d in t.shape)
            n_out = shapes[weight][1]
            lora_macs += rank * (n_in + n_out)
            linear_macs += n_in * n_out
    all_linear = sum(s[0] * s[1] for name, s in shapes.items() if name.startswith("blk.") and len(s) == 2)
    macs = {"macs_over_wrapped": lora_macs / linear_macs, "macs_over_blocks": lora_macs / all_linear}
    return {"pairs": pairs, "added_nodes": 4 * pairs} | macs


def timed_round(model: Any, requests: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(wall, process CPU, prefill wall) seconds of one batch's decisions on the compute thread, as Decider.decide
    runs them; the prefill (the prompts' embeddings and their llama_decode) is the backbone's part."""

    def run() -> tuple[float, float, float]:
        decider = model.decider
        wall, cpu = time.perf_counter(), time.process_time()
        prompts = [decider.check(model.encode(request)) for request in requests]
        head = decider.activate(prompts[0])
        started = time.perf_counter()
        hidden = decider.prefill.hidden_states(prompts)
        decode = time.perf_counter() - started
        decider.answers(head, prompts, hidden)
        return time.perf_counter() - wall, time.process_time() - cpu, decode

    return model.compute(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", choices=sorted(FIXTURES), default="benchmark")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--type", default="q4_k_m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2], help="requests decided together")
    parser.add_argument("--threads", type=int, help="llama.cpp's threads (default: its own)")
    parser.add_argument("--only", help="decide only this model's requests (base or rN)")
    parser.add_argument("--out", type=Path, help="keep the files here (default: a temporary folder)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="profile-adapter-"))
    ranks = {f"r{r}": r for r in args.ranks}
    build_in_child(out, args.fixture, args.type, ranks, merged=False)

    import clef_gguf

    adapters = {name: out / f"{name}.adapter.gguf" for name in ranks}
    kinds = [args.only] if args.only else ["base", *ranks]
    runs = [(kind, b) for b in args.batch for kind in kinds]
    times: dict[tuple[str, int], list[tuple[float, float, float]]] = {run: [] for run in runs}
    options = {"max_prompt_tokens": 2048, "adapters": adapters, "max_adapters": len(ranks), "state_cache": 0}
    options |= {"parallel": max(args.batch), "n_threads": args.threads}
    with clef_gguf.load(out / "base.gguf", **options) as model:
        tokens = len(model.encode(json.loads(body(0, None))).tokens)
        for r in range(args.rounds + 1):
            for kind, b in runs if r % 2 == 0 else runs[::-1]:
                requests = [json.loads(body(r * 100 + i, None if kind == "base" else kind)) for i in range(b)]
                sample = timed_round(model, requests)
                if r:  # round 0 loads and warms
                    times[(kind, b)].append(sample)
    report: dict[str, Any] = {"fixture": args.fixture, "type": args.type, "tokens": tokens, "rounds": args.rounds}
    for (kind, b), samples in times.items():
        wall, cpu, decode = (statistics.median(s[i] for s in samples) * 1e3 for i in range(3))
        row = report.setdefault(kind, {})[f"batch_{b}"] = {"wall_ms": wall, "cpu_ms": cpu, "prefill_ms": decode}
        if kind != "base" and ("base", b) in times:
            row["prefill_over_base"] = decode / report["base"][f"batch_{b}"]["prefill_ms"]
    for kind in ranks:
        if kind in report:
            report[kind] |= arithmetic(out / "base.gguf", adapters[kind])
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
