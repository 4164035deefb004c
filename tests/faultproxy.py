"""A fault-injecting HTTP proxy on loopback, in front of the S3 test server (tests/s3server.py).

``FaultProxy(upstream)`` listens on 127.0.0.1 and forwards every request to
``upstream`` (the moto server's endpoint), except that a configurable share of
requests (``rate``, drawn from a seeded generator) meets one of these faults:

``refuse``
    the connection is reset before any answer, as by a server that went away;
``500`` / ``503``
    an S3 error answer (``InternalError`` / ``SlowDown``) without forwarding;
``reset``
    the request is forwarded (so it may take effect), then the connection is
    reset half-way through the answer's bytes;
``stall``
    nothing is answered for ``stall_seconds``, then the connection is reset;
``corrupt``
    the answer to a GET arrives complete, with one byte of its body flipped
    (only when asked for: it is not a fault retries can see);
``denied``
    a 403 ``AccessDenied`` answer, as for missing or wrong credentials (only when asked for).

``hold(match)`` holds every request for which ``match(method, path)`` is true
(after its body has arrived, before it is forwarded) until ``release()`` or
the proxy stops, however long that takes: writes kept on their way while the
test does something else. ``holding`` is set once the first one is held.

``counts`` says how many requests came and how many met each fault;
``get_bytes``, how many bytes of GET answers it forwarded; ``dealt``, the
method and path of each request dealt with (a held write forwarded, its
answer sent or its client gone). ``wait_dealt(match, n)`` returns once every
request that came has been dealt with, ``n`` of them requests that ``match``:
so a test can wait for a write a client started even before the proxy has
read it. The
proxy runs in threads of the test process; spawned ranks reach it over
loopback like any S3 endpoint. It never talks to anything but 127.0.0.1.

A :class:`Client` runs the client (``run_ranks`` of the rank that writes
through the proxy) in a thread of the test, so that the test waits for an
event of the proxy's, such as ``holding``, or for the client's end, whichever
comes first, rather than for a number of seconds a busy machine may exceed.

    with FaultProxy(s3.endpoint, rate=0.2) as proxy:
        tsckpt.save(sd, {"url": "s3://bucket/run", "endpoint": proxy.endpoint})
        print(proxy.counts)
"""

from __future__ import annotations

import collections
import http.client
import random
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import Any

HOST = "127.0.0.1"
#: The faults that a client's retries are meant to ride out.
TRANSIENT = ("refuse", "500", "503", "reset", "stall")
_S3_ERRORS = {"500": (500, "InternalError", "We encountered an internal error. Please try again."),
              "503": (503, "SlowDown", "Please reduce your request rate."),
              "denied": (403, "AccessDenied", "Access Denied")}
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "expect", "upgrade", "te"}


class FaultProxy:
    """Forward HTTP to ``upstream``; inject faults into ``rate`` of the requests (see the module docstring)."""

    def __init__(self, upstream: str, *, rate: float = 0.0, kinds: tuple[str, ...] = TRANSIENT, seed: int = 0,
                 stall_seconds: float = 2.0):
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.hostname != HOST:
            raise ValueError(f"FaultProxy forwards to {HOST} only, not {upstream!r}")
        self.upstream = (parsed.hostname, parsed.port or 80)
        self.stall_seconds = stall_seconds
        self._lock = threading.RLock()
        self._random = random.Random(seed)
        self.rate, self.kinds = rate, kinds
        self._change: tuple[int, float, tuple[str, ...]] | None = None
        self.counts: collections.Counter[str] = collections.Counter()
        #: Bytes of GET answer bodies forwarded: what the clients fetched from storage.
        self.get_bytes = 0
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._hold: Any = None
        self._gate = threading.Event()
        #: Set once a request is held by :meth:`hold`.
        self.holding = threading.Event()
        self._active = 0
        self._settled = threading.Condition(self._lock)
        #: ``(method, path)`` of each request dealt with, in the order they were.
        self.dealt: list[tuple[str, str]] = []

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start the proxy first"
        return f"http://{HOST}:{self._server.server_address[1]}"

    def set(self, *, rate: float | None = None, kinds: tuple[str, ...] | None = None, after: int = 0) -> None:
        """Change the share of faulted requests, or which faults, ``after`` requests from now."""
        with self._lock:
            self._change = (self.counts["requests"] + after,
                            self.rate if rate is None else rate, self.kinds if kinds is None else kinds)

    def hold(self, match: Any) -> None:
        """Hold each request for which ``match(method, path)`` is true until :meth:`release` or :meth:`stop`."""
        with self._lock:
            self._hold = match
            self._gate.clear()
            self.holding.clear()

    def release(self) -> None:
        """Forward the held requests, and every later one at once."""
        self._gate.set()

    def wait_if_held(self, method: str, path: str) -> None:
        with self._lock:
            match = self._hold if not self._gate.is_set() else None
        if match is not None and match(method, path):
            self.holding.set()
            # No time limit: a held write let go after a while would land whenever that is, not when the
            # test means it to. A test that fails before its release() lets go in stop().
            self._gate.wait()

    def wait_dealt(self, match: Any, count: int, timeout: float = 600) -> bool:
        """Wait until ``count`` requests for which ``match(method, path)`` is true have been dealt with, and no
        request is being dealt with; False if not after ``timeout`` seconds (a guard against a hang)."""
        with self._settled:
            return self._settled.wait_for(
                lambda: self._active == 0 and sum(1 for m, p in self.dealt if match(m, p)) >= count, timeout)

    def _begin(self) -> None:
        with self._settled:
            self._active += 1

    def _end(self, method: str, path: str) -> None:
        with self._settled:
            self._active -= 1
            self.dealt.append((method, path))
            self._settled.notify_all()

    @property
    def faulted(self) -> int:
        with self._lock:
            return sum(n for kind, n in self.counts.items() if kind != "requests")

    def summary(self) -> str:
        with self._lock:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items()) if k != "requests")
            return f"{self.counts['requests']} requests, {self.faulted} faulted ({kinds or 'none'})"

    def draw(self) -> str | None:
        """Count a request and pick its fault (None: forward it untouched)."""
        with self._lock:
            if self._change is not None and self.counts["requests"] >= self._change[0]:
                _, self.rate, self.kinds = self._change
                self._change = None
            self.counts["requests"] += 1
            if not self.kinds or self._random.random() >= self.rate:
                return None
            kind = self._random.choice(self.kinds)
            self.counts[kind] += 1
            return kind

    def start(self) -> FaultProxy:
        server = ThreadingHTTPServer((HOST, 0), _Handler)
        server.daemon_threads = True
        server.proxy = self  # type: ignore[attr-defined]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="fault-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release()  # a held request ends with the proxy rather than keep its thread waiting
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class Client(threading.Thread):
    """``call()`` in a thread of the test: its ``result``, or the ``error`` it raised."""

    def __init__(self, call: Callable[[], Any]):
        super().__init__(daemon=True)
        self.call, self.result, self.error = call, None, None

    def run(self) -> None:
        try:
            self.result = self.call()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def wait_for(self, condition: Callable[[], bool]) -> bool:
        """Wait until ``condition()`` or the call has ended; whether ``condition()`` holds."""
        while not condition():
            if not self.is_alive():
                return condition()
            self.join(0.05)
        return True

    def said(self) -> str:
        """What the call ended with, for a failing test's message."""
        if self.is_alive():
            return "it has not ended"
        return f"it ended with {self.result!r}" if self.error is None else f"it failed: {self.error}"


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (RST), not an orderly FIN: what a crashed or cut-off server looks like."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and 100-continue, as S3 speaks

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def do_GET(self) -> None:
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _handle(self) -> None:
        proxy: FaultProxy = self.server.proxy  # type: ignore[attr-defined]
        proxy._begin()
        try:
            self._answer(proxy)
        finally:
            proxy._end(self.command, self.path)

    def _answer(self, proxy: FaultProxy) -> None:
        fault = proxy.draw()
        if fault == "refuse":
            self.close_connection = True
            _reset(self.connection)
            return
        body = self._body()
        proxy.wait_if_held(self.command, self.path)
        if fault == "stall":
            time.sleep(proxy.stall_seconds)
            self.close_connection = True
            _reset(self.connection)
            return
        if fault in _S3_ERRORS:
            status, code, text = _S3_ERRORS[fault]
            payload = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
                       f"<Message>{text}</Message></Error>").encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        status, reason, headers, answer = self._forward(proxy, body)
        if self.command == "GET":
            with proxy._lock:
                proxy.get_bytes += len(answer)
        if fault == "corrupt" and self.command == "GET" and answer:
            flipped = bytearray(answer)
            flipped[len(flipped) // 2] ^= 0x01
            answer = bytes(flipped)
        head = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers]
        raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (b"" if self.command == "HEAD" else answer)
        if fault == "reset":
            self.wfile.write(raw[: max(len(raw) // 2, 1)])
            self.close_connection = True
            _reset(self.connection)
            return
        self.wfile.write(raw)

    def _forward(self, proxy: FaultProxy, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            answer = resp.read()
            out = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP | {"content-length"}]
            length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(answer))
            out.append(("Content-Length", length or "0"))
            return resp.status, resp.reason, out, answer
        finally:
            conn.close()
