"""Test helper: a loopback HTTP server (a free port, `http.server` in a daemon thread) answering fixed routes, for
the gateway's image URL fetching (gateway/media_fetch.py).

`MediaServer({path: Reply})` as a context manager: `url(path, host="127.0.0.1")` names a route (another host name
for the same server, e.g. "localhost", tests the host rule by name); `hits[path]` counts the GETs of each path.
A `Reply` gives the status, body, Content-Type, extra headers (e.g. `Location`), and optionally a slow body (chunked,
`chunk_delay_s` between 64-byte chunks) or one without Content-Length (chunked, no delay). A path with no route is 404.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CHUNK = 64


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b""
    content_type: str | None = "image/png"
    headers: tuple[tuple[str, str], ...] = ()
    chunked: bool = False  # no Content-Length: the body comes in chunks
    chunk_delay_s: float = 0.0  # with chunked: the wait before each chunk


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path.split("?", 1)[0]
        self.server.hits[path] += 1
        reply = self.server.routes.get(path, Reply(404, b"not found", "text/plain"))
        self.send_response(reply.status)
        if reply.content_type is not None:
            self.send_header("Content-Type", reply.content_type)
        for name, value in reply.headers:
            self.send_header(name, value.replace("{port}", str(self.server.server_address[1])))
        self.send_header("Connection", "close")
        try:
            if reply.chunked:
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._chunks(reply)
            else:
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a deadline or a size limit): expected

    def _chunks(self, reply: Reply) -> None:
        for start in range(0, len(reply.body), CHUNK):
            time.sleep(reply.chunk_delay_s)
            chunk = reply.body[start:start + CHUNK]
            self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args):  # quiet
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    routes: dict[str, Reply]
    hits: collections.Counter


class MediaServer:
    def __init__(self, routes: dict[str, Reply]):
        self.routes = routes
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def hits(self) -> collections.Counter:
        return self._server.hits

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def __enter__(self) -> "MediaServer":
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.routes, self._server.hits = self.routes, collections.Counter()
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
