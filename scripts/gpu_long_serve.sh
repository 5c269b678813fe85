#!/usr/bin/env bash
# Issue 33's measurement as its acceptance states it: the TTFT of long prompts through `spanllm serve`, one request
# at a time on an otherwise idle server (random prompts of LENGTHS tokens, 16 output tokens, NUM each, no warm-up
# request and no bench ready check, which would send the first prompt and fill the cache with its blocks: the first
# of each length is the first the server ever saw; a seed per length, so no prompt starts with another's tokens and
# hits the prefix cache; a run whose prompts hit the cache is reported INVALID). The server runs the long-prompt settings
# (cuDNN cascade on every chunk, 16,384-token chunks) unless SERVE_FLAGS says otherwise.
#
#   bash scripts/gpu_long_serve.sh OUTDIR                    # GPU machine (carry .whl: fastapi, uvicorn, quicktok)
#   MODEL=tiny SERVE_FLAGS="--max-num-batched-tokens 256" LENGTHS=300,450 NUM=2 bash scripts/gpu_long_serve.sh OUT
#                                                            # CPU dry run of the script itself
#
# Writes OUTDIR/long_serve_<length>.json (`bench serve --save-result --save-detailed`: per-request TTFT, the
# server's description in its metadata), OUTDIR/serve.log, OUTDIR/run.log.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${1:?usage: bash scripts/gpu_long_serve.sh OUTDIR}
MODEL=${MODEL:-llama3.1-8b}
LENGTHS=${LENGTHS:-36402,111352}
NUM=${NUM:-3}
SERVE_FLAGS=${SERVE_FLAGS:---prefill-attention cudnn-cascade --cascade-min-prefix 0 --max-num-batched-tokens 16384}
START_TIMEOUT=${START_TIMEOUT:-300}
REQUEST_TIMEOUT=${REQUEST_TIMEOUT:-120}
mkdir -p "$OUT"
LOG="$OUT/run.log"
: >"$LOG"
log() { echo "=== $(date +%H:%M:%S) $*" | tee -a "$LOG"; }
if ! python3 -c 'import fastapi, uvicorn, quicktok' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  log "installing .whl/*.whl into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
log "spanllm serve --model $MODEL $SERVE_FLAGS on port $PORT"
# shellcheck disable=SC2086
python3 -m spanllm.cli serve --model "$MODEL" --port "$PORT" $SERVE_FLAGS >"$OUT/serve.log" 2>&1 &
SERVER=$!
stop() { kill -INT "$SERVER" 2>/dev/null; for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || return 0; sleep 1; done
         kill -KILL "$SERVER" 2>/dev/null; return 0; }
trap stop EXIT
# up when /health answers 200 (the engine built, warmed up, the front end listening)
python3 - "$PORT" "$START_TIMEOUT" "$SERVER" <<'EOF' >>"$LOG" 2>&1 || { log "the server did not come up:"; tail -5 "$OUT/serve.log"; exit 1; }
import os, sys, time, urllib.request
port, limit, pid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
t0 = time.monotonic()
while time.monotonic() - t0 < limit:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit(f"the server exited after {time.monotonic() - t0:.1f} s")
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
            print(f"server up after {time.monotonic() - t0:.1f} s")
            sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit(1)
EOF
log "server up"
rc=0
for len in ${LENGTHS//,/ }; do
  log "$NUM prompts of $len tokens, one at a time"
  # shellcheck disable=SC2086
  timeout $(( START_TIMEOUT + NUM * REQUEST_TIMEOUT )) python3 -m spanllm.cli bench serve --port "$PORT" --model "$MODEL" \
    --dataset-name random --random-input-len "$len" --random-output-len 16 --random-range-ratio 0 \
    --num-prompts "$NUM" --seed "$len" --max-concurrency 1 --request-rate inf --num-warmups 0 \
    --request-timeout "$REQUEST_TIMEOUT" --disable-tqdm \
    --save-result --save-detailed --result-dir "$OUT" --result-filename "long_serve_$len.json" \
    --metadata "serve_flags=$SERVE_FLAGS" >>"$LOG" 2>&1 || { log "bench serve failed at $len tokens"; rc=1; }
  python3 - "$OUT/long_serve_$len.json" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
ttfts = d.get("ttfts") or []
print(
    f"{sys.argv[1]}: TTFT per request (s) {[round(t, 3) for t in ttfts]}, input lens {d.get('input_lens')}, "
    f"prefix-cache hits {d.get('prefix_cache_hits')} of {d.get('prefix_cache_queries')} tokens"
)
if d.get("prefix_cache_hits"):  # a request reused cached blocks: its TTFT is not a fresh prompt's
    sys.exit("INVALID: prompts hit the prefix cache; the TTFTs above are not those of fresh prompts")
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
done
exit $rc
