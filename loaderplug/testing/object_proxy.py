"""A small HTTP proxy in front of an object store, for the tests' faults and the
benchmark's slow links.

Each request is passed on to the store as it came (the ``Host`` header kept, so a
request signed for the proxy is valid at the store) and its answer streamed back,
unless a :class:`Fault` takes it: a 503 SlowDown, a 429, a connection reset
mid-body, an answer that hangs, or a callback run before the answer (to replace the
object mid-read). ``bytes_per_s`` limits every connection's answer bodies and
``latency_s`` delays every answer: a store behind a slow link, where concurrency
decides.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

FaultKind = Literal["slowdown", "throttle", "reset", "hang", "callback"]
_CHUNK = 256 * 1024
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class Fault:
    """What happens to the next ``times`` requests of ``method`` whose path contains
    ``key`` (and, with ``ranged``, that ask for a range)."""

    kind: FaultKind
    key: str = ""
    method: str = "GET"
    times: int = 1
    ranged: bool = True
    hang_s: float = 60.0
    callback: Callable[[], None] | None = None
    skip: int = 0  # matching requests let through before the fault takes any
    hits: int = 0
    seen: int = 0

    def takes(self, method: str, path: str, has_range: bool) -> bool:
        if not (method == self.method and self.key in path and (has_range or not self.ranged)):
            return False
        self.seen += 1
        return self.seen > self.skip and self.hits < self.times


class ObjectProxy:
    """The proxy, on a loopback port, in front of ``upstream`` (``host:port``)."""

    def __init__(self, upstream: str, *, bytes_per_s: float = 0, latency_s: float = 0) -> None:
        self.upstream = upstream
        self.bytes_per_s, self.latency_s = bytes_per_s, latency_s
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str, str]] = []  # method, path, Range
        self.body_bytes = 0  # bytes of answers' bodies passed on
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._server = _Server(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        # A client that hangs up on a fault's answer (a reset, a timeout) is expected.
        self._server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> ObjectProxy:
        self._thread.start()
        return self

    def add(self, fault: Fault) -> Fault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def fault_for(self, method: str, path: str, has_range: bool) -> Fault | None:
        with self._lock:
            self.requests.append((method, path, "range" if has_range else ""))
            for fault in self.faults:
                if fault.takes(method, path, has_range):
                    fault.hits += 1
                    return fault
        return None

    def stop(self) -> None:
        self._release.set()  # hung answers end
        self._server.shutdown()
        self._server.server_close()


class _Server(ThreadingHTTPServer):
    # Clients open dozens of connections at once (runai's streamer at concurrency 32):
    # the default backlog of 5 would drop some, failing their requests.
    request_queue_size = 256


def _handler_for(proxy: ObjectProxy) -> type[BaseHTTPRequestHandler]:
    return type("Handler", (_Handler,), {"proxy": proxy})


class _Handler(BaseHTTPRequestHandler):
    """One connection to the proxy: each request passed on, or taken by a fault."""

    protocol_version = "HTTP/1.1"
    proxy: ObjectProxy

    def log_message(self, format: str, *args: object) -> None:
        return

    def _any(self) -> None:
        proxy = self.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        has_range = "Range" in self.headers
        fault = proxy.fault_for(self.command, self.path, has_range)
        if proxy.latency_s:
            time.sleep(proxy.latency_s)
        if fault is not None and fault.kind != "reset" and self._fault(fault):
            return
        self._forward(body, reset_mid_body=fault is not None and fault.kind == "reset")

    def _fault(self, fault: Fault) -> bool:
        """Answer with ``fault``; False: the request goes on to the store."""
        if fault.kind == "callback":
            assert fault.callback is not None
            fault.callback()
            return False
        if fault.kind == "hang":
            self.proxy._release.wait(fault.hang_s)
            self.close_connection = True
            return True
        status = 503 if fault.kind == "slowdown" else 429
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(_SLOW_DOWN)))
        self.end_headers()
        self.wfile.write(_SLOW_DOWN)
        return True

    def _forward(self, body: bytes, *, reset_mid_body: bool) -> None:
        host, port = self.proxy.upstream.rsplit(":", 1)
        upstream = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            headers = {k: v for k, v in self.headers.items()}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            self.send_response_only(answer.status, answer.reason)
            for name, value in answer.getheaders():
                if name.lower() not in ("transfer-encoding", "connection"):
                    self.send_header(name, value)
            self.end_headers()
            self._stream(answer, reset_mid_body)
        finally:
            upstream.close()

    def _stream(self, answer: http.client.HTTPResponse, reset_mid_body: bool) -> None:
        proxy, sent, started = self.proxy, 0, time.monotonic()
        while chunk := answer.read(_CHUNK):
            if reset_mid_body and sent > 0:
                _reset(self.connection)
                self.close_connection = True
                return
            self.wfile.write(chunk)
            sent += len(chunk)
            with proxy._lock:
                proxy.body_bytes += len(chunk)
            if proxy.bytes_per_s:
                ahead = sent / proxy.bytes_per_s - (time.monotonic() - started)
                if ahead > 0:
                    time.sleep(ahead)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _any


def _reset(connection: socket.socket) -> None:
    """Close ``connection`` with a TCP reset, as a store's dropped connection does."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()
