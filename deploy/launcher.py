"""`kdamesh up`: the whole mesh on localhost — cache, prefill, decode and gateway as separate processes.

Contract:
- `up(config)` first checks, before any process starts or model loads, that the model folder exists, that every
  port the mesh will listen on is free (a busy one: an error naming it, exit 2) and that the engine options fit
  (the workers' context length, `engine_max_model_len`, which the gateway then reports in /v1/models). It starts
  the cache service, then the prefill (disaggregated mode only) and decode workers, then the gateway, each as its
  own process (`python -m deploy.cli serve --role …`) on the given ports or free ones; waits until each reports
  ready (gRPC health SERVING; the gateway's `GET /health` 200 carrying the launch's random nonce in
  X-Kdamesh-Instance, so another server on the port never passes); prints the endpoints; and serves until SIGINT
  (Ctrl-C) or SIGTERM. A service that exits is restarted with backoff on the same ports (deploy/supervisor.py;
  `restart=False`, `--no-restart`: the mesh stops instead). Then it stops everything — gateway first, cache last —
  with SIGTERM, and SIGKILL after `stop_timeout_s`. Returns 0 after a requested stop, 1 when a service failed.
- No orphans: every child gets `PR_SET_PDEATHSIG` (SIGTERM) on Linux, so it also ends if the launcher is killed.
- Without `--model`, the `small-k3` generated checkpoint is created on first run under
  `$KDAMESH_HOME/checkpoints/small-k3` (default `~/.cache/kdamesh`) and reused afterwards.
- The gateway also serves the public gRPC API on `gateway_grpc_port` (default: `grpc_port + 3` when `grpc_port` is
  given, else a free port), printed as a `gateway_grpc HOST:PORT` line. Its output parsers default to the model's
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

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from telemetry.mesh_auth import MESH_TOKEN_ENV, mesh_token_from_env, new_mesh_token
from deploy.checkpoints import default_model_dir, resolve_model
from deploy.supervisor import RestartPolicy, Supervisor

API_KEYS_ENV = "KDAMESH_API_KEYS"
FAMILY_FORMATS = {"kimi_k3": "kimi_k3", "kimi_linear": "kimi_k2"}
MODES = ("disaggregated", "colocated")
INSTANCE_HEADER = "X-Kdamesh-Instance"  # the gateway's /health echoes its --instance-id


@dataclass(frozen=True)
class LaunchConfig:
    model: str | None = None  # None: DEFAULT_PRESET (the shipped demo-k3); a shipped model's name or a folder
    mode: str = "disaggregated"
    host: str = "127.0.0.1"
    http_port: int = 8000  # the gateway's REST API
    grpc_port: int | None = None  # first port of the mesh's gRPC services (cache, prefill, decode); None: free ports
    cache_backend: str = "memory"  # or redis://host:port/db
    cache_byte_budget: str | None = None  # memory backend budget, e.g. 4GiB (None: the service default)
    pd_min_uncached_tokens: int = 256
    kv_load_failure_policy: str = "recompute"
    # Engine options of both workers (None: the engine's defaults).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    load_format: str | None = None  # safetensors | fastsafetensors | dummy
    seed: int | None = None
    device: str | None = None
    enable_prefix_caching: bool = True
    torch_threads: int | None = None
    snapshot_interval: str | None = None  # KDA state snapshots: tokens between them ("auto"), bytes, policy
    snapshot_budget: str | None = None
    snapshot_policy: str | None = None  # "hybrid" | "periodic"
    tensor_parallel_size: int | None = None  # rank processes per worker
    enable_expert_parallel: bool = False
    served_model_name: str | None = None
    # The gateway: its gRPC API port (None: grpc_port + 3, or a free port), tenancy, output parsers.
    gateway_grpc_port: int | None = None
    api_keys: str | None = None  # KDAMESH_API_KEYS for the gateway (None: the launcher's own environment's)
    api_keys_file: str | None = None
    tool_call_parser: str = "auto"  # "auto": the model family's format; "none": off; or a parser name
    reasoning_parser: str = "auto"
    enable_auto_tool_choice: bool = True
    disable_log_requests: bool = False  # the gateway writes no access-log line per request
    uvicorn_log_level: str | None = None  # the gateway's HTTP server log level (None: log_level)
    log_level: str = "INFO"
    log_format: str = "text"  # "text" | "json" (telemetry/logs.py), for every service
    trace_exporter: str = "auto"  # "auto" | "none" | "console" | "otlp" (telemetry/tracing.py), for every service
    # First of three consecutive /metrics ports (cache, prefill, decode); None: free ports.
    metrics_port: int | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0  # per service, after SIGTERM, before SIGKILL (at least grace_s + 10 s)
    # Shutdown grace of every service (`--grace-s`, seconds); None: each service's default (5 s).
    grace_s: float | None = None
    restart: bool = True  # restart a service that exits (with backoff); False: stop the mesh instead

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


# -- helpers ---------------------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


@dataclass
class Service:
    role: str
    address: str  # host:port (the gateway: its REST base URL)
    argv: list[str]
    proc: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # extra environment of this service only
    grpc_api: str | None = None  # the gateway's public gRPC API (host:port)
    metrics: str | None = None  # its Prometheus /metrics URL
    ports: tuple[int, ...] = ()  # every port it listens on (checked free before anything starts)
    instance_id: str | None = None  # the gateway: the nonce its /health echoes (X-Kdamesh-Instance)

    def start(self, log_level: str, log_format: str = "text", trace_exporter: str = "auto") -> None:
        cmd = [sys.executable, "-m", "deploy.cli", "--log-level", log_level, "--log-format", log_format,
               "--trace-exporter", trace_exporter, "serve", "--role", self.role, *self.argv]
        env = {k: v for k, v in os.environ.items() if self.role == "gateway" or k != API_KEYS_ENV}
        env.update(self.env or {})
        self.proc = subprocess.Popen(cmd, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                                     process_group=0, env=env)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float) -> None:
        if not self.alive:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
    """GET /health answers 200 — from our own gateway when `instance_id` is given (its X-Kdamesh-Instance header)."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as reply:
            ours = instance_id is None or reply.headers.get(INSTANCE_HEADER) == instance_id
            return reply.status == 200 and ours
    except (urllib.error.URLError, OSError, ValueError):
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
    """The context length the workers will enforce (the engine's cache plan of the flags both get)."""
    from engine.config import EngineArgs, plan_cache
    from engine.model.config import load_model_config
    from engine.model.loader import resolve_dtype

    d, memory = EngineArgs(model=model), config.kv_cache_memory
    args = EngineArgs(model=model, dtype=config.dtype or d.dtype, device=config.device or d.device,
                      kv_cache_memory=d.kv_cache_memory if memory is None else int(memory) if memory.isdigit()
                      else memory, max_num_seqs=config.max_num_seqs or d.max_num_seqs,
                      max_num_batched_tokens=config.max_num_batched_tokens or d.max_num_batched_tokens,
                      max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching)
    model_config = load_model_config(model)
    dtype = resolve_dtype(args.dtype, args.device, model_config)
    return plan_cache(args, model_config, dtype.itemsize).max_model_len


class _Stop(Exception):
    pass


# -- the mesh --------------------------------------------------------------------------------------------------------


def plan_services(config: LaunchConfig, model: str) -> list[Service]:
    """The processes to start, in start order, with their flags."""
    host = config.host
    grpc_ports = _ports(host, config.grpc_port)
    cache, prefill, decode = (f"{host}:{p}" for p in grpc_ports)
    metrics = {role: (port, f"http://{host}:{port}/metrics")
               for role, port in zip(("cache", "prefill", "decode"), _ports(host, config.metrics_port))}
    grace = [] if config.grace_s is None else ["--grace-s", str(config.grace_s)]
    engine = _engine_argv(config, model) + grace
    cache_argv = ["--address", cache, "--cache-backend", config.cache_backend,
                  "--metrics-port", str(metrics["cache"][0]), *grace]
    if config.cache_byte_budget:
        cache_argv += ["--byte-budget", config.cache_byte_budget]
    ports = {role: (grpc, metrics[role][0]) for role, grpc in zip(("cache", "prefill", "decode"), grpc_ports)}
    services = [Service("cache", cache, cache_argv, metrics=metrics["cache"][1], ports=ports["cache"])]
    if config.mode == "disaggregated":
        services.append(Service("prefill", prefill, ["--address", prefill, "--cache-address", cache,
                                                     "--metrics-port", str(metrics["prefill"][0]), *engine],
                                metrics=metrics["prefill"][1], ports=ports["prefill"]))
    services.append(Service("decode", decode, ["--address", decode, "--cache-address", cache,
                                               "--kv-load-failure-policy", config.kv_load_failure_policy,
                                               "--metrics-port", str(metrics["decode"][0]), *engine],
                            metrics=metrics["decode"][1], ports=ports["decode"]))
    services.append(_gateway(config, model, decode, prefill, grace))
    return services


def _ports(host: str, first: int | None) -> list[int]:
    """Three ports: `first` and the next two, or three free ones."""
    return [first, first + 1, first + 2] if first is not None else [free_port(host) for _ in range(3)]


def _engine_argv(config: LaunchConfig, model: str) -> list[str]:
    """The engine flags of both workers (only those set)."""
    argv = ["--model", model]
    for flag, value in (("--max-num-seqs", config.max_num_seqs),
                        ("--max-num-batched-tokens", config.max_num_batched_tokens),
                        ("--kv-cache-memory", config.kv_cache_memory), ("--max-model-len", config.max_model_len),
                        ("--dtype", config.dtype), ("--device", config.device),
                        ("--load-format", config.load_format), ("--seed", config.seed),
                        ("--torch-threads", config.torch_threads),
                        ("--snapshot-interval", config.snapshot_interval),
                        ("--snapshot-budget", config.snapshot_budget), ("--snapshot-policy", config.snapshot_policy),
                        ("--tensor-parallel-size", config.tensor_parallel_size),
                        ("--served-model-name", config.served_model_name)):
        if value is not None:
            argv += [flag, str(value)]
    if not config.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if config.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    return argv


def _gateway(config: LaunchConfig, model: str, decode: str, prefill: str, grace: list[str]) -> Service:
    host = config.host
    argv = ["--model", model, "--host", host, "--http-port", str(config.http_port), "--mode", config.mode,
            "--decode-addresses", decode, "--pd-min-uncached-tokens", str(config.pd_min_uncached_tokens), *grace]
    if config.mode == "disaggregated":
        argv += ["--prefill-addresses", prefill]
    if config.served_model_name:
        argv += ["--served-model-name", config.served_model_name]
    if config.gateway_grpc_port is not None:
        grpc_api_port = config.gateway_grpc_port
    else:
        grpc_api_port = config.grpc_port + 3 if config.grpc_port is not None else free_port(host)
    argv += ["--grpc-port", str(grpc_api_port)]
    tool_parser = _parser_flag(config.tool_call_parser, model)
    reasoning_parser = _parser_flag(config.reasoning_parser, model)
    if tool_parser:
        argv += ["--tool-call-parser", tool_parser]
        if config.enable_auto_tool_choice:
            argv.append("--enable-auto-tool-choice")
    if reasoning_parser:
        argv += ["--reasoning-parser", reasoning_parser]
    if config.api_keys_file:
        argv += ["--api-keys-file", config.api_keys_file]
    if config.disable_log_requests:
        argv.append("--disable-log-requests")
    if config.uvicorn_log_level:
        argv += ["--uvicorn-log-level", config.uvicorn_log_level]
    env = {API_KEYS_ENV: config.api_keys} if config.api_keys is not None else None
    return Service("gateway", f"http://{host}:{config.http_port}", argv, env=env,
                   grpc_api=f"{host}:{grpc_api_port}", metrics=f"http://{host}:{config.http_port}/metrics",
                   ports=(config.http_port, grpc_api_port))


def _parser_flag(value: str, model: str) -> str | None:
    """"auto" -> the model family's output format (None when unknown); "none" -> None; else the name itself."""
    if value == "none":
        return None
    if value != "auto":
        return value
    try:
        family = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    return FAMILY_FORMATS.get(family)


def up(config: LaunchConfig) -> int:
    model = resolve_model(config.model) if config.model else str(default_model_dir())
    services = _preflight(config, model)
    if services is None:
        return 2
    give_mesh_token(services, mesh_token_from_env() or new_mesh_token())  # one per launch, unless set
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
            s.stop(max(config.stop_timeout_s, (config.grace_s or 0.0) + 10.0))
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


def give_mesh_token(services: list[Service], token: str) -> None:
    """Every service gets `token` in its environment (KDAMESH_MESH_TOKEN)."""
    for s in services:
        s.env = {**(s.env or {}), MESH_TOKEN_ENV: token}


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
        max_model_len = engine_max_model_len(config, model)
    except ValueError as exc:  # EngineConfigError: the workers would refuse these options
        print(f"kdamesh up: {exc}", file=sys.stderr)
        return None
    return _with_gateway_identity(planned, secrets.token_hex(8), max_model_len)


def _with_gateway_identity(services: list[Service], instance_id: str, max_model_len: int) -> list[Service]:
    """Gives the gateway its readiness nonce (echoed by its /health) and the workers' context length."""
    gateway = services[-1]
    gateway.instance_id = instance_id
    gateway.argv += ["--instance-id", instance_id, "--max-model-len", str(max_model_len)]
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
    by_role = {s.role: s for s in services}
    lines = [f"kdamesh is up: {config.mode} mesh serving {config.served_model_name or Path(model).name} ({model})",
             f"  REST     {by_role['gateway'].address}/v1   (OpenAI-compatible: /v1/chat/completions, "
             f"/v1/completions, /v1/models; /tokenize, /metrics, /health)",
             f"  gRPC     {by_role['gateway'].grpc_api}   (kdamesh.v1.Generation, the sdk/ client)",
             f"  cache    {by_role['cache'].address}   (backend {config.cache_backend}; {by_role['cache'].metrics})"]
    if "prefill" in by_role:
        lines.append(f"  prefill  {by_role['prefill'].address}   ({by_role['prefill'].metrics})")
    lines.append(f"  decode   {by_role['decode'].address}   ({by_role['decode'].metrics})")
    lines.append("Ctrl-C or SIGTERM stops everything.")
    endpoints = {s.role: s.address for s in services}
    lines.append("metrics " + json.dumps({s.role: s.metrics for s in services}))
    lines.append("endpoints " + json.dumps(endpoints))
    lines.append(f"gateway_grpc {by_role['gateway'].grpc_api}")
    print("\n".join(lines), flush=True)
