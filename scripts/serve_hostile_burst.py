"""A running `spanllm serve` under a burst of ordinary requests while hostile ones arrive (issue 32's list:
out-of-range seeds and top_k, a lone surrogate, a body nested 100,000 deep, a 50 MB prompt, 10,000 stop
strings, a body shorter than its Content-Length, half-sent headers), with /health polled every 50 ms. Prints
the statuses by kind, /health's latency (max, p99) and whether the server still serves; exits 1 if any
ordinary request failed, a hostile one got a 5xx, or /health took longer than --health-limit-ms.

    spanllm serve --model tiny --dtype float32 --port 8123 &
    python scripts/serve_hostile_burst.py --url http://127.0.0.1:8123 --burst 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

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


async def main_async(a) -> int:
    port = int(a.url.rsplit(":", 1)[1])
    results: dict[str, list] = {}
    health_ms: list[float] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(base_url=a.url, timeout=300, limits=httpx.Limits(max_connections=None)) as h:

        async def poll_health():
            async with httpx.AsyncClient(base_url=a.url, timeout=10) as hh:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    r = await hh.get("/health")
                    health_ms.append((time.perf_counter() - t0) * 1000)
                    assert r.status_code == 200, r.text
                    await asyncio.sleep(0.05)

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

        poller = asyncio.create_task(poll_health())
        t0 = time.monotonic()
        await asyncio.gather(
            *[ordinary(i) for i in range(a.burst)],
            *[hostile(n, b) for n, b in HOSTILE.items() for _ in range(a.hostile_copies)],
            *([bodies()] if a.hostile_copies else []),
        )
        took = time.monotonic() - t0
        stop.set()
        await poller
        after = (await h.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 2})).status_code
    for name, codes in results.items():
        print(f"{name:24s} {sorted(codes, key=str) if len(set(map(str, codes))) > 1 else f'{len(codes)} x {codes[0]}'}")
    q = statistics.quantiles(health_ms, n=100) if len(health_ms) > 1 else health_ms
    print(
        f"/health: {len(health_ms)} polls during {took:.1f} s, max {max(health_ms):.1f} ms, p99 {q[-1]:.1f} ms, "
        f"median {statistics.median(health_ms):.1f} ms; a request afterwards: {after}"
    )
    bad_ordinary = [c for c in results["ordinary"] if c != 200]
    bad_hostile = [c for n, cs in results.items() if n != "ordinary" for c in cs if isinstance(c, int) and c >= 500]
    print(
        f"/health slower than {a.health_limit_ms:g} ms: "
        f"{sum(x > a.health_limit_ms for x in health_ms)} of {len(health_ms)}"
    )
    ok = not bad_ordinary and not bad_hostile and max(health_ms) <= a.health_limit_ms and after == 200
    print("OK" if ok else "FAILED")
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
    p.add_argument("--health-limit-ms", type=float, default=100.0, help="the slowest /health answer allowed")
    a = p.parse_args()
    for flag in ("burst", "max_tokens", "hostile_copies"):
        if getattr(a, flag) < (0 if flag == "hostile_copies" else 1):
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: must be >= 1")
    return asyncio.run(main_async(a))


if __name__ == "__main__":
    sys.exit(main())
