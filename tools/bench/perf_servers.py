"""Where each server's CPU time goes: `perf record` of clef-gguf serve, then of llama-server, on the same file.

One server at a time on the benchmark fixture (built in a child), the same requests as
bench_vs_llama_server.py (each about a state of its own), the same threads and weight placement;
prints each server's median round trip and its top samples by library and symbol. Needs Linux perf
(cpu-clock sampling is enough) and llama-server (tools/build_llama_server.sh).

    python tools/bench/perf_servers.py [--type q4_k_m] [--request ~2k] [--count 16] [--top 12]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from clef_gguf.testing.processes import free_port, wait_healthy
from clef_gguf.testing.servers import Client, new_state, requests_by_size, start_clef_gguf, start_llama_server


def top_samples(data: Path, top: int) -> list[str]:
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "-g", "none", "--sort", "dso,symbol", "--stdio"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    total = next((line.strip("# \n") for line in report.splitlines() if line.startswith("# Samples")), "")
    rows = [" ".join(line.split()).removesuffix(" - -") for line in report.splitlines() if line.strip()[:1].isdigit()]
    return [total, *rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--type", default="q4_k_m")
    parser.add_argument("--request", default="~2k", choices=["ticket", "~2k", "~8k"])
    parser.add_argument("--count", type=int, default=16, help="requests recorded per server")
    parser.add_argument("--threads", type=int, default=None, help="both servers' threads (default: clef-gguf's)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--bin", type=Path, default=Path.home() / ".cache/clef-gguf/llama-build/bin")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("needs Linux perf (perf record, perf report) on PATH")

    from clef_gguf.llama.threads import default_threads
    from clef_gguf.testing.fixture_files import benchmark_files

    threads = args.threads or default_threads()
    request = requests_by_size()[args.request]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = benchmark_files(root, [args.type])[args.type]  # built in a child: no torch threads in the recording
        for who in ("clef-gguf", "llama-server"):
            url = f"http://127.0.0.1:{free_port()}"
            log = root / f"{who}.log"
            process = (
                start_clef_gguf(path, url, threads, log)
                if who == "clef-gguf"
                else start_llama_server(args.bin, path, url, threads, 1, log)
            )
            try:
                wait_healthy(url, process)
                client = Client(url)
                for r in range(3):  # warm-up, outside the recording
                    client.post(new_state(request, -1 - r))
                data = root / f"{who}.data"
                record = subprocess.Popen(
                    ["perf", "record", "-F", "999", "-g", "-p", str(process.pid), "-o", str(data)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                time.sleep(1)  # perf attached
                times = [client.post(new_state(request, r))[0] for r in range(args.count)]
                record.send_signal(signal.SIGINT)  # perf writes its file at SIGINT
                record.wait()
            finally:
                process.terminate()
                process.wait()
            print(f"\n{who}, {args.type} {args.request}: median {statistics.median(times) * 1e3:.0f} ms over {args.count}")
            print("\n".join(top_samples(data, args.top)))


if __name__ == "__main__":
    main()
