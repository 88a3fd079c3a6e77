"""`kdamesh up`: the whole mesh on localhost — cache, prefill, decode and gateway as separate processes.

Contract:
- `up(config)` first checks, before any process starts or model loads, that the model folder exists, that every
  port the mesh will listen on is free (a busy one: an error naming it, exit 2) and that the engine options fit
  (`engine_max_model_len`, the cache plan of the same `EngineArgs` the workers get: options they would refuse
  fail here; the gateway learns the context length from the workers themselves). It starts
  the cache service, then the prefill (disaggregated mode only) and decode workers, then the gateway, each as its
  own process (`python -m deploy.cli serve --role …`) on the given ports or free ones; waits until each reports
  ready (gRPC health SERVING; the gateway's `GET /health` 200 carrying the launch's random nonce in
  X-Kdamesh-Instance, so another server on the port never passes, and a `max_model_len`: the gateway has heard
  its workers' context length, so the first request is admitted, never a 503 "retry shortly"); prints the endpoints; and serves until SIGINT
  (Ctrl-C) or SIGTERM. A service that exits is restarted with backoff on the same ports (deploy/supervisor.py;
  `restart=False`, `--no-restart`: the mesh stops instead). Then it stops everything — gateway first, cache last —
  with SIGTERM, and SIGKILL after `stop_timeout_s`. Returns 0 after a requested stop, 1 when a service failed.
- No orphans: every child gets `PR_SET_PDEATHSIG` (SIGTERM) on Linux, so it also ends if the launcher is killed.
- Without `--model`, the mesh serves the shipped trained `demo-k3` (deploy/models/demo-k3, deploy/checkpoints.py).
- Pools: `prefill_replicas` / `decode_replicas` workers of each role (`--prefill-replicas N --decode-replicas M`),
  each with its own gRPC and metrics port, all supervised; the gateway gets every address (deploy/mesh_plan.py).
- Salt secret: the gateway gets `KDAMESH_CACHE_SALT_SECRET` — the launcher's own, else a fresh random one per
  launch — so a restarted gateway derives the same tenant salts (gateway/tenancy.py).
- The gateway also serves the public gRPC API on `gateway_grpc_port` (default: the port after the last worker's
  when `grpc_port` is given, else a free port), printed as a `gateway_grpc HOST:PORT` line. Its output parsers default to the model's
  family (`--tool-call-parser` / `--reasoning-parser` "auto", `--enable-auto-tool-choice` on); "none" turns one
  off. API keys: `KDAMESH_API_KEYS` in the launcher's environment (or `api_keys`) and `api_keys_file` reach the
  gateway only; without keys the mesh is open. Mesh token: every child gets the same `KDAMESH_MESH_TOKEN` (the
  launcher's own, else a fresh random one per launch), so the workers and the cache accept calls from the mesh only.
- Observability: every child gets the launcher's `--log-level`, `--log-format` and `--trace-exporter` (and the
  `OTEL_*` environment); cache, prefill and decode serve Prometheus `/metrics` on side ports (`metrics_port` and the
  next two, else free ports), printed with the endpoints and as a `metrics {role: url}` JSON line (the gateway's is
  its REST `/metrics`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from telemetry.options import to_argv
from telemetry.mesh_auth import MESH_TOKEN_ENV, mesh_token_from_env, new_mesh_token
from gateway.tenancy import SALT_SECRET_ENV
from deploy.checkpoints import default_model_dir, resolve_model
from deploy.mesh_plan import (API_KEYS_ENV, FAMILY_FORMATS, MODES, LaunchConfig, Service,  # noqa: F401 (re-exported)
                              PLANNED, Wiring, free_port, plan_services)
from deploy.supervisor import RestartPolicy, Supervisor

INSTANCE_HEADER = "X-Kdamesh-Instance"  # the gateway's /health echoes its --instance-id


# -- helpers ---------------------------------------------------------------------------------------------------------


def _grpc_ready(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_ready(base_url: str, instance_id: str | None = None) -> bool:
    """GET /health answers 200 with the workers' context length (the gateway has heard from its workers, so it
    admits requests rather than answering 503 "retry shortly") — from our own gateway when `instance_id` is given
    (its X-Kdamesh-Instance header)."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as reply:
            ours = instance_id is None or reply.headers.get(INSTANCE_HEADER) == instance_id
            return reply.status == 200 and ours and json.loads(reply.read()).get("max_model_len") is not None
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return False


def ready(service: Service) -> bool:
    return _http_ready(service.address, service.instance_id) if service.role == "gateway" else \
        _grpc_ready(service.address)


def busy_ports(host: str, ports: list[int]) -> list[int]:
    """The ports of `ports` that something already listens on (or that cannot be bound) at `host`."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no conflict
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


def engine_max_model_len(config: LaunchConfig, model: str) -> int:
    """The context length the workers will enforce: the engine's cache plan of the very `EngineArgs` both get
    (with `--gpu-memory-utilization` each worker measures its pools after loading: here only the upper bound)."""
    from engine.config import plan_cache
    from engine.errors import EngineConfigError
    from engine.model.config import load_model_config
    from engine.model.loader import resolve_dtype

    args = config.options("decode", Wiring(model, PLANNED, PLANNED)).engine
    model_config = load_model_config(model)
    if args.gpu_memory_utilization is not None:  # the pools come from each worker's profile run of its model:
        limit = model_config.max_position_embeddings  # an upper bound here; the gateway asks the workers
        if args.max_model_len is not None and args.max_model_len > limit:
            raise EngineConfigError(f"max_model_len {args.max_model_len} exceeds the model's limit {limit}")
        return args.max_model_len or limit
    dtype = resolve_dtype(args.dtype, args.device, model_config)
    return plan_cache(args, model_config, dtype.itemsize).max_model_len


class _Stop(Exception):
    pass


# -- the mesh --------------------------------------------------------------------------------------------------------


def up(config: LaunchConfig) -> int:
    model = resolve_model(config.model) if config.model else str(default_model_dir())
    services = _preflight(config, model)
    if services is None:
        return 2
    give_mesh_token(services, mesh_token_from_env() or new_mesh_token())  # one per launch, unless set
    give_salt_secret(services, os.environ.get(SALT_SECRET_ENV) or secrets.token_hex(32))
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
        raise _Stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    status = 1
    try:
        for group in (["cache"], ["prefill", "decode"], ["gateway"]):
            started = [s for s in services if s.role in group]
            for s in started:
                s.start(config.log_level, config.log_format, config.trace_exporter)
            wait_ready(started, config.startup_timeout_s)
        _print_endpoints(config, model, services)
        Supervisor(services, RestartPolicy(enabled=config.restart), ready,
                   lambda s: s.start(config.log_level, config.log_format, config.trace_exporter)).watch()
    except _Stop:
        status = 0
        print(f"\nkdamesh up: {signal.Signals(stopping['signal']).name}, stopping the mesh…", flush=True)
    except RuntimeError as exc:
        print(f"kdamesh up: {exc}; stopping the mesh", file=sys.stderr, flush=True)
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):  # a second signal must not interrupt the shutdown
            signal.signal(s, signal.SIG_IGN)
        for s in reversed(services):
            s.stop(max(config.stop_timeout_s, config.grace_s + 10.0))
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


def give_mesh_token(services: list[Service], token: str) -> None:
    """Every service gets `token` in its environment (KDAMESH_MESH_TOKEN)."""
    for s in services:
        s.env = {**(s.env or {}), MESH_TOKEN_ENV: token}


def give_salt_secret(services: list[Service], secret: str) -> None:
    """The gateway gets `secret` as KDAMESH_CACHE_SALT_SECRET (gateway/tenancy.py derives every tenant's cache salt
    from it), in its environment for every restart too: a restarted gateway derives the same salts, so its tenants
    keep their workers' and the cache service's prefix hits."""
    for s in services:
        if s.role == "gateway":
            s.env = {**(s.env or {}), SALT_SECRET_ENV: secret}


def _preflight(config: LaunchConfig, model: str) -> list[Service] | None:
    """The planned services, or None (after printing why) when the model folder, a port or the engine options
    cannot work — checked before any process starts or any model loads."""
    if not (Path(model) / "config.json").is_file():
        print(f"kdamesh up: {model} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return None
    planned = plan_services(config, model)
    busy = busy_ports(config.host, [p for s in planned for p in s.ports])
    if busy:
        print(f"kdamesh up: port {', '.join(map(str, busy))} on {config.host} is already in use; nothing started "
              "(choose another --port / --grpc-port / --metrics-port, or stop what listens there)", file=sys.stderr)
        return None
    try:
        engine_max_model_len(config, model)  # the workers' own plan: options they would refuse fail here, early
    except ValueError as exc:  # EngineConfigError: the workers would refuse these options
        print(f"kdamesh up: {exc}", file=sys.stderr)
        return None
    return _with_gateway_identity(planned, secrets.token_hex(8), config.engine.max_model_len)


def _with_gateway_identity(services: list[Service], instance_id: str, max_model_len: int | None) -> list[Service]:
    """Gives the gateway its readiness nonce (echoed by its /health) and the user's `--max-model-len` as an upper
    bound (None: none); the context length itself the gateway learns from the workers (gateway/worker_pool.py)."""
    gateway = services[-1]
    gateway.instance_id = instance_id
    gateway.options = dataclasses.replace(gateway.options, instance_id=instance_id, max_model_len=max_model_len)
    gateway.argv = to_argv(gateway.options)
    return services


def wait_ready(services: list[Service], timeout_s: float) -> None:
    """Polls until every service is ready; RuntimeError when one exits or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending:
        for s in list(pending):
            if not s.alive:
                raise RuntimeError(f"the {s.role} service exited during start-up (code {s.proc.returncode})")
            if ready(s):
                pending.remove(s)
        if pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{', '.join(s.role for s in pending)} not ready after {timeout_s:.0f} s")
            time.sleep(0.2)


def _print_endpoints(config: LaunchConfig, model: str, services: list[Service]) -> None:
    gateway, cache = services[-1], services[0]
    name = config.gateway.served_model_name or Path(model).name
    lines = [f"kdamesh is up: {config.mode} mesh serving {name} ({model})",
             f"  REST     {gateway.address}/v1   (OpenAI-compatible: /v1/chat/completions, "
             f"/v1/completions, /v1/models; /tokenize, /metrics, /health)",
             f"  gRPC     {gateway.grpc_api}   (kdamesh.v1.Generation, the sdk/ client)",
             f"  cache    {cache.address}   (backend {config.cache.backend}; {cache.metrics})"]
    lines += [f"  {s.name:<8} {s.address}   ({s.metrics})" for s in services if s.role in ("prefill", "decode")]
    lines.append("Ctrl-C or SIGTERM stops everything.")
    lines.append("metrics " + json.dumps({s.name: s.metrics for s in services}))
    lines.append("endpoints " + json.dumps({s.name: s.address for s in services}))
    lines.append(f"gateway_grpc {gateway.grpc_api}")
    print("\n".join(lines), flush=True)
