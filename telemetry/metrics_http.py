"""The side HTTP `/metrics` server of the gRPC services (workers, cache service): valid HTTP for every scraper.

Contract:
- `MetricsServer(port, host, registry)` serves `registry` in the Prometheus text format from daemon threads
  (port 0: a free port; `.port` tells which; `close()` stops it). IPv4 and IPv6 hosts alike ('::' listens on both
  where the system allows).
- `GET /metrics` (and `/`, as prometheus_client): 200 with the exposition (gzip when asked, OpenMetrics when
  asked, `?name[]=` filters — prometheus_client's own WSGI app does the rendering).
- `HEAD` on the same paths: the headers `GET` would send (status, `Content-Type`, `Content-Length`) and no body, as
  HTTP requires. prometheus_client's server answers HEAD with a 405 *carrying a body*, which strict clients (aiohttp,
  so aiperf) reject as invalid HTTP and then report the port unreachable.
- Any other method: 405 with an `Allow` header and a body (a body is allowed there); `OPTIONS`: 200, `Allow`.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

ALLOW = "GET, HEAD, OPTIONS"


def head_aware(app):
    """A WSGI app that answers HEAD as `app` answers GET, without the body (see the module docstring)."""

    def wrapped(environ, start_response):
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, lambda status, headers, exc_info=None: start_response(status, _allow(headers)))
        captured: list = []

        def capture(status, headers, exc_info=None):
            captured[:] = [status, headers]
            return lambda data: None

        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, capture))
        status, headers = captured
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        start_response(status, [*_allow(headers), ("Content-Length", str(len(body)))])
        return [b""]

    return wrapped


def _allow(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """prometheus_client's `Allow` (OPTIONS,GET) with HEAD, which this server answers too."""
    return [(k, ALLOW if k.lower() == "allow" else v) for k, v in headers]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        """Scrapes are not logged (one line per scrape every few seconds is noise)."""


def _server_class(host: str) -> type[WSGIServer]:
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0] if host else socket.AF_INET
    return type("MetricsHttpServer", (_ThreadingServer,), {"address_family": family})


class MetricsServer:
    """A running `/metrics` HTTP server on daemon threads (see the module docstring)."""

    def __init__(self, port: int, host: str, registry: CollectorRegistry):
        self._server = make_server(host, port, head_aware(make_wsgi_app(registry)), _server_class(host),
                                   handler_class=_QuietHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
