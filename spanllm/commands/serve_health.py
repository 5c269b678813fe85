"""The health process of `spanllm serve --health-port` (spanllm.serve.health.HealthPort starts it): its command line.

python -m spanllm.commands.serve_health --state FILE --host H --port P [--stall-timeout S]
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from spanllm.serve.health import DEFAULT_STALL_TIMEOUT_S, HealthHTTPServer, Heartbeats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="spanllm serve's health process (started by `spanllm serve --health-port`)")
    p.add_argument("--state", required=True, help="the heartbeats' file (Heartbeats.create())")
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S)
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    beats = Heartbeats.attach(a.state)
    try:
        httpd = HealthHTTPServer(a.host, a.port, beats, a.stall_timeout)
    except OSError as e:
        print(f"error: cannot bind {a.host}:{a.port}: {e.strerror or e}", flush=True)
        return 2
    threading.Thread(target=httpd.serve_forever, args=(0.1,), name="spanllm-health", daemon=True).start()
    print(f"port {httpd.server_address[1]}", flush=True)
    try:
        sys.stdin.buffer.read()  # until rank 0 closes it (or ends)
    finally:
        httpd.shutdown()
        httpd.server_close()
        beats.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
