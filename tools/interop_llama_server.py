"""llama.cpp's own llama-server loads clef-gguf's files and answers as clef-gguf does.

Builds two fixture releases (clef_gguf/testing/release_builder.py), converts them with clef-gguf
(f32, and Q4_K_M on the fixture whose rows are multiples of 256; the f32 file again with softmax temperatures at
every bucket, and calibrated by `clef-gguf calibrate` on examples/labelled.jsonl), starts the pinned
llama-server on each file (loopback, one ubatch for the whole prompt: its Clef graph has
no memory) and sends it the request suite through /v1/systemone, then compares every
probability and `input_tokens` with clef-gguf's own decision on the same file.

Requests are made NFC and given their ids as instructions where they have none: those
are the two places where llama-server departs from the reference (docs/format.md), and
clef-gguf follows the reference.

    bash tools/build_llama_server.sh          # once, about 25 minutes on 2 cores
    python tools/interop_llama_server.py [--bin ~/.cache/clef-gguf/llama-build/bin]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from clef_gguf.testing.llama_server import as_llama_server_accepts, placement_flags

ROOT = Path(__file__).resolve().parent.parent

PORT = 18791


def probabilities(answer: dict[str, Any]) -> dict[str, float]:
    return answer.get("probabilities") or {"true": answer["noul"], "false": 1 - answer["noul"]}


def serve(binary: Path, model: Path, n_ctx: int, log: Path) -> subprocess.Popen:
    args = [str(binary / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(PORT)]
    args += ["-c", str(n_ctx), "-b", str(n_ctx), "-ub", str(n_ctx), "-t", "2", *placement_flags()]
    server = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(180):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2)
            return server
        except (urllib.error.URLError, ConnectionError):
            if server.poll() is not None:
                raise SystemExit(f"llama-server exited ({server.returncode}); see {log}") from None
            time.sleep(1)
    server.terminate()
    raise SystemExit(f"llama-server did not come up; see {log}")


def post(request: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps(request).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/systemone", body, {"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req, timeout=600).read())
    except urllib.error.HTTPError as e:
        return {"http_error": e.code, "body": e.read().decode()[:300]}


def compare(binary: Path, path: Path, requests: dict[str, dict[str, Any]], log: Path) -> list[tuple[str, Any, Any, float]]:
    import clef_gguf

    rows = []
    with clef_gguf.load(path, max_prompt_tokens=8192, n_threads=2) as model:
        server = serve(binary, path, 8192, log)
        try:
            for name, request in requests.items():
                ours, theirs = model.decide(request), post(request)
                if "answers" not in theirs:
                    rows.append((name, ours["usage"]["input_tokens"], theirs, float("nan")))
                    continue
                worst = max(
                    abs(p - probabilities(theirs["answers"][q])[k])
                    for q, a in ours["answers"].items()
                    for k, p in probabilities(a).items()
                )
                rows.append((name, ours["usage"]["input_tokens"], theirs["usage"]["input_tokens"], worst))
        finally:
            server.terminate()
            server.wait(timeout=60)
    return rows


# A temperature at every bucket of choice, score by its fallback and a bucket, noul by its type (as tests/test_temperatures.py).
TEMPERATURES = {
    "choice.2": 0.5,
    "choice.3_5": 2.5,
    "choice.6_10": 0.8,
    "choice.11": 1.7,
    "noul": 0.6,
    "score": 1.9,
    "score.6_10": 0.7,
}


def calibrated(model: Path, out: Path) -> Path:
    """`clef-gguf calibrate` of the model on examples/labelled.jsonl."""
    command = [sys.executable, "-m", "clef_gguf.cli", "calibrate", str(model), str(ROOT / "examples" / "labelled.jsonl")]
    subprocess.run([*command, "-o", str(out)], check=True, capture_output=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", type=Path, default=Path.home() / ".cache/clef-gguf/llama-build/bin")
    args = parser.parse_args()
    if not (args.bin / "llama-server").is_file():
        raise SystemExit(f"no llama-server in {args.bin}: run `bash tools/build_llama_server.sh` first")

    import clef_gguf
    from clef_gguf.conversion.rekey import rekey
    from clef_gguf.format import contract as C
    from clef_gguf.testing.release_builder import RELEASES, build_release
    from clef_gguf.testing.request_suite import all_requests, temperature_buckets_request

    requests = {name: as_llama_server_accepts(r) for name, r in all_requests().items()}
    requests["temperature_buckets"] = as_llama_server_accepts(temperature_buckets_request())
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        f32 = clef_gguf.convert(build_release(root / "untied_f32", RELEASES["untied_f32"]), root / "untied-f32.gguf", "f32")
        files = [
            f32,
            clef_gguf.convert(build_release(root / "k256", RELEASES["k256"]), root / "k256-q4_k_m.gguf", "q4_k_m"),
            rekey(f32, root / "untied-f32-temperatures.gguf", {C.KEY_TEMPERATURE_PREFIX + k: v for k, v in TEMPERATURES.items()}),
            calibrated(f32, root / "untied-f32-calibrated.gguf"),
        ]
        print("| file | request | tokens (clef-gguf) | tokens (llama-server) | max abs dp |")
        print("|---|---|---:|---:|---:|")
        for path in files:
            for name, ours, theirs, worst in compare(args.bin, path, requests, root / f"{path.stem}.log"):
                print(f"| {path.name} | {name} | {ours} | {theirs} | {worst:.5f} |")


if __name__ == "__main__":
    main()
