"""The launcher's readiness check accepts only its own gateway (the nonce its /health echoes), never another HTTP
server answering 200 on the port, and only once the gateway knows its workers' context length (its /health's
`max_model_len`; before that every request gets 503 "retry shortly"); the gateway tells clients when to come back (Retry-After) when no worker can serve
them (503), which is what they see while the launcher restarts a worker; the supervisor's backoff doubles while a
service keeps failing, is logged with the service's name and exit code, and `--no-restart` raises instead."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from deploy.launcher import INSTANCE_HEADER, _http_ready
from deploy.supervisor import RestartPolicy, ServiceExited, Supervisor
from gateway.protocol.errors import mesh_api_error


class _Health(BaseHTTPRequestHandler):
    nonce: str | None = None
    body = b'{"status": "ok", "workers": {}, "max_model_len": 4096}'

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        if self.nonce:
            self.send_header(INSTANCE_HEADER, self.nonce)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("served_nonce, ready", [(None, False), ("other", False), ("ours", True)])
def test_readiness_needs_the_launchs_own_nonce(served_nonce, ready):
    with _serving(type("Handler", (_Health,), {"nonce": served_nonce})) as url:
        assert _http_ready(url, "ours") is ready
        assert _http_ready(url)  # without a nonce (other callers): any 200 that knows the context length


@pytest.mark.parametrize("body", [b'{"status": "ok", "workers": {}, "max_model_len": null}', b"ok", b""])
def test_readiness_needs_the_workers_context_length(body):
    with _serving(type("Handler", (_Health,), {"nonce": "ours", "body": body})) as url:
        assert not _http_ready(url, "ours")


@contextmanager
def _serving(handler):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_unavailable_mesh_answers_503_with_retry_after():
    error = mesh_api_error(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
    assert error.status == 503 and int(error.headers["Retry-After"]) > 0
    assert "Retry-After" not in mesh_api_error(grpc.StatusCode.INTERNAL, "bug").headers


class _Proc:
    def __init__(self, code):
        self.returncode, self.pid = code, 4242

    def poll(self):
        return self.returncode


class _Service:
    role = name = "prefill"

    def __init__(self):
        self.proc = _Proc(-9)

    @property
    def alive(self):
        return self.proc.returncode is None


def test_restarts_back_off_and_are_logged(capsys):
    service, starts = _Service(), []

    def start(s):
        starts.append(s.role)
        s.proc = _Proc(None)

    sup = Supervisor([service], RestartPolicy(first_backoff_s=1, max_backoff_s=3, stable_after_s=100),
                     lambda s: True, start)
    delays = []
    now = 0.0
    for restarted in range(4):  # dies at once after every start: 1 s, 2 s, 3 s (capped), 3 s
        service.proc = _Proc(-9)
        sup.check(service, now)
        restart_at = sup._children["prefill"].restart_at
        delays.append(restart_at - now)
        sup.check(service, restart_at - 0.01)
        assert len(starts) == restarted  # not before the backoff has passed
        now = restart_at
        sup.check(service, now)
        sup.check(service, now)  # alive: logged as serving again
    assert delays == [1, 2, 3, 3] and sup.restarts == {"prefill": 4} and starts == ["prefill"] * 4
    err = capsys.readouterr().err
    assert "the prefill service exited (code -9); restarting it in 1.0 s" in err
    assert "restart 4 of it, 4 in total" in err and "the prefill service is serving again" in err


def test_no_restart_raises_naming_the_service():
    sup = Supervisor([_Service()], RestartPolicy(enabled=False), lambda s: True, lambda s: None)
    with pytest.raises(ServiceExited, match=r"the prefill service exited \(code -9\)"):
        sup.check(sup.services[0], 0.0)
