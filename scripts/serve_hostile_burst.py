"""A running `spanllm serve` under a burst of ordinary requests while hostile ones arrive (issue 32's list:
out-of-range seeds and top_k, a lone surrogate, a body nested 100,000 deep, a 50 MB prompt, 10,000 stop
strings, a body shorter than its Content-Length, half-sent headers), with /health polled every 50 ms on the main
port and, with --health-url, on the health port (`spanllm serve --health-port`). Each poller is a process of its
own that opens a new connection per poll (as a probe does), so the burst's client does not delay the polls.
Prints the statuses by kind, each /health's latency (median, p99, max, polls above --health-limit-ms) and
whether the server still serves; --json writes all of it with the raw poll latencies and this machine's facts.
Exits 1 if any ordinary request failed, a hostile one got a 5xx, or the health port's /health (the main port's
without --health-url) took longer than --health-limit-ms or answered other than 200.

    spanllm serve --model tiny --dtype float32 --port 8123 --health-port 8124 &
    python scripts/serve_hostile_burst.py --url http://127.0.0.1:8123 --health-url http://127.0.0.1:8124 \
        --burst 200 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from urllib.parse import urlsplit

import httpx

HOSTILE = {
    "seed 2^64": {"prompt": "Hello there", "max_tokens": 4, "temperature": 0.8, "seed": 2**64},
    "seed -2^63-1": {"prompt": "Hello there", "max_tokens": 4, "temperature": 0.8, "seed": -(2**63) - 1},
    "top_k 1e20": {"prompt": "Hello there", "max_tokens": 4, "temperature": 0.8, "top_k": 10**20},
    "10k stop strings": {"prompt": "Hello there", "max_tokens": 4, "stop": ["x"] * 10_000},
    "100 KB stop string": {"prompt": "Hello there", "max_tokens": 4, "stop": "x" * 100_000},
    "stream 'false'": {"prompt": "Hello there", "stream": "false"},
}


async def raw(port: int, data: bytes, wait_s: float) -> str:
    """Send bytes on a fresh connection; the first line of what comes back within wait_s (or how it ended)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(data)
        await w.drain()
        line = await asyncio.wait_for(r.readline(), wait_s)
        return line.decode().strip() or "closed by the server"
    except asyncio.TimeoutError:
        return f"no answer within {wait_s} s"
    finally:
        w.close()


def poll(url: str, interval_s: float, stop, out) -> None:
    """GET url/health every interval_s on a new connection until stop is set; out gets [(ms, status), ...]."""
    u = urlsplit(url)
    polls = []
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            c.request("GET", "/health")
            status = c.getresponse().status
            c.close()
        except OSError as e:
            status = type(e).__name__
        polls.append(((time.perf_counter() - t0) * 1000, status))
        time.sleep(interval_s)
    out.put(polls)


def summary(polls: list, limit_ms: float) -> dict:
    ms = [m for m, _ in polls]
    q = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms
    return {
        "polls": len(ms),
        "median_ms": round(statistics.median(ms), 2),
        "p99_ms": round(q[-1], 2),
        "max_ms": round(max(ms), 2),
        "above_limit": sum(m > limit_ms for m in ms),
        "not_200": sum(s != 200 for _, s in polls),
    }


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_before": os.getloadavg(),
    }


async def main_async(a) -> int:
    port = int(a.url.rsplit(":", 1)[1])
    results: dict[str, list] = {}
    facts = machine()
    ctx = mp.get_context("spawn")
    stop, outs, pollers = ctx.Event(), {}, []
    for name, url in (("main port", a.url), ("health port", a.health_url)):
        if url:
            outs[name] = ctx.Queue()
            pollers.append(ctx.Process(target=poll, args=(url, a.poll_interval_ms / 1000, stop, outs[name])))
    for p in pollers:
        p.start()
    async with httpx.AsyncClient(base_url=a.url, timeout=300, limits=httpx.Limits(max_connections=None)) as h:

        async def ordinary(i):
            body = {"prompt": f"request {i}", "max_tokens": a.max_tokens, "ignore_eos": True, "stream": i % 2 == 0}
            r = await h.post("/v1/completions", json=body)
            results.setdefault("ordinary", []).append(r.status_code)

        async def hostile(name, body):
            r = await h.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
            results.setdefault(name, []).append(r.status_code)

        async def bodies():
            h2 = {"content-type": "application/json"}
            for name, data in (
                ("lone surrogate", b'{"prompt": "\\ud800 hi"}'),
                ("nested 100,000 deep", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
                ("50 MB prompt", b'{"prompt": "' + b"x" * 50_000_000 + b'"}'),
            ):
                try:
                    r = await h.post("/v1/completions", content=data, headers=h2)
                    results.setdefault(name, []).append(r.status_code)
                except httpx.HTTPError as e:  # the server may close before the 50 MB are sent
                    results.setdefault(name, []).append(type(e).__name__)
            short = b'{"prompt": "hi"}'
            head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            results["body 100 bytes short"] = [
                await raw(port, head + f"Content-Length: {len(short) + 100}\r\n\r\n".encode() + short, 60)
            ]
            results["half-sent headers"] = [await raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 60)]

        await asyncio.sleep(1.0)  # the pollers' first polls
        t0 = time.monotonic()
        await asyncio.gather(
            *[ordinary(i) for i in range(a.burst)],
            *[hostile(n, b) for n, b in HOSTILE.items() for _ in range(a.hostile_copies)],
            *([bodies()] if a.hostile_copies else []),
        )
        took = time.monotonic() - t0
        stop.set()
        polls = {name: q.get(timeout=60) for name, q in outs.items()}
        for p in pollers:
            p.join(10)
        after = (await h.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 2})).status_code
    facts["loadavg_after"] = os.getloadavg()
    for name, codes in results.items():
        print(f"{name:24s} {sorted(codes, key=str) if len(set(map(str, codes))) > 1 else f'{len(codes)} x {codes[0]}'}")
    print(f"burst: {took:.1f} s; a request afterwards: {after}")
    summaries = {name: summary(p, a.health_limit_ms) for name, p in polls.items()}
    for name, sm in summaries.items():
        print(
            f"/health ({name}): {sm['polls']} polls, median {sm['median_ms']:.1f} ms, p99 {sm['p99_ms']:.1f} ms, "
            f"max {sm['max_ms']:.1f} ms, {sm['above_limit']} above {a.health_limit_ms:g} ms, {sm['not_200']} not 200"
        )
    bad_ordinary = [c for c in results["ordinary"] if c != 200]
    bad_hostile = [c for n, cs in results.items() if n != "ordinary" for c in cs if isinstance(c, int) and c >= 500]
    judged = summaries["health port" if a.health_url else "main port"]
    ok = not bad_ordinary and not bad_hostile and not judged["above_limit"] and not judged["not_200"] and after == 200
    print("OK" if ok else "FAILED")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "machine": facts,
                    "settings": {k: v for k, v in vars(a).items() if k != "json"},
                    "burst_s": round(took, 2),
                    "statuses": results,
                    "after": after,
                    "health": summaries,
                    "raw_poll_ms": {name: [round(m, 3) for m, _ in p] for name, p in polls.items()},
                    "raw_poll_status": {name: [s for _, s in p] for name, p in polls.items()},
                    "ok": ok,
                },
                f,
                indent=1,
            )
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the server, http://127.0.0.1:PORT")
    p.add_argument("--burst", type=int, default=200, help="ordinary requests sent at once")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per ordinary request")
    p.add_argument(
        "--hostile-copies",
        type=int,
        default=5,
        help="copies of each hostile JSON body (0: the burst alone, a baseline)",
    )
    p.add_argument("--health-url", default=None, help="the health port, http://127.0.0.1:HPORT (--health-port)")
    p.add_argument("--poll-interval-ms", type=float, default=50.0, help="pause between two polls of each /health")
    p.add_argument("--health-limit-ms", type=float, default=100.0, help="the slowest /health answer allowed")
    p.add_argument("--json", default=None, help="write the results, raw poll latencies and machine facts here")
    a = p.parse_args()
    for flag in ("burst", "max_tokens", "hostile_copies"):
        if getattr(a, flag) < (0 if flag == "hostile_copies" else 1):
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be >= 1")
    return asyncio.run(main_async(a))


if __name__ == "__main__":
    sys.exit(main())
