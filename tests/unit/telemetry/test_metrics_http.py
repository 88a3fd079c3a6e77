"""telemetry/metrics_http.py: the side `/metrics` server answers HEAD as valid HTTP (headers of GET, no body), which
aiohttp — the client of aiperf's reachability check — accepts; prometheus_client's own server (405 with a body) is
the negative control that aiohttp rejects."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from telemetry.metrics import RpcMetrics, start_metrics_server


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    RpcMetrics(registry, "decode").requests.labels("Decode", "OK").inc()
    return registry


async def _head_then_get(port: int) -> tuple[int, dict, int, dict, str]:
    """HEAD then GET on one keep-alive aiohttp session (a body after HEAD would corrupt the second response)."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.head(f"http://127.0.0.1:{port}/metrics") as head:
            head_status, head_headers = head.status, dict(head.headers)
        async with session.get(f"http://127.0.0.1:{port}/metrics") as get:
            return head_status, head_headers, get.status, dict(get.headers), await get.text()


def _raw_head(port: int) -> bytes:
    """Everything the server sends for one HEAD before it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_head_has_the_headers_of_get_and_no_body():
    server = start_metrics_server(0, "127.0.0.1", _registry())
    try:
        head_status, head_headers, get_status, get_headers, text = asyncio.run(_head_then_get(server.port))
        raw = _raw_head(server.port)
    finally:
        server.close()
    assert head_status == get_status == 200
    assert head_headers["Content-Type"].startswith("text/plain")
    for header in ("Content-Type", "Content-Length", "Content-Encoding"):  # gzip: aiohttp asks for it
        assert head_headers.get(header) == get_headers.get(header), header
    headers, _, body = raw.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.0 200") and body == b""
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert "kdamesh_decode_requests_total" in names


def test_other_methods_are_refused_with_allow_naming_head():
    async def post(port: int) -> tuple[int, str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.post(f"http://127.0.0.1:{port}/metrics", data=b"x") as reply:
                return reply.status, reply.headers["Allow"]

    server = start_metrics_server(0, "127.0.0.1", _registry())
    try:
        status, allow = asyncio.run(post(server.port))
    finally:
        server.close()
    assert status == 405 and "HEAD" in allow and "GET" in allow


def test_negative_control_prometheus_client_server_fails_aiohttp_head():
    """The server the services used before: HEAD is a 405 with a body, which aiohttp reads as invalid HTTP on the
    next response of the connection (or refuses at once)."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=_registry())
    try:
        try:
            head_status, _, get_status, _, _ = asyncio.run(_head_then_get(server.server_port))
            failed = head_status != 200 or get_status != 200
        except aiohttp.ClientError:
            failed = True
        raw = _raw_head(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert failed
    assert raw.partition(b"\r\n\r\n")[2] != b""  # a body after a HEAD: what makes it invalid HTTP
