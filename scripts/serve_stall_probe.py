"""How long one long prompt stalls the streams already running on a server: a greedy stream is started, then a
fresh prompt of --prompt-tokens random token ids (max_tokens 1) is sent beside it; the gaps between the stream's
chunks and the worst /health latency meanwhile are recorded.

    python scripts/serve_stall_probe.py --url http://127.0.0.1:8000 [--prompt-tokens 8000] [--json OUT.json]
    python scripts/serve_stall_probe.py --url http://127.0.0.1:8000 --scenario idle-long \
        [--health-url http://127.0.0.1:8001] [--short-delay 3] [--json OUT.json]

Prints one line and writes the settings, every gap and the summary to --json. Run it against `spanllm serve` with
--prefill-tokens-beside-decodes 0 --long-prefill-token-threshold 0 (a prompt's whole prefill in one step beside the
decodes) and with the default (auto: 256 tokens a step on CPU) to see what the cap changes.

--scenario idle-long: on an idle server, the long prompt (max_tokens 1) is sent alone, and --short-delay s later a
short streamed request (a few tokens, max_tokens 2); recorded: the short request's time to its first token and to
its end, the long prompt's time, the worst /health latency on the main port meanwhile and, with --health-url (the
server's --health-port), every answer of the health port (latency, status: 503 once the engine loop looks stuck;
in a 200, the engine heartbeat's age: how long the step running has taken so far).
Run it against --long-prefill-token-threshold 0 (the whole prompt in one step) and the default (auto: 256 on CPU).
Both scenarios send the same prompt (ids from a fixed seed): use a fresh server for each run, or the prefix cache
answers most of it.
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
from serve_hostile_burst import machine  # scripts/ is on sys.path when this runs as a script

SCENARIOS = ("stall", "idle-long")
# the arguments of --scenario idle-long, left out of the stall scenario's settings (its JSON is as it was before them)
IDLE_LONG_ARGS = ("scenario", "short_delay", "health_url")
SHORT_PROMPT = "Hello, my name is"


def _versions() -> dict:
    """The client's packages: the server's too when it runs from the same environment."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("spanllm", "torch", "httpx"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def poll_health(url: str, latencies: list[float], done: threading.Event) -> None:
    """GET url/health every 50 ms until done, appending each answer's latency."""
    while not done.is_set():
        t = time.monotonic()
        httpx.get(url + "/health", timeout=120)
        latencies.append(time.monotonic() - t)
        time.sleep(0.05)


def idle_long(args: argparse.Namespace, prompt: list[int]) -> None:
    """--scenario idle-long: the long prompt alone on the server, a short streamed request --short-delay s later."""
    facts = machine()
    main_polls: list[float] = []
    # (s since the long prompt was sent, latency, status, the engine heartbeat's age in a 200: the step running)
    port_polls: list[tuple[float, float, int, float | None]] = []
    port_bodies: list[str] = []  # the first non-200 answers of the health port
    done = threading.Event()
    long_end: list[float] = []
    long_status: list[int] = []

    def poll_port() -> None:
        while not done.is_set():
            t = time.monotonic()
            age = None
            try:
                r = httpx.get(args.health_url + "/health", timeout=30)
                status, body = r.status_code, r.text
                if status == 200:
                    age = r.json().get("engine_heartbeat_age_s")
            except httpx.HTTPError as e:
                status, body = 0, repr(e)
            port_polls.append((round(t - t0, 3), round(time.monotonic() - t, 4), status, age))
            if status != 200 and len(port_bodies) < 3:
                port_bodies.append(body[:400])
            time.sleep(0.25)

    def send_long() -> None:
        r = httpx.post(args.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=900)
        long_end.append(time.monotonic())
        long_status.append(r.status_code)

    pollers = [threading.Thread(target=poll_health, args=(args.url, main_polls, done))]
    if args.health_url:
        pollers.append(threading.Thread(target=poll_port))
    sender = threading.Thread(target=send_long)
    t0 = time.monotonic()
    sender.start()
    for p in pollers:
        p.start()
    time.sleep(args.short_delay)
    body = {"prompt": SHORT_PROMPT, "max_tokens": 2, "stream": True, "ignore_eos": True}
    ts = time.monotonic()
    tokens: list[float] = []
    with httpx.stream("POST", args.url + "/v1/completions", json=body, timeout=900) as r:
        short_status = r.status_code
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]" and json.loads(line[5:]).get("choices"):
                tokens.append(time.monotonic())
    te = time.monotonic()
    sender.join()
    done.set()
    for p in pollers:
        p.join()
    summary = {
        "long_prompt_status": long_status[0],
        "long_prompt_s": round(long_end[0] - t0, 2),
        "short_sent_after_s": round(ts - t0, 2),
        "short_status": short_status,
        "short_chunks": len(tokens),
        "short_ttft_s": round(tokens[0] - ts, 3) if tokens else None,
        "short_total_s": round(te - ts, 3),
        "short_done_before_long": te < long_end[0],
        "health_polls": len(main_polls),
        "health_worst_s": round(max(main_polls), 3) if main_polls else None,
    }
    if args.health_url:
        bad = [p for p in port_polls if p[2] != 200]
        summary |= {
            "health_port_polls": len(port_polls),
            "health_port_worst_s": round(max(p[1] for p in port_polls), 3) if port_polls else None,
            "health_port_503": sum(p[2] == 503 for p in port_polls),
            "health_port_not_200": len(bad),
            "health_port_first_not_200_after_s": bad[0][0] if bad else None,
            "health_port_engine_age_max_s": max((p[3] for p in port_polls if p[3] is not None), default=None),
        }
    print(json.dumps(summary), flush=True)
    if args.json:
        doc = {
            "machine": facts,
            "versions": _versions(),
            "settings": {k: v for k, v in vars(args).items() if k != "stream_tokens"}
            | {"short_prompt": SHORT_PROMPT, "short_max_tokens": 2, "long_max_tokens": 1},
            "summary": summary,
            "health_port_not_200_bodies": port_bodies,
            "health_polls_s": [round(v, 4) for v in main_polls],
            "health_port_polls": [list(p) for p in port_polls],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=8000)
    ap.add_argument("--stream-tokens", type=int, default=400, help="max_tokens of the stream (ignore_eos)")
    ap.add_argument("--id-range", default="1000,40000", help="the long prompt's random ids: LOW,HIGH")
    ap.add_argument("--json")
    ap.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="stall",
        help="stall: the long prompt beside a running stream (default); idle-long: the long prompt on an idle server, "
        "then a short request (module docstring)",
    )
    ap.add_argument(
        "--short-delay", type=float, default=3.0, help="idle-long: seconds from the long prompt to the short"
    )
    ap.add_argument("--health-url", help="idle-long: the server's --health-port (http://HOST:PORT), polled too")
    args = ap.parse_args()
    if args.short_delay < 0:
        raise SystemExit("serve_stall_probe.py: --short-delay must be >= 0")
    if args.prompt_tokens < 1 or args.stream_tokens < 1:
        raise SystemExit("serve_stall_probe.py: --prompt-tokens and --stream-tokens must be >= 1")
    lo, hi = (int(v) for v in args.id_range.split(","))
    try:
        httpx.get(args.url + "/health", timeout=10).raise_for_status()
    except httpx.HTTPError as e:
        why = f"no healthy server at {args.url} ({e}); start `spanllm serve` first"
        raise SystemExit(f"serve_stall_probe.py: {why}") from None
    if args.scenario == "idle-long" and args.health_url:
        try:
            httpx.get(args.health_url + "/health", timeout=10).raise_for_status()
        except httpx.HTTPError as e:
            raise SystemExit(f"serve_stall_probe.py: no healthy --health-url {args.health_url} ({e})") from None
    rng = random.Random(5)
    prompt = [rng.randrange(lo, hi) for _ in range(args.prompt_tokens)]
    if args.scenario == "idle-long":
        idle_long(args, prompt)
        return
    chunks: list[float] = []
    health: list[float] = []
    done = threading.Event()

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": args.stream_tokens, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", args.url + "/v1/completions", json=body, timeout=900) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(time.monotonic())

    streamer = threading.Thread(target=stream)
    poller = threading.Thread(target=poll_health, args=(args.url, health, done))
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
            "settings": {k: v for k, v in vars(args).items() if k not in IDLE_LONG_ARGS},
            "summary": summary,
            "gaps_during_prefill_s": [round(g, 4) for g in during],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
