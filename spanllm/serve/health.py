"""`spanllm serve --health-port P`: GET /health answered by a small process of its own, from heartbeats.

The main port's /health is answered by the front end's event loop, which under a burst is busy with every
request's JSON and streams (on a 2-core machine it answered in up to 1.5 s). A probe that must answer within
a deadline gets a process that shares neither that event loop nor a GIL with anything else: it reads two
heartbeats from a small shared struct (a file in /dev/shm, mapped by every process) and answers

    200 {"status": "ok", "engine_heartbeat_age_s": ..., "frontend_heartbeat_age_s": ...}
    503 OpenAI's error body, naming the reason: the engine failed (its error), the server is shutting down,
        not started yet, or a heartbeat older than --health-stall-timeout seconds (which one, and how old).

Writers: the engine loop (spanllm.serve.async_engine) after every pass (a step, or 0.5 s of waiting for
commands when idle) and the HTTP front end on each of uvicorn's ticks (every 0.1 s while its event loop runs).
A stale engine heartbeat means a step (or the loop) is stuck; a stale front-end heartbeat, that its event loop
has not run for that long (or its process is gone).

Lifetime: rank 0 starts it with the server (`HealthPort`, `HealthProcess`) and ends it after the server
stopped: it exits on SIGTERM (status 0) or when rank 0 closes its stdin (rank 0 ended, however it ended), so it
is never left behind. It ignores SIGINT: a terminal's Ctrl-C reaches the whole process group, and /health keeps
answering 503 ("shutting down") while the server drains. Only the standard library is imported here.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# The shared struct. Each field is one aligned 8-byte word, written whole by one writer (the engine loop writes
# the engine's fields, the front end the front end's) and read whole by the health process: no lock. The
# message (the engine's error) is written before the state that points readers at it.
_BEATS = struct.Struct("<dd")  # engine heartbeat, front-end heartbeat (time.monotonic(): one clock per host)
_STATES = struct.Struct("<qq")  # engine state, front-end state
_MSG_LEN = struct.Struct("<q")
_OFF_STATES, _OFF_MSG_LEN, _OFF_MSG = 16, 32, 40
SIZE = 512
_MSG_MAX = SIZE - _OFF_MSG

ENGINE_STARTING, ENGINE_RUNNING, ENGINE_STOPPED, ENGINE_FAILED = 0, 1, 2, 3
FRONTEND_STARTING, FRONTEND_SERVING, FRONTEND_STOPPING = 0, 1, 2

DEFAULT_STALL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Snapshot:
    engine_beat: float  # time.monotonic() of the engine loop's last pass; 0: none yet
    frontend_beat: float
    engine_state: int
    frontend_state: int
    message: str


class Heartbeats:
    """The shared struct: `create()` in rank 0 (which removes its file at `close()`), `attach(path)` elsewhere."""

    def __init__(self, path: str, owner: bool) -> None:
        self.path, self.owner = path, owner
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)

    @classmethod
    def create(cls) -> Heartbeats:
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="spanllm-health-", dir=where)
        try:
            os.ftruncate(fd, SIZE)
        finally:
            os.close(fd)
        return cls(path, owner=True)

    @classmethod
    def attach(cls, path: str) -> Heartbeats:
        return cls(path, owner=False)

    def beat_engine(self) -> None:
        struct.pack_into("<d", self._mm, 0, time.monotonic())

    def beat_frontend(self) -> None:
        struct.pack_into("<d", self._mm, 8, time.monotonic())

    def set_engine(self, state: int, message: str = "") -> None:
        data = message.encode("utf-8", "replace")[:_MSG_MAX]
        self._mm[_OFF_MSG : _OFF_MSG + len(data)] = data
        _MSG_LEN.pack_into(self._mm, _OFF_MSG_LEN, len(data))
        struct.pack_into("<q", self._mm, _OFF_STATES, state)

    def set_frontend(self, state: int) -> None:
        struct.pack_into("<q", self._mm, _OFF_STATES + 8, state)

    def read(self) -> Snapshot:
        engine_beat, frontend_beat = _BEATS.unpack_from(self._mm, 0)
        engine_state, frontend_state = _STATES.unpack_from(self._mm, _OFF_STATES)
        (n,) = _MSG_LEN.unpack_from(self._mm, _OFF_MSG_LEN)
        message = bytes(self._mm[_OFF_MSG : _OFF_MSG + max(0, min(n, _MSG_MAX))]).decode("utf-8", "replace")
        return Snapshot(engine_beat, frontend_beat, engine_state, frontend_state, message)

    def close(self) -> None:
        self._mm.close()
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _error(status: int, type_: str, message: str) -> tuple[int, dict]:
    # OpenAI's error shape, as spanllm.serve.protocol.error_body (not imported: it brings pydantic).
    return status, {"error": {"message": message, "type": type_, "param": None, "code": status}}


def _unavailable(message: str) -> tuple[int, dict]:
    return _error(503, "ServiceUnavailableError", message)


def verdict(s: Snapshot, now: float, stall_timeout_s: float) -> tuple[int, dict]:
    """(status, body) of /health for a snapshot read at `now` (time.monotonic())."""
    if s.engine_state == ENGINE_FAILED:
        return _unavailable(s.message or "the engine loop failed")
    if s.engine_state == ENGINE_STOPPED or s.frontend_state == FRONTEND_STOPPING:
        return _unavailable("the server is shutting down")
    if s.engine_state == ENGINE_STARTING or s.engine_beat == 0:
        return _unavailable("the engine loop has not started yet")
    if s.frontend_beat == 0:
        return _unavailable("the HTTP front end has not started yet")
    engine_age, frontend_age = now - s.engine_beat, now - s.frontend_beat
    limit = f"--health-stall-timeout {stall_timeout_s:g} s"
    if engine_age > stall_timeout_s:
        return _unavailable(
            f"the engine loop has not completed a pass for {engine_age:.1f} s ({limit}): a step, or the loop, is stuck"
        )
    if frontend_age > stall_timeout_s:
        return _unavailable(
            f"the HTTP front end's event loop has not run for {frontend_age:.1f} s ({limit}): it is blocked, or "
            "its process is gone"
        )
    return 200, {
        "status": "ok",
        "engine_heartbeat_age_s": round(engine_age, 3),
        "frontend_heartbeat_age_s": round(frontend_age, 3),
    }


class HealthProcess:
    """The health process, from rank 0: `start()` returns the port it bound (0: any free port); `close()` ends it."""

    def __init__(self, beats: Heartbeats, *, host: str, port: int, stall_timeout_s: float) -> None:
        self.beats, self.host, self.stall_timeout_s = beats, host, stall_timeout_s
        self._port = port
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> int:
        cmd = [sys.executable, "-m", "spanllm.commands.serve_health", "--state", self.beats.path, "--host", self.host]
        cmd += ["--port", str(self._port), "--stall-timeout", repr(self.stall_timeout_s)]
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = _readline(self._proc.stdout, timeout_s)
        if not line.startswith("port "):
            self.close()
            raise RuntimeError(f"the health process did not start: {line.strip() or 'no answer'}")
        self.port = int(line.split()[1])
        return self.port

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self, timeout_s: float = 5.0) -> None:
        p = self._proc
        if p is None:
            return
        self._proc = None
        try:
            p.stdin.close()  # its signal to exit
        except OSError:
            pass
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.terminate()
            p.wait(timeout_s)
        p.stdout.close()


class HealthPort:
    """`--health-port` for the server's lifetime, as a context manager: the heartbeats and the health process,
    ended and removed however the server ends. `port` None (the flag left out): nothing, and `with` gives None."""

    def __init__(self, host: str, port: int | None, stall_timeout_s: float) -> None:
        self.host, self.port, self.stall_timeout_s = host, port, stall_timeout_s
        self.beats: Heartbeats | None = None
        self.proc: HealthProcess | None = None

    def __enter__(self) -> Heartbeats | None:
        if self.port is None:
            return None
        self.beats = Heartbeats.create()
        self.proc = HealthProcess(self.beats, host=self.host, port=self.port, stall_timeout_s=self.stall_timeout_s)
        try:
            port = self.proc.start()
        except BaseException:
            self.__exit__()
            raise
        print(
            f"spanllm serve: /health also on http://{self.host}:{port}/health "
            f"(stall timeout {self.stall_timeout_s:g} s)",
            flush=True,
        )
        return self.beats

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.close()
        if self.beats is not None:
            self.beats.close()


def _readline(f, timeout_s: float) -> str:
    out: list[str] = []
    t = threading.Thread(target=lambda: out.append(f.readline()), daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0] if out else ""


# --- the health process ---------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    timeout = 5  # seconds a connection may take to send its request
    server: HealthHTTPServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._answer(with_body=True)

    def do_HEAD(self) -> None:  # noqa: N802 - a load balancer's probe: GET's status and headers, no body
        self._answer(with_body=False)

    def _answer(self, with_body: bool) -> None:
        if self.path.split("?", 1)[0] == "/health":
            srv = self.server
            status, body = verdict(srv.beats.read(), time.monotonic(), srv.stall_timeout_s)
        else:
            status, body = _error(404, "NotFoundError", f"{self.path} is not a route of the health port (GET /health)")
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if with_body:
            self.wfile.write(data)

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


class HealthHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, beats: Heartbeats, stall_timeout_s: float) -> None:
        self.address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        self.beats, self.stall_timeout_s = beats, stall_timeout_s
        super().__init__((host, port), _Handler)
