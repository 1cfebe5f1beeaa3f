"""What the adapter benchmarks share (tools/bench/bench_adapters.py, bench_many_adapters.py, profile_adapter.py): the
fixtures (a release, its base file, PEFT fine-tunes as adapter files and merged files, built in a child process so that
torch's threads stay out of the measuring one), cheap variants of an adapter file, the request, and clients on a
server's keep-alive connections."""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from .processes import HOST, free_port, percentile, wait_healthy
from .release_builder import BENCHMARK, ReleaseSpec

NAMES = ("routing", "triage", "moderation", "urgency")
TICKET = "My order #{n} arrived broken and the courier left it in the rain; I want a refund or a replacement today."
QUESTIONS = {
    "complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
    "intent": {"type": "choice", "criteria": {"refund": "Money back", "replacement": None, "information": None}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}
# The wider fixture: the benchmark one at hidden 1024 (Clef-flash's 4096 over 4), so that a rank-16 adapter is
# Clef-flash's r 64 in proportion and the layers' arithmetic, not their node count, is most of a decode.
WIDE = replace(BENCHMARK, hidden=1024, intermediate=2048)
FIXTURES: dict[str, ReleaseSpec] = {"benchmark": BENCHMARK, "wide": WIDE}
LINEARS = "q_proj|k_proj|v_proj|o_proj|in_proj_qkv|in_proj_z|in_proj_a|in_proj_b|out_proj|gate_proj|up_proj|down_proj"
TARGETS = rf".*language_model.*\.({LINEARS})"  # every linear clef-finetune targets (discover_lora_targets)


def build(out: Path, fixture: str, file_type: str, ranks: dict[str, int], merged: bool) -> None:
    """(in a child) The fixture's release, its base file, and one PEFT fine-tune per name of `ranks` (random LoRA of
    that rank, a head of its own) as an f16 adapter file NAME.adapter.gguf and, with `merged`, NAME-merged.gguf."""
    import clef_gguf
    from clef_gguf.conversion.adapter import convert_adapter
    from clef_gguf.testing.finetune import peft_checkpoint
    from clef_gguf.testing.release_builder import build_release

    release = build_release(out / "release", FIXTURES[fixture])
    clef_gguf.convert(release, out / "base.gguf", file_type, mmproj=False)
    for i, (name, rank) in enumerate(ranks.items()):
        lora = {"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
        checkpoint = peft_checkpoint(release, out / name, lora, {"prior_logit_scale": 0.1 * (i + 1)}, seed=i)
        convert_adapter(checkpoint, release, out / f"{name}.adapter.gguf", "f16")
        if merged:
            clef_gguf.convert(checkpoint, out / f"{name}-merged.gguf", file_type, base=release, mmproj=False)
        shutil.rmtree(out / name)


def checkpoint(out: Path, rank: int, seed: int) -> None:
    """(in a child) One PEFT fine-tune of out/release (built by build) in clef-finetune's layout: out/tune/."""
    from clef_gguf.testing.finetune import peft_checkpoint

    lora = {"r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS}
    made = peft_checkpoint(out / "release", out / "tune-work", lora, {"prior_logit_scale": 0.3}, seed=seed)
    shutil.copytree(made, out / "tune")
    shutil.rmtree(out / "tune-work")


def checkpoint_in_child(out: Path, rank: int, seed: int = 99) -> Path:
    """checkpoint() in a child process, unless out/tune exists: the checkpoint's folder."""
    if not (out / "tune").exists():
        code = "import sys; from pathlib import Path; from clef_gguf.testing.adapter_bench import checkpoint; "
        code += "checkpoint(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
        subprocess.run([sys.executable, "-c", code, str(out), str(rank), str(seed)], check=True)
    return out / "tune"


def build_in_child(out: Path, fixture: str, file_type: str, ranks: dict[str, int], merged: bool) -> None:
    """build() in a child process, unless out holds its base file already."""
    if (out / "base.gguf").exists():
        return
    code = "import sys, json; from pathlib import Path; from clef_gguf.testing.adapter_bench import build; "
    code += "build(Path(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5] == '1')"
    args = [str(out), fixture, file_type, json.dumps(ranks), "1" if merged else "0"]
    subprocess.run([sys.executable, "-c", code, *args], check=True)


def variants(sources: list[Path], folder: Path, count: int) -> list[str]:
    """`count` distinct adapter files in `folder` (adapter-000.adapter.gguf ...), each a copy of one of `sources` with the
    first f16 value of its first lora_b tensor changed: a version of its own (its bytes' identity), as cheap to make
    as a copy, and deciding as that source does. Their names, in order."""
    import numpy as np
    from gguf import GGUFReader

    folder.mkdir(parents=True, exist_ok=True)
    offsets = {}
    for source in sources:
        reader = GGUFReader(source)
        tensor = next(t for t in reader.tensors if t.name.endswith(".lora_b"))
        offsets[source] = (tensor.data_offset, np.frombuffer(bytes(tensor.data.reshape(-1)[:1].tobytes()), np.float16)[0])
    names = []
    for k in range(count):
        source = sources[k % len(sources)]
        name = f"adapter-{k:03d}"
        target = folder / f"{name}.adapter.gguf"
        shutil.copyfile(source, target)
        offset, value = offsets[source]
        with open(target, "r+b") as f:
            f.seek(offset)
            f.write(np.float16(float(value) + 1e-3 * (k + 1)).tobytes())
        names.append(name)
    return names


def body(n: int, model: str | None) -> bytes:
    """A request of a distinct state (n), for `model` (None: the served file's own)."""
    request = {"state": {"ticket": TICKET.format(n=n)}, "questions": QUESTIONS} | ({"model": model} if model else {})
    return json.dumps(request).encode()


def server(stack: ExitStack, model: Path, *args: str) -> tuple[int, int]:
    """`clef-gguf serve MODEL ARGS` at its default threads: (port, pid)."""
    port = free_port()
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(model), "--port", str(port), "--ctx", "2048", *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(process.wait, 60)
    stack.callback(process.terminate)
    wait_healthy(f"http://{HOST}:{port}", process, 300)
    return port, process.pid


ModelOf = Callable[[int, int], str | None]  # (client, its request) -> the model it asks for


def clients(port: int, per_client: int, n_clients: int, model_of: ModelOf) -> dict[str, dict[str, float]]:
    """n_clients threads, each on a keep-alive connection, sending per_client distinct requests, request k of client c
    for model_of(c, k). Throughput, p50 and p99 of all, and of each client's."""
    latencies: dict[int, list[float]] = {c: [] for c in range(n_clients)}
    errors = [0]
    lock = threading.Lock()

    def client(c: int) -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=600)
        for k in range(per_client):
            started = time.perf_counter()
            request = body(c * 100_000 + k, model_of(c, k))
            connection.request("POST", "/v1/systemone", request, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            with lock:
                latencies[c].append(time.perf_counter() - started)
                errors[0] += response.status != 200
        connection.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - started

    def summary(values: list[float]) -> dict[str, float]:
        return {"rps": len(values) / seconds, "p50_ms": percentile(values, 50) * 1e3, "p99_ms": percentile(values, 99) * 1e3}

    every = [v for c in latencies.values() for v in c]
    return {"all": summary(every) | {"errors": errors[0]}} | {str(c): summary(v) for c, v in latencies.items()}
