"""How long one long prompt stalls the streams already running on a server: a greedy stream is started, then a
fresh prompt of --prompt-tokens random token ids (max_tokens 1) is sent beside it; the gaps between the stream's
chunks and the worst /health latency meanwhile are recorded.

    python scripts/serve_stall_probe.py --url http://127.0.0.1:8000 [--prompt-tokens 8000] [--json OUT.json]

Prints one line and writes the settings, every gap and the summary to --json. Run it against `spanllm serve` with
--prefill-tokens-beside-decodes 0 (a prompt's whole prefill in one step beside the decodes) and with the default
(auto: 256 tokens a step on CPU) to see what the cap changes.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import threading
import time

import httpx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--stream-tokens", type=int, default=400, help="max_tokens of the stream (ignore_eos)")
    ap.add_argument("--id-range", default="1000,40000", help="the long prompt's random ids: LOW,HIGH")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.prompt_tokens < 1 or args.stream_tokens < 1:
        raise SystemExit("serve_stall_probe.py: --prompt-tokens and --stream-tokens must be >= 1")
    lo, hi = (int(v) for v in args.id_range.split(","))
    try:
        httpx.get(args.url + "/health", timeout=10).raise_for_status()
    except httpx.HTTPError as e:
        why = f"no healthy server at {args.url} ({e}); start `spanllm serve` first"
        raise SystemExit(f"serve_stall_probe.py: {why}") from None
    rng = random.Random(5)
    prompt = [rng.randrange(lo, hi) for _ in range(args.prompt_tokens)]
    chunks: list[float] = []
    health: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": args.stream_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", args.url + "/v1/completions", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(time.monotonic())

    def poll_health() -> None:
        while not done.is_set():
            t = time.monotonic()
            httpx.get(args.url + "/health", timeout=120)
            health.append(time.monotonic() - t)
            time.sleep(0.05)

    streamer = threading.Thread(target=stream)
    poller = threading.Thread(target=poll_health)
    streamer.start()
    poller.start()
    time.sleep(2.0)
    t0 = time.monotonic()
    r = httpx.post(args.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=900)
    t1 = time.monotonic()
    done.set()
    poller.join()
    streamer.join()
    during = [b - a for a, b in zip(chunks, chunks[1:]) if b > t0 and a < t1]
    summary = {
        "long_prompt_status": r.status_code,
        "long_prompt_s": round(t1 - t0, 2),
        "stream_chunks": len(chunks),
        "stream_finished_during_prefill": bool(chunks) and chunks[-1] < t1,
        "gap_max_s": round(max(during), 3) if during else None,
        "gap_median_s": round(statistics.median(during), 3) if during else None,
        "health_worst_s": round(max(health), 3) if health else None,
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        doc = {
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
            "settings": vars(args),
            "summary": summary,
            "gaps_during_prefill_s": [round(g, 4) for g in during],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
