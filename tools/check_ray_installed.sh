#!/usr/bin/env bash
# `clef-gguf serve --ray` after a non-editable install, started with the working directory at a checkout's root.
#
# Ray puts the driver's working directory on its workers' sys.path: replicas used to import the checkout's
# clef_gguf, which has no built libclef_head, and died at start-up (runtime/ray_local.py, imported_from_here).
# This builds the committed HEAD into a fresh virtual environment with `pip install '.[ray]'` (pip builds the
# native head: minutes), then serves the demo model on a local Ray cluster of one replica from the clone's root
# (a checkout with no build), and expects 200 from /health, /v1/systemone and /metrics.
#
# Usage: bash tools/check_ray_installed.sh [WORKDIR]   (default: a temporary directory, removed afterwards)
# PYTHON picks the interpreter of the new environment (default: python3).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-}
keep=1
if [[ -z "$work" ]]; then
  work=$(mktemp -d)
  keep=0
fi
server=
finish() {
  if [[ -n "$server" ]]; then
    kill -TERM "$server" 2>/dev/null || true
    wait "$server" || true
    server=
  fi
  [[ "$keep" == 1 ]] || rm -rf "$work"
}
trap finish EXIT
python=${PYTHON:-python3}

if [[ ! -x "$work/venv/bin/clef-gguf" ]]; then
  rm -rf "$work/src"
  git clone -q "$root" "$work/src"  # what is committed, nothing else
  "$python" -m venv "$work/venv"
  "$work/venv/bin/pip" install -q "$work/src[ray]"
fi
checkout="$work/src"
test ! -e "$checkout/clef_gguf/_native" || { echo "the checkout has a built library: the check would prove nothing" >&2; exit 1; }

cd /  # to ask the installed package where its files are
model=$("$work/venv/bin/python" -c 'from clef_gguf.data import DEMO_MODEL; print(DEMO_MODEL)')
request=$("$work/venv/bin/python" -c 'from clef_gguf.data import DEMO_REQUEST; print(DEMO_REQUEST)')
port=$("$work/venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "installed: $("$work/venv/bin/python" -c 'import clef_gguf; print(clef_gguf.__file__)')"

cd "$checkout"  # the case at issue: the working directory holds the source tree's clef_gguf
echo "serving from $(pwd): clef-gguf serve $model --ray --replicas 1 --port $port"
env -u RAY_ADDRESS "$work/venv/bin/clef-gguf" serve "$model" --ray --replicas 1 --port "$port" >"$work/serve.log" 2>&1 &
server=$!

url="http://127.0.0.1:$port"
for _ in $(seq 600); do
  if ! kill -0 "$server" 2>/dev/null; then
    tail -n 40 "$work/serve.log" >&2
    echo "FAIL: serve --ray exited before it answered" >&2
    exit 1
  fi
  [[ "$(curl -s -o /dev/null -w '%{http_code}' "$url/health" || true)" == 200 ]] && break
  sleep 0.5
done
decided=$(curl -s -o "$work/answer.json" -w '%{http_code}' -H 'content-type: application/json' --data-binary "@$request" "$url/v1/systemone")
scraped=$(curl -s -o "$work/metrics.txt" -w '%{http_code}' "$url/metrics")
echo "POST /v1/systemone: $decided  $(head -c 160 "$work/answer.json")"
echo "GET /metrics: $scraped  $(grep '^clef_requests_total' "$work/metrics.txt" | tr '\n' ' ')"
kill -TERM "$server"
wait "$server" || true
server=
grep -m 3 'route=/v1/systemone' "$work/serve.log" || true
if [[ "$decided" != 200 || "$scraped" != 200 ]]; then
  tail -n 40 "$work/serve.log" >&2
  echo "FAIL" >&2
  exit 1
fi
echo "OK: replicas imported the installed package with the working directory at the checkout root"
