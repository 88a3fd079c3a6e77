"""End to end: `kdamesh serve MODEL` with the `vllm serve` seed command line (tiny-k3 as the model) serves
/v1/models with the engine's real context length and a chat completion through the official `openai` client; the
launcher restarts a prefill worker and a cache service killed with SIGKILL and the mesh serves again without a manual
restart; with `--no-restart` a killed worker stops the launcher (non-zero); a busy port fails within seconds,
naming the port, before any model loads."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai

from deploy.launcher import free_port
from engine.config import EngineArgs, plan_cache
from engine.model.checkpoint import make_checkpoint
from engine.model.config import load_model_config
from tests.e2e.launched import MODEL, kdamesh, launch, stop

SEED_FLAGS = ["--tensor-parallel-size", "1", "--trust-remote-code", "--load-format", "fastsafetensors",
              "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3",
              "--reasoning-parser", "kimi_k3"]
MESSAGES = [{"role": "user", "content": "Name three rivers of Europe and say which one is the longest."}]


def _role_pid(launcher: int, role: str) -> int:
    """The pid of the launcher's child that runs `serve --role ROLE`."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == launcher and b"--role" in argv and argv[argv.index(b"--role") + 1] == role.encode():
            return int(entry.name)
    raise AssertionError(f"no {role} child of {launcher}")


def _wait_for_log(log: Path, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"no {text!r} in the launcher's log:\n{log.read_text()[-3000:]}"
        time.sleep(0.3)


def _chat_until_served(client: openai.OpenAI, timeout_s: float = 90) -> openai.types.chat.ChatCompletion:
    """A chat completion, retried while the mesh answers 503 (a service restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def _served_calls(metrics_url: str) -> int:
    """gRPC calls other than health checks that a service answered OK (its /metrics, since it last started)."""
    text = httpx.get(metrics_url, timeout=10).text
    return sum(int(float(n)) for method, n in re.findall(r'_requests_total\{method="([^"]+)",status="OK"\} (\S+)', text)
               if "Health" not in method)


def _assert_peers_reconnected(launched, client: openai.OpenAI, timeout_s: float = 60) -> None:
    """The gateway's channel to the restarted prefill worker and the workers' channels to the restarted cache
    service carry calls again: remote prefills land on the new prefill process, which publishes to the new cache."""
    metrics = json.loads(next(line for line in launched.log.read_text().splitlines()
                              if line.startswith("metrics "))[len("metrics "):])
    deadline = time.monotonic() + timeout_s
    while _served_calls(metrics["prefill"]) == 0 or _served_calls(metrics["cache"]) == 0:
        assert time.monotonic() < deadline, "no calls reached the restarted prefill worker and cache service"
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Count to {time.time()}"}],
                                       max_tokens=2, temperature=0)
        time.sleep(1)


def test_seed_command_serves_and_survives_killed_services(tmp_path):
    launched = launch(tmp_path, "endpoints ", command="serve", up_flags=SEED_FLAGS)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{launched.port}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        config = load_model_config(launched.model)
        engine = EngineArgs(model=str(launched.model), max_num_seqs=8, kv_cache_memory="32MiB")
        expected = plan_cache(engine, config, 4).max_model_len  # float32 on CPU
        card = httpx.get(f"http://127.0.0.1:{launched.port}/v1/models").json()["data"][0]
        assert card["id"] == MODEL and card["max_model_len"] == expected < config.max_position_embeddings
        reply = _chat_until_served(client, timeout_s=0)
        assert reply.usage.completion_tokens == 6 and reply.choices[0].finish_reason == "length"

        for role in ("prefill", "cache"):
            os.kill(_role_pid(launched.proc.pid, role), signal.SIGKILL)
            _wait_for_log(launched.log, f"the {role} service exited (code -9); restarting it in")
            _wait_for_log(launched.log, f"the {role} service is serving again")
            assert launched.proc.poll() is None
        assert _chat_until_served(client).usage.completion_tokens == 6
        assert "restarted the cache service" in launched.log.read_text()
        _assert_peers_reconnected(launched, client)
    finally:
        stop(launched.proc)


def test_no_restart_stops_the_mesh_when_a_service_dies(tmp_path):
    launched = launch(tmp_path, "endpoints ", command="serve", up_flags=["--mode", "colocated", "--no-restart"])
    try:
        os.kill(_role_pid(launched.proc.pid, "decode"), signal.SIGKILL)
        assert launched.proc.wait(timeout=60) == 1
        assert "the decode service exited (code -9); stopping the mesh" in launched.log.read_text()
    finally:
        stop(launched.proc)


def test_a_busy_port_fails_fast_naming_it_before_any_model_loads(tmp_path):
    model = make_checkpoint(MODEL, tmp_path / MODEL, seed=3)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run([*kdamesh(), "serve", str(model), "--port", str(port), "--grpc-port",
                              str(free_port())], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "KDAMESH_HOME": str(tmp_path / "home")})
        elapsed = time.monotonic() - t0
    text = out.stdout + out.stderr
    assert out.returncode != 0 and elapsed < 15, (out.returncode, elapsed, text)
    assert f"port {port}" in text and "already in use" in text
    assert "loading" not in text and "listening" not in text
