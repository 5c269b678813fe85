#!/usr/bin/env bash
# The first requests a fresh `spanllm serve` answers, against the later ones: time to the response's first byte
# (the headers of a stream: after parsing, tokenization and submission, before any token) for three chat streams and
# two completion streams, one at a time, on SmolLM2 on this machine's CPU. Writes OUTDIR/first_request.json.
#
#   bash scripts/cpu_first_request.sh results/cpu_first_request
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/cpu_first_request.sh OUTDIR}
mkdir -p "$OUT"
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
python3 -m spanllm.cli serve --model smollm2-135m-instruct --port "$PORT" --max-num-batched-tokens 512 \
  >"$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
up=0
for _ in $(seq 180); do
  curl -s -o /dev/null -w "%{http_code}" "http://127.0.0.1:$PORT/health" 2>/dev/null | grep -q 200 && { up=1; break; }
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 1
done
[ "$up" = 1 ] || { echo "the server did not come up ($OUT/serve.log):"; tail -5 "$OUT/serve.log"; exit 1; }
python3 - "$PORT" "$OUT/first_request.json" <<'PY'
import json, sys, time, urllib.request

port, path = sys.argv[1], sys.argv[2]

def first_byte(route: str, body: dict) -> float:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read(1)
        dt = time.perf_counter() - t0
        r.read()
    return dt

rows = []
for i in range(3):
    body = {"messages": [{"role": "user", "content": f"Hi number {i}"}], "max_tokens": 1, "stream": True}
    rows.append({"request": len(rows) + 1, "route": "chat", "first_byte_s": first_byte("/v1/chat/completions", body)})
for i in range(2):
    body = {"prompt": f"Hello there friend number {i}", "max_tokens": 1, "stream": True}
    rows.append({"request": len(rows) + 1, "route": "completion", "first_byte_s": first_byte("/v1/completions", body)})
from spanllm.output_files import write_result
write_result(path, "first_request", {"model": "smollm2-135m-instruct", "max_num_batched_tokens": 512}, rows)
for r in rows:
    print(f"request {r['request']} ({r['route']} stream): first byte {1e3 * r['first_byte_s']:.1f} ms")
PY
