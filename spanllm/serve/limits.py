"""What one connection may cost the server before the app sees its request: the size of the body, the time its
headers and its body take to arrive, and how many connections may be open at once.

- `ServerLimits`: the values, one flag each in `spanllm serve` (spanllm.commands.serve).
- `BodyLimitMiddleware` (ASGI): refuses a body whose Content-Length is over the limit before reading a byte of it
  (413), caps a body sent without one (or longer than it said) while it streams in (413), and gives up on a body
  that stops arriving or trickles in below MIN_BODY_BYTES_PER_S (408). The app then gets the whole body at once.
- `limited_h11_protocol`: uvicorn's h11 protocol with a deadline on the request line and headers (a client
  that connects and sends nothing, or half its headers, is disconnected; the keep-alive timeout covers the
  idle time between requests), and a connection beyond max_connections answered with OpenAI's error body (503)
  and closed, while the connections within the limit are served. (uvicorn's own limit_concurrency refuses every
  request on every connection once the limit is reached, in plain text: not used.)
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from spanllm.serve.protocol import error_body

# The slowest average rate a request body may arrive at, after --body-timeout's grace: 16 KiB/s is 128 kbit/s, which
# a 2G mobile link (EDGE, ~200 kbit/s) beats, and moves the 8 MiB --max-body-bytes in 512 s.
MIN_BODY_BYTES_PER_S = 16 * 1024


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 8 * 1024 * 1024  # 8 MiB: a 128k-token prompt as text is ~0.5 MB
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # between two chunks of a body (and the whole body's grace: MIN_BODY_BYTES_PER_S)
    keep_alive_s: float = 5.0  # uvicorn's default
    max_connections: int = 2048  # concurrent connections: one beyond gets 503 (limited_h11_protocol)
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    # stop_token_ids per request: each engine step checks a request's ids (and masks them before min_tokens), so
    # an unbounded list (a 3 MB body holds a million) slowed every other stream ~5x
    max_stop_token_ids: int = 1024

    def __post_init__(self) -> None:
        for name, lo in (
            ("max_body_bytes", 1),
            ("max_connections", 1),
            ("max_stop_strings", 0),
            ("max_stop_token_ids", 0),
        ):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {lo}")
        if self.max_stop_string_length < 1:
            raise ValueError(f"max_stop_string_length={self.max_stop_string_length} must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


async def _send_error(send, status: int, type_: str, message: str) -> None:
    body = json.dumps(error_body(message, type_, None, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + [(b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    def __init__(self, app, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        cap = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await _send_error(send, 400, "BadRequestError", "Content-Length is not a number")
            if int(declared) > cap:
                return await _send_error(send, 413, "RequestTooLargeError", _too_large(int(declared), cap))
        chunks, size = [], 0
        started = last = time.monotonic()
        while True:
            # the whole body's deadline: the gap's grace, plus the bytes (those declared, else those so far) at
            # MIN_BODY_BYTES_PER_S, so that a trickle of bytes, each within the gap, cannot hold the connection
            expected = int(declared) if declared is not None else size
            deadline = started + self.limits.body_timeout_s + expected / MIN_BODY_BYTES_PER_S
            gap_deadline = last + self.limits.body_timeout_s
            try:
                msg = await asyncio.wait_for(receive(), max(min(deadline, gap_deadline) - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                if gap_deadline <= deadline:
                    what = f"nothing for {self.limits.body_timeout_s:g} s (--body-timeout)"
                    return await _send_error(
                        send, 408, "RequestTimeoutError", f"the request body stopped arriving: {what}"
                    )
                return await _send_error(send, 408, "RequestTimeoutError", _too_slow(size, expected, self.limits))
            last = time.monotonic()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > cap:
                return await _send_error(send, 413, "RequestTooLargeError", _too_large(size, cap, so_far=True))
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, for the handler's checks

        return await self.app(scope, replay, send)


def _too_slow(size: int, expected: int, limits: ServerLimits) -> str:
    of = f" of {expected}" if expected > size else ""
    allowed_s = limits.body_timeout_s + expected / MIN_BODY_BYTES_PER_S
    return (
        f"the request body arrived too slowly: {size}{of} bytes in {allowed_s:.3g} s; "
        f"a body must arrive within --body-timeout ({limits.body_timeout_s:g} s) plus 1 s per "
        f"{MIN_BODY_BYTES_PER_S} bytes (a minimum rate of {MIN_BODY_BYTES_PER_S // 1024} KiB/s); send it faster"
    )


def _too_large(size: int, cap: int, so_far: bool = False) -> str:
    what = f"more than {cap} bytes arrived" if so_far else f"Content-Length is {size} bytes"
    return f"the request body is too large: {what}; the limit is {cap} bytes (--max-body-bytes)"


def limited_h11_protocol(header_timeout_s: float, max_connections: int | None = None):
    """uvicorn's H11Protocol, closing a connection whose request line and headers take longer than
    header_timeout_s (counted from the connection, or from the first byte of a next request), and answering every
    request of a connection opened while max_connections others are open with a 503 (then closing it)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    async def refuse(scope, receive, send) -> None:
        await _send_error(
            send,
            503,
            "ServiceUnavailableError",
            f"the server has its limit of {max_connections} connections open (--max-connections); retry later",
        )

    class LimitedH11(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)  # adds this connection to the server's open ones
            if max_connections is not None and len(self.connections) > max_connections:
                self.app = refuse  # this connection's request gets the 503 (its connection: close ends it)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # the headers are in

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

    return LimitedH11
