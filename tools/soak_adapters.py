"""A soak of many fine-tunes over one base while their files change under the server.

    python tools/soak_adapters.py [--minutes 10] [--clients 8] [--max-adapters 2] [--out DIR] [--json]

One `clef-gguf serve BASE --adapter-dir DIR --max-adapters 2` serves the base and 4 adapters of a folder to --clients
clients (each request picks the base or an adapter, and one of a few states, so the LRU evicts and the state cache
hits), while a script changes the folder every 1 to 4 seconds: an adapter's file is replaced by its other version
(copied over in place, or renamed over), truncated in place, deleted, or restored. Each adapter has two versions
(two fine-tunes of one base).

What must hold, and what the script checks at the end:
- the server never crashes (it is alive after the soak and stops on SIGTERM with exit 0);
- no answer is a 5xx: a request for a file that is gone, truncated or being rewritten gets a 4xx or a 503;
- every 200 is the answer of the file version its `Clef-Model-Sha256` header names: the same probabilities (within
  2e-4) as that version decides alone, in process (`clef_gguf.load(BASE, adapter=VERSION)`), and the header names a
  version that exists (the base or one of the 8 adapter files).

The files are built in a child process (torch's threads would stay alive in this one: testing/fixture_files.py).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from itertools import combinations
from pathlib import Path
from typing import Any

from clef_gguf.testing.processes import HOST, free_port, wait_healthy

NAMES = ("routing", "triage", "moderation", "urgency")
VERSIONS = 2
# A prompt decided in a batch, from the state cache, is its answer alone within float noise: a step of the 4th decimal
# for a batch (docs/runtime.md), up to 3e-4 for a cache hit (tests/test_state_cache.py); both at once, 4e-4. Versions
# of one adapter answer far more apart than that (the summary's `versions_apart`), so a mixed-up version shows.
TOLERANCE = 4e-4
HEADER = "Clef-Model-Sha256"
QUESTIONS = {
    "complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
    "intent": {"type": "choice", "criteria": {"refund": "Money back", "replacement": None, "information": None}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}
STATES = (
    "My order arrived broken and the courier left it in the rain; I want a refund today.",
    "Where can I find the invoice for my last order?",
    "The app crashes every time I open the settings page. Please fix it.",
    "Thanks, the replacement arrived and works fine.",
)


def request(state: int, model: str | None) -> dict[str, Any]:
    return {"state": {"ticket": STATES[state]}, "questions": QUESTIONS} | ({"model": model} if model else {})


def build(out: Path) -> None:
    """(in a child) The fixture release, its base file and two versions of each of 4 fine-tunes, as adapter files."""
    import clef_gguf
    from clef_gguf.conversion.adapter import convert_adapter
    from clef_gguf.testing.finetune import peft_checkpoint
    from clef_gguf.testing.release_builder import build_release

    (out / "store").mkdir(parents=True, exist_ok=True)
    release = build_release(out / "release")
    clef_gguf.convert(release, out / "base.gguf", "f32", mmproj=False)
    lora = {"r": 4, "lora_alpha": 8, "target_modules": r".*language_model.*\.(q_proj|v_proj|gate_proj|up_proj|down_proj)"}
    for i, name in enumerate(NAMES):
        for v in range(VERSIONS):
            seed = 10 * i + v
            checkpoint = peft_checkpoint(release, out / f"{name}.v{v}", lora, {"prior_logit_scale": 0.3 + seed / 10}, seed=seed)
            convert_adapter(checkpoint, release, out / "store" / f"{name}.v{v}.adapter.gguf", "f32")


class Folder:
    """The served folder, changed at random the ways an operator's tools change files."""

    def __init__(self, store: Path, served: Path, rng: random.Random) -> None:
        self.store, self.served, self.rng = store, served, rng
        self.actions: Counter[str] = Counter()
        for name in NAMES:
            shutil.copyfile(self.version(name, 0), self.path(name))

    def version(self, name: str, v: int) -> Path:
        return self.store / f"{name}.v{v}.adapter.gguf"

    def path(self, name: str) -> Path:
        return self.served / f"{name}.adapter.gguf"

    def change(self) -> None:
        name = self.rng.choice(NAMES)
        path, source = self.path(name), self.version(name, self.rng.randrange(VERSIONS))
        action = self.rng.choice(["copy over", "rename over", "truncate", "delete", "restore"])
        if action == "copy over" or (action == "restore" and not path.exists()):
            shutil.copyfile(source, path)  # in place: truncated to 0, then written (a reader may see any prefix)
        elif action == "rename over":
            temporary = path.with_name(f".{path.name}.tmp")
            shutil.copyfile(source, temporary)
            os.replace(temporary, path)
        elif action == "truncate" and path.exists():
            os.truncate(path, path.stat().st_size // 2)
        elif action == "delete" and path.exists():
            path.unlink()
        else:
            return  # (nothing to truncate, delete or restore)
        self.actions[action] += 1

    def restore_all(self) -> None:
        for name in NAMES:
            shutil.copyfile(self.version(name, 0), self.path(name))


def client(port: int, seed: int, until: float, results: list[Result]) -> None:
    rng = random.Random(seed)
    connection = http.client.HTTPConnection(HOST, port, timeout=120)
    while time.monotonic() < until:
        state, model = rng.randrange(len(STATES)), rng.choice([None, *NAMES])
        body = json.dumps(request(state, model)).encode()
        for attempt in (1, 2):  # a kept-alive connection the server closed meanwhile is tried once more, afresh
            try:
                connection.request("POST", "/v1/systemone", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                data = response.read()
                results.append((state, model, response.status, response.getheader(HEADER), data))
                if response.getheader("connection", "").lower() == "close":
                    connection.close()
                break
            except (ConnectionError, http.client.HTTPException, TimeoutError) as e:
                connection.close()
                if attempt == 2:  # (status 0: no answer at all)
                    results.append((state, model, 0, None, repr(e).encode()))


def references(base: Path, store: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """{identity: {state: [answers]}} of the base and of every version, each request decided alone, in process: once
    with its state computed (a miss) and once with it from the state cache (a hit), the two ways the server may
    decide it; they differ by float noise (tests/test_state_cache.py)."""
    import clef_gguf

    found: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for adapter in [None, *sorted(store.glob("*.adapter.gguf"))]:
        with clef_gguf.load(base, adapter=adapter, max_prompt_tokens=2048) as model:
            found[model.identity] = {s: [model.decide(request(s, None))["answers"] for _ in (0, 1)] for s in range(len(STATES))}
    return found


def error_type(data: bytes) -> str:
    """A refusal's error_type (System One's `detail`), or what the body was."""
    try:
        detail = json.loads(data)["detail"]
    except (ValueError, KeyError, TypeError):
        return "no JSON detail"
    return detail.get("error_type", "?") if isinstance(detail, dict) else "invalid"


def differs(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest |dp| between two answers' probabilities (noul's p(true) included)."""
    largest = 0.0
    for qid, answer in a.items():
        other = b[qid]
        ours = answer.get("probabilities", {"p": answer.get("noul", 0.0)})
        theirs = other.get("probabilities", {"p": other.get("noul", 0.0)})
        largest = max(largest, *(abs(ours[k] - theirs[k]) for k in ours))
    return largest


Result = tuple[int, str | None, int, str | None, bytes]  # (state, model asked, status, Clef-Model-Sha256, body)


def run_server(args: argparse.Namespace, out: Path, folder: Folder) -> tuple[list[Result], bool, int]:
    """The soak itself: the server, its clients and the folder's changes. (results, alive after, exit code)."""
    port = free_port()
    command = [sys.executable, "-m", "clef_gguf.cli", "serve", str(out / "base.gguf"), "--adapter-dir", str(folder.served)]
    command += ["--max-adapters", str(args.max_adapters), "--port", str(port), "--ctx", "2048"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=(out / "server.log").open("wb"))
    results: list[Result] = []
    try:
        wait_healthy(f"http://{HOST}:{port}", server)
        until = time.monotonic() + args.minutes * 60
        threads = [threading.Thread(target=client, args=(port, args.seed + c, until, results)) for c in range(args.clients)]
        for t in threads:
            t.start()
        while time.monotonic() < until and server.poll() is None:
            time.sleep(folder.rng.uniform(1.0, 4.0))
            folder.change()
        for t in threads:
            t.join()
        alive = server.poll() is None
    finally:
        if server.poll() is None:
            server.terminate()
        exit_code = server.wait(timeout=60)
    return results, alive, exit_code


def check_answers(results: list[Result], expected: dict[str, dict[int, list[dict[str, Any]]]], log: Path) -> dict[str, Any]:
    """Every 200 against the version its header names (each answer's |dp| written to `log`)."""
    wrong, unknown, largest = 0, 0, 0.0
    with log.open("w") as lines:
        for state, model, status, identity, data in results:
            reference = expected.get(identity or "") if status == 200 else None
            answers = json.loads(data)["answers"] if reference is not None else None
            d = min(differs(answers, r) for r in reference[state]) if reference is not None else None
            lines.write(json.dumps({"state": state, "model": model, "status": status, "identity": identity, "dp": d}) + "\n")
            if status == 200 and reference is None:
                unknown += 1
            elif d is not None:
                largest = max(largest, d)
                wrong += d > TOLERANCE
    apart = min(differs(a[s][0], b[s][0]) for a, b in combinations(expected.values(), 2) for s in a)
    return {
        "answers_of_no_known_version": unknown,
        "answers_off_their_version": wrong,
        "largest_dp": largest,
        "versions_apart": apart,
    }


def soak(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    served = out / "served"
    served.mkdir(exist_ok=True)
    folder = Folder(out / "store", served, random.Random(args.seed))
    results, alive, exit_code = run_server(args, out, folder)
    folder.restore_all()
    checked = check_answers(results, references(out / "base.gguf", out / "store"), out / "answers.jsonl")
    refusals = Counter(f"{status} {error_type(data)}" for _, _, status, _, data in results if status != 200)
    # A 503 is due where a served adapter's file is gone, truncated or being rewritten (model_unavailable_error);
    # any other 5xx, no answer at all (status 0), or a base request not answered is a failure.
    failed = sum(n for kind, n in refusals.items() if kind != "503 model_unavailable_error" and not kind.startswith("4"))
    base_refused = sum(1 for _, model, status, _, _ in results if model is None and status != 200)
    wrong = checked["answers_of_no_known_version"] + checked["answers_off_their_version"]
    return {
        "minutes": args.minutes,
        "clients": args.clients,
        "max_adapters": args.max_adapters,
        "requests": len(results),
        "statuses": dict(sorted(Counter(status for _, _, status, _, _ in results).items())),
        "refusals": dict(sorted(refusals.items())),
        "changes": dict(folder.actions),
        "server_alive_after": alive,
        "server_exit_code": exit_code,
        "base_not_answered": base_refused,
        **checked,
        "ok": alive and exit_code == 0 and not base_refused and not wrong and not failed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-adapters", type=int, default=2)
    parser.add_argument("--seed", type=int, default=54)
    parser.add_argument("--out", type=Path, help="where the files are built (default: a temporary folder)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--build-only", type=Path, help=argparse.SUPPRESS)  # (the child's entry)
    args = parser.parse_args(argv)
    if args.build_only is not None:
        build(args.build_only)
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        if not (out / "base.gguf").exists():
            subprocess.run([sys.executable, __file__, "--build-only", str(out)], check=True)
        summary = soak(args, out)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        for key, value in summary.items():
            print(f"{key:>28}: {value}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
