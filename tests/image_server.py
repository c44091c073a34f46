"""A real threaded HTTP origin on 127.0.0.1 for tests and benches: serves given bytes at given
paths and counts, per path, the requests it answered and the body bytes it managed to send.

    with ImageServer(latency=0.02) as server:
        url = server.add("/cat.png", png_bytes)
        ...
        assert server.hits("/cat.png") == 1

Besides plain files it can stream a body forever, redirect, stall before the headers or the
body, lie about Content-Length, honour or ignore Range, and pick the body by a request header.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
_CHUNK = 64 * 1024


@dataclass
class _Route:
    body: bytes = b""
    content_type: str = "application/octet-stream"
    status: int = 200
    location: str | None = None  # a redirect target
    stream_forever: bool = False
    header_delay: float = 0.0  # seconds before the status line is sent
    body_delay: float = 0.0  # seconds between the headers and the body
    declared_length: int | None = None  # Content-Length to announce instead of the real one
    honour_range: bool = True
    variant_header: str | None = None  # the request header choosing among variants
    variants: dict[str, bytes] = field(default_factory=dict)
    drip_interval: float = 0.0  # seconds between single bytes of the body
    headers: dict[str, str] = field(default_factory=dict)  # sent with the body (Cache-Control, ...)


class _OriginHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The default backlog of 5 drops SYNs when a client opens several connections at once,
    # and each dropped one costs a 1 s retransmit: a stall no real origin would show.
    request_queue_size = 128


class ImageServer:
    """A local origin in a background thread; every `add_*` returns the URL of what it added."""

    def __init__(
        self, *, latency: float = 0.0, send_buffer: int = 64 * 1024, host: str = "127.0.0.1"
    ) -> None:
        self.latency = latency  # added before every answer, standing in for a remote origin
        self.send_buffer = send_buffer  # small, so bytes counted as sent stay close to bytes read
        self._routes: dict[str, _Route] = {}
        self._hits: Counter[str] = Counter()
        self._bytes_sent: Counter[str] = Counter()
        self._request_headers: dict[str, list[dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # `host`: another loopback address (127.0.0.2: Linux answers on all of 127.0.0.0/8) is an
        # origin that an allowlist of 127.0.0.1 does not cover
        self.host = host
        self._httpd = _OriginHTTPServer((host, 0), _handler_for(self))
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> ImageServer:
        self._thread = threading.Thread(
            # a short poll keeps stop() (hence every test's teardown) fast
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.02},
            name="image-server",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes handlers sleeping in a delay or streaming forever
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ImageServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # --- routes ------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def url(self, path: str, *, host: str = "") -> str:
        return f"http://{host or self.host}:{self.port}{path}"

    def add(
        self,
        path: str,
        body: bytes,
        *,
        content_type: str = "image/png",
        status: int = 200,
        header_delay: float = 0.0,
        body_delay: float = 0.0,
        declared_length: int | None = None,
        honour_range: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Serve `body` at `path`, under any query string unless one added with it matches exactly."""
        return self._add(
            path,
            _Route(
                body=body,
                content_type=content_type,
                status=status,
                header_delay=header_delay,
                body_delay=body_delay,
                declared_length=declared_length,
                honour_range=honour_range,
                headers=dict(headers or {}),
            ),
        )

    def add_stream_forever(self, path: str, *, content_type: str = "image/png", chunk: bytes = b"") -> str:
        """A body with no length that never ends; the count of bytes sent shows when a client quit."""
        return self._add(
            path, _Route(body=chunk or b"\0" * _CHUNK, content_type=content_type, stream_forever=True)
        )

    def add_drip(self, path: str, body: bytes, *, interval: float, content_type: str = "image/png") -> str:
        """`body` sent one byte every `interval` seconds: each read is quick, the whole is slow."""
        return self._add(path, _Route(body=body, content_type=content_type, drip_interval=interval))

    def add_redirect(self, path: str, location: str, *, status: int = 302) -> str:
        return self._add(path, _Route(status=status, location=location))

    def add_variants(
        self, path: str, header: str, variants: Mapping[str, bytes], *, content_type: str = "image/png"
    ) -> str:
        """Serve the body keyed by the request's `header` value (404 for an unknown value)."""
        return self._add(
            path, _Route(content_type=content_type, variant_header=header.lower(), variants=dict(variants))
        )

    def _add(self, path: str, route: _Route) -> str:
        with self._lock:
            self._routes[path] = route
        return self.url(path)

    # --- what happened -----------------------------------------------------------------------
    def hits(self, path: str) -> int:
        """Requests to `path` as the client sent it (query string included)."""
        with self._lock:
            return self._hits[path]

    def bytes_sent(self, path: str) -> int:
        """Body bytes the kernel accepted for `path`, over every request to it."""
        with self._lock:
            return self._bytes_sent[path]

    def request_headers(self, path: str) -> list[dict[str, str]]:
        """Headers of each request to `path`, names lower-cased, oldest first."""
        with self._lock:
            return list(self._request_headers.get(path, []))

    def reset_counts(self) -> None:
        with self._lock:
            self._hits.clear()
            self._bytes_sent.clear()
            self._request_headers.clear()

    def _record(self, path: str, headers: dict[str, str]) -> _Route | None:
        with self._lock:
            self._hits[path] += 1
            self._request_headers.setdefault(path, []).append(headers)
            # an exact match (query included) first, else the same path under any query string
            return self._routes.get(path) or self._routes.get(path.partition("?")[0])

    def _sent(self, path: str, n: int) -> None:
        with self._lock:
            self._bytes_sent[path] += n


def _handler_for(server: ImageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: the simplest origin to reason about

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, server.send_buffer)

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            headers = {name.lower(): value for name, value in self.headers.items()}
            route = server._record(self.path, headers)
            if server.latency and server._stopping.wait(server.latency):
                return
            if route is None:
                self._answer(404, b"not found", "text/plain")
                return
            if route.header_delay and server._stopping.wait(route.header_delay):
                return
            # the client giving up is what many tests provoke
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
                self._serve(route, headers)

        def _serve(self, route: _Route, headers: dict[str, str]) -> None:
            if route.location is not None:
                self.send_response(route.status)
                self.send_header("Location", route.location)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if route.stream_forever:
                self.send_response(200)
                self.send_header("Content-Type", route.content_type)
                self.end_headers()
                while not server._stopping.is_set():
                    self._write(route.body)
                return
            body = route.body
            if route.variant_header is not None:
                chosen = route.variants.get(headers.get(route.variant_header, ""))
                if chosen is None:
                    self._answer(404, b"no such variant", "text/plain")
                    return
                body = chosen
            status, extra = route.status, dict(route.headers)
            wanted = _RANGE.match(headers.get("range", "")) if route.honour_range else None
            if wanted and status == 200 and body:
                first = int(wanted.group(1))
                last = min(int(wanted.group(2) or len(body) - 1), len(body) - 1)
                if first < len(body):
                    extra["Content-Range"] = f"bytes {first}-{last}/{len(body)}"
                    body, status = body[first : last + 1], 206
            self.send_response(status)
            self.send_header("Content-Type", route.content_type)
            self.send_header("Content-Length", str(route.declared_length or len(body)))
            for name, value in extra.items():
                self.send_header(name, value)
            self.end_headers()
            if route.body_delay and server._stopping.wait(route.body_delay):
                return
            if route.drip_interval:
                for offset in range(len(body)):
                    self._write(body[offset : offset + 1])
                    self.wfile.flush()
                    if server._stopping.wait(route.drip_interval):
                        return
                return
            for offset in range(0, len(body), _CHUNK):
                self._write(body[offset : offset + _CHUNK])

        def _write(self, data: bytes) -> None:
            self.wfile.write(data)
            server._sent(self.path, len(data))

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler
