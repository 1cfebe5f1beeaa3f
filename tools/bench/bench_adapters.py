"""Many fine-tunes over one base, against one merged model per fine-tune, at the default threads.

    python tools/bench/bench_adapters.py [--requests 160] [--clients 8] [--rank 64] [--type q4_k_m] [--out DIR]
        [--fixture wide --rank 16]

On the benchmark fixture (release_builder.BENCHMARK: hidden 256, 8 layers; --fixture wide: hidden 1024,
testing/adapter_bench.WIDE), four PEFT fine-tunes of rank --rank
(default 4: Clef-flash's r 64 in proportion to its width; random LoRA on every linear clef-finetune targets, and a
head of their own) are converted twice: to adapter files
(f16) over one base file of --type, and to four merged files of --type. Then, in one run:

- throughput and p99 of --clients clients spread over the 4 adapters of one server, against the same clients on one
  merged model's server (distinct states, so that the state cache does not answer);
- the cost of an adapter switch: one request at a time in process, alternating two adapters against one adapter;
- resident memory of one server with the 4 adapters, against 4 servers of the merged files.

The files are built in a child process (torch's threads would stay alive in this one: testing/fixture_files.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from clef_gguf.testing.adapter_bench import FIXTURES, NAMES, body, build_in_child, clients, server
from clef_gguf.testing.processes import memory_mib


def switch_cost(out: Path, rounds: int) -> dict[str, float]:
    """One request at a time in process (state cache off): two requests alternating two adapters, against both to
    one adapter (the median difference is what a switch costs), and both to the base (what the unmerged LoRA's
    products cost)."""
    import clef_gguf

    adapters = {n: out / f"{n}.adapter.gguf" for n in NAMES[:2]}
    with clef_gguf.load(out / "base.gguf", max_prompt_tokens=2048, adapters=adapters, state_cache=0) as model:
        timed: dict[str, list[float]] = {"one": [], "two": [], "base": []}
        for r in range(rounds):
            for kind, names in (("one", NAMES[:1] * 2), ("two", NAMES[:2]), ("base", [None, None])):
                for i, name in enumerate(names):
                    started = time.perf_counter()
                    model.decide(json.loads(body(2 * r + i, name)))
                    timed[kind].append(time.perf_counter() - started)
    one, two, base = (statistics.median(timed[k]) * 1e3 for k in ("one", "two", "base"))
    return {"base_ms": base, "one_adapter_ms": one, "alternating_ms": two, "switch_ms": two - one}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--clients", type=int, default=8)
    # Clef-flash's r 64 is 1/64 of its hidden size 4096; on this fixture's 256 that is r 4. Its r 64 (a quarter of
    # the width) makes the unmerged products a third of the layers' work: a bound, not what Clef-flash pays.
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--type", default="q4_k_m")
    parser.add_argument("--rounds", type=int, default=20, help="switch cost: rounds of two requests each way")
    parser.add_argument("--out", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--fixture", choices=sorted(FIXTURES), default="benchmark", help="wide: hidden 1024 (use --rank 16)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    build_in_child(out, args.fixture, args.type, dict.fromkeys(NAMES, args.rank), merged=True)
    report: dict[str, object] = {"fixture": args.fixture, "rank": args.rank, "type": args.type, "clients": args.clients}
    report["requests"] = args.requests
    pairs = [arg for n in NAMES for arg in ("--adapter", f"{n}={out / f'{n}.adapter.gguf'}")]
    with ExitStack() as stack:
        port, pid = server(stack, out / "base.gguf", *pairs)
        clients(port, 2, args.clients, lambda c, k: NAMES[c % 4])  # warm: every adapter loaded once
        rss = memory_mib(pid)
        per_client = args.requests // args.clients
        report["adapters_4"] = clients(port, per_client, args.clients, lambda c, k: NAMES[c % 4])["all"] | {"rss_mib": rss}
    with ExitStack() as stack:
        port, pid = server(stack, out / f"{NAMES[0]}-merged.gguf")
        clients(port, 2, args.clients, lambda c, k: None)
        report["merged_1"] = clients(port, per_client, args.clients, lambda c, k: None)["all"]
    with ExitStack() as stack:
        started = [server(stack, out / f"{n}-merged.gguf") for n in NAMES]
        for port, _ in started:
            clients(port, 2, 1, lambda c, k: None)  # warm, as the adapters' server was
        report["merged_4_servers_rss_mib"] = sum(memory_mib(pid) for _, pid in started)
    report["switch"] = switch_cost(out, args.rounds)
    a, m = report["adapters_4"], report["merged_1"]
    report["ratios"] = {
        "throughput_adapters_over_merged": a["rps"] / m["rps"],  # type: ignore[index]
        "p99_adapters_over_merged": a["p99_ms"] / m["p99_ms"],  # type: ignore[index]
        "rss_one_server_over_four": a["rss_mib"] / report["merged_4_servers_rss_mib"],  # type: ignore[index,operator]
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
