"""Many adapters from a folder: a Zipf workload over 100 of them, first use and reload after eviction, a hot adapter
beside a cold one.

    python tools/bench/bench_many_adapters.py [--adapters 100] [--max-adapters 8] [--clients 8] [--per-client 20]
        [--zipf 1.0] [--rounds 8] [--type q4_k_m] [--rank 4] [--fixture benchmark] [--out DIR] [--hot-cold] [--hub]

On the benchmark fixture (hidden 256, 8 layers) as a --type base, four PEFT fine-tunes of rank --rank (random LoRA on
every linear clef-finetune targets, a head of their own) as f16 adapter files, and --adapters distinct files in one
folder made from them (testing/adapter_bench.variants: each a version of its own, deciding as its source does). Then,
in one run, on one `serve BASE --adapter-dir DIR --max-adapters N` at the default threads (distinct states: no state
cache hit):

- --clients clients each sending --per-client requests, each for an adapter drawn from a Zipf law of exponent --zipf
  over the files (rank k with weight 1/k^s), against the same clients spread over 4 adapters (all loaded) and all on
  one adapter; with the draws' misses of an LRU of N (the loads the sequence needs, served in order);
- a hot adapter beside a cold one: --clients clients on one adapter and 1 on another, the cold one's p99 against its
  own alone (and one client of the base alone: one request at a time, with and without an adapter).

And in process, one request at a time (state cache off, --max-adapters 1, so that each new name evicts the last):
an adapter's first use (its file read into a private copy, checked in full, loaded into llama.cpp, then decided),
its reload after eviction (read again and matched on its signature and the identity of its bytes, not checked
again), and a request to the loaded adapter; medians of --rounds adapters. With --hub, also first use from a local
stand-in of the Hugging Face Hub (`serve --adapter-source hf://ORG`'s way): an adapter file, and a clef-finetune
checkpoint converted on the way.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from collections import OrderedDict
from contextlib import ExitStack
from pathlib import Path

from clef_gguf.testing.adapter_bench import FIXTURES, NAMES, body, build_in_child, checkpoint_in_child, clients, server, variants


def zipf_draws(names: list[str], exponent: float, n_clients: int, per_client: int) -> list[list[str]]:
    """Each client's adapters, drawn by a Zipf law over `names` in order (seeded: the same every run)."""
    weights = [1 / (k + 1) ** exponent for k in range(len(names))]
    return [random.Random(c).choices(names, weights, k=per_client) for c in range(n_clients)]


def lru_misses(draws: list[list[str]], capacity: int) -> tuple[int, int]:
    """(misses, requests) of an LRU of `capacity` over the draws interleaved round-robin, as the clients send them."""
    cache: OrderedDict[str, None] = OrderedDict()
    misses = total = 0
    for k in range(max(map(len, draws))):
        for client in draws:
            if k < len(client):
                total += 1
                name = client[k]
                if name in cache:
                    cache.move_to_end(name)
                    continue
                misses += 1
                cache[name] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return misses, total


def served(base: Path, folder: Path, names: list[str], args: argparse.Namespace) -> dict[str, object]:
    """The workloads on one server of the folder."""
    report: dict[str, object] = {}
    per, n = args.per_client, args.clients
    with ExitStack() as stack:
        port, _ = server(stack, base, "--adapter-dir", str(folder), "--max-adapters", str(args.max_adapters))
        clients(port, 2, n, lambda c, k: names[c % 4])  # warm: 4 adapters loaded, the process's first decodes done
        if not args.hot_cold:
            report |= throughput(port, names, args)
        report["one_client_base"] = clients(port, per, 1, lambda c, k: None)["0"]
        report["cold_alone"] = clients(port, per, 1, lambda c, k: names[1])["0"]  # (also: one client, one adapter)
        both = clients(port, per, n + 1, lambda c, k: names[1] if c == n else names[0])
        report["hot_and_cold"] = {"hot": {"rps": sum(both[str(c)]["rps"] for c in range(n))}, "cold": both[str(n)]}
    return report


def throughput(port: int, names: list[str], args: argparse.Namespace) -> dict[str, object]:
    """One adapter, four, and the Zipf draws: each --clients clients of --per-client requests."""
    report: dict[str, object] = {}
    per, n = args.per_client, args.clients
    report["one_adapter"] = clients(port, per, n, lambda c, k: names[0])["all"]
    report["four_adapters"] = clients(port, per, n, lambda c, k: names[c % 4])["all"]
    draws = zipf_draws(names, args.zipf, n, per)
    misses, total = lru_misses(draws, args.max_adapters)
    distinct = len({d for client in draws for d in client})
    zipf = clients(port, per, n, lambda c, k: draws[c][k])["all"]
    report["zipf"] = zipf | {"distinct_adapters": distinct, "lru_misses": misses, "requests": total}
    return report


def first_use(base: Path, folder: Path, names: list[str], rounds: int) -> dict[str, float]:
    """In process, one at a time: first use, reload after eviction and a loaded adapter's request (ms, medians)."""
    import clef_gguf

    timed: dict[str, list[float]] = {"first_use": [], "loaded": [], "reload_after_eviction": [], "base": []}

    def decide(kind: str, n: int, name: str | None) -> None:
        started = time.perf_counter()
        model.decide(json.loads(body(n, name)))
        timed[kind].append(time.perf_counter() - started)

    picked = names[4 : 4 + rounds]  # (not the four the server's workloads used first: no page cache advantage)
    with clef_gguf.load(base, max_prompt_tokens=2048, adapter_dir=folder, max_adapters=1, state_cache=0) as model:
        decide("base", 0, None)  # warm: the first decode's allocations
        for i, name in enumerate(picked):
            decide("first_use", 10 * i, name)
            decide("loaded", 10 * i + 1, name)
            decide("base", 10 * i + 2, None)
        for i, name in enumerate(picked):  # each evicted by the next (max_adapters 1)
            decide("reload_after_eviction", 10 * i + 3, name)
            decide("loaded", 10 * i + 4, name)
    return {f"{k}_ms": statistics.median(v) * 1e3 for k, v in timed.items()}


def first_use_hub(out: Path, names: list[str], rank: int, rounds: int) -> dict[str, float]:
    """In process, one at a time, from a local stand-in of the Hugging Face Hub (testing/hub.Hub, the real client
    pointed at it): an adapter file's first use (downloaded, checked, loaded, decided) and a clef-finetune
    checkpoint's (downloaded, converted over the release, checked, loaded, decided), against a loaded adapter's
    request (ms, medians of --rounds repositories each; a fresh disk cache)."""
    import os

    import clef_gguf
    from clef_gguf.testing.hub import Hub

    tune = checkpoint_in_child(out, rank)
    hub = Hub(Path(tempfile.mkdtemp(prefix="hub-", dir=out)))
    for i, name in enumerate(names[4 + rounds : 4 + 2 * rounds]):
        shutil.copyfile(out / "adapters" / f"{name}.adapter.gguf", hub.repo("acme", f"file-{i}") / "tune.adapter.gguf")
        shutil.copytree(tune, hub.repo("acme", f"tune-{i}"), dirs_exist_ok=True)
        with open(hub.repo("acme", f"tune-{i}") / "adapter" / "README.md", "w") as f:
            f.write(f"copy {i}\n")  # (another repository revision; the same fine-tune)
    os.environ["HF_ENDPOINT"], os.environ["HF_HUB_CACHE"] = hub.url, tempfile.mkdtemp(prefix="hf-", dir=out)
    timed: dict[str, list[float]] = {"hub_file_first_use": [], "hub_checkpoint_first_use": [], "loaded": []}
    options = {"adapter_sources": ["hf://acme"], "adapter_base_release": out / "release", "state_cache": 0}
    cache = tempfile.mkdtemp(prefix="adapter-cache-", dir=out)
    try:
        with clef_gguf.load(out / "base.gguf", max_prompt_tokens=2048, adapter_cache=cache, **options) as model:
            model.decide(json.loads(body(0, None)))
            for i in range(rounds):
                for kind, repo in (("hub_file_first_use", f"file-{i}"), ("hub_checkpoint_first_use", f"tune-{i}")):
                    for key in (kind, "loaded"):
                        started = time.perf_counter()
                        model.decide(json.loads(body(100 + i, f"acme/{repo}")))
                        timed[key].append(time.perf_counter() - started)
    finally:
        hub.close()
    return {f"{k}_ms": statistics.median(v) * 1e3 for k, v in timed.items()} | {"downloads": sum(hub.downloads.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--adapters", type=int, default=100)
    parser.add_argument("--max-adapters", type=int, default=8)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--per-client", type=int, default=20)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=8, help="first use and reload: adapters timed")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--type", default="q4_k_m")
    parser.add_argument("--fixture", choices=sorted(FIXTURES), default="benchmark")
    parser.add_argument("--out", type=Path, help="keep the files here (default: a temporary folder)")
    parser.add_argument("--hot-cold", action="store_true", help="only the hot adapter beside the cold one")
    parser.add_argument("--hub", action="store_true", help="also first use from a local Hub stand-in")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-many-adapters-"))
    started = time.perf_counter()
    build_in_child(out, args.fixture, args.type, dict.fromkeys(NAMES, args.rank), merged=False)
    names = variants([out / f"{n}.adapter.gguf" for n in NAMES], out / "adapters", args.adapters)
    report: dict[str, object] = {"fixture": args.fixture, "rank": args.rank, "type": args.type, "zipf": args.zipf}
    report["build_s"] = time.perf_counter() - started
    report |= served(out / "base.gguf", out / "adapters", names, args)
    cold, alone = report["hot_and_cold"]["cold"], report["cold_alone"]  # type: ignore[index]
    ratios = {
        "cold_p99_beside_hot_over_alone": cold["p99_ms"] / alone["p99_ms"],
        "one_client_adapter_over_base_p50": alone["p50_ms"] / report["one_client_base"]["p50_ms"],  # type: ignore[index]
    }
    if args.hub:
        report["hub"] = first_use_hub(out, names, args.rank, args.rounds)
    if not args.hot_cold:
        report["in_process"] = first_use(out / "base.gguf", out / "adapters", names, args.rounds)
        z, four, one = report["zipf"], report["four_adapters"], report["one_adapter"]
        ratios["zipf_over_one_adapter_rps"] = z["rps"] / one["rps"]  # type: ignore[index]
        ratios["zipf_over_four_adapters_rps"] = z["rps"] / four["rps"]  # type: ignore[index]
    report["ratios"] = ratios
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
