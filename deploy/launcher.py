"""`kdamesh up`: the whole mesh on localhost — cache, prefill, decode and gateway as separate processes.

Contract:
- `up(config)` starts the cache service, then the prefill (disaggregated mode only) and decode workers, then the
  gateway, each as its own process (`python -m deploy.cli serve --role …`) on the given ports or free ones; waits
  until each reports ready (gRPC health SERVING; the gateway's `GET /health` 200); prints the endpoints; and serves
  until SIGINT (Ctrl-C) or SIGTERM, or until a child exits, then stops everything — gateway first, cache last — with
  SIGTERM, and SIGKILL after `stop_timeout_s`. Returns 0 after a requested stop, 1 when a service failed.
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

DEFAULT_PRESET = "small-k3"
API_KEYS_ENV = "KDAMESH_API_KEYS"
FAMILY_FORMATS = {"kimi_k3": "kimi_k3", "kimi_linear": "kimi_k2"}
MODES = ("disaggregated", "colocated")


@dataclass(frozen=True)
class LaunchConfig:
    model: str | None = None  # None: the generated DEFAULT_PRESET checkpoint (created on first run)
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
    device: str | None = None
    enable_prefix_caching: bool = True
    torch_threads: int | None = None
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
    log_level: str = "INFO"
    log_format: str = "text"  # "text" | "json" (telemetry/logs.py), for every service
    trace_exporter: str = "auto"  # "auto" | "none" | "console" | "otlp" (telemetry/tracing.py), for every service
    # First of three consecutive /metrics ports (cache, prefill, decode); None: free ports.
    metrics_port: int | None = None
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0  # per service, after SIGTERM, before SIGKILL (at least grace_s + 10 s)
    # Shutdown grace of every service (`--grace-s`, seconds); None: each service's default (5 s).
    grace_s: float | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


# -- helpers ---------------------------------------------------------------------------------------------------------


def kdamesh_home() -> Path:
    return Path(os.environ.get("KDAMESH_HOME") or Path.home() / ".cache" / "kdamesh")


def default_model_dir(preset: str = DEFAULT_PRESET) -> Path:
    """The generated checkpoint of `preset` under $KDAMESH_HOME, created on first use."""
    folder = kdamesh_home() / "checkpoints" / preset
    if not (folder / "config.json").is_file():
        from engine.model.checkpoint import make_checkpoint

        print(f"kdamesh: generating the {preset} checkpoint in {folder} (first run only)…", flush=True)
        tmp = folder.with_name(folder.name + ".tmp")
        make_checkpoint(preset, tmp)
        tmp.rename(folder)  # a half-written checkpoint is never mistaken for a whole one
    return folder


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


def _http_ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class _Stop(Exception):
    pass


# -- the mesh --------------------------------------------------------------------------------------------------------


def plan_services(config: LaunchConfig, model: str) -> list[Service]:
    """The processes to start, in start order, with their flags."""
    host = config.host
    cache, prefill, decode = (f"{host}:{p}" for p in _ports(host, config.grpc_port))
    metrics = {role: (port, f"http://{host}:{port}/metrics")
               for role, port in zip(("cache", "prefill", "decode"), _ports(host, config.metrics_port))}
    grace = [] if config.grace_s is None else ["--grace-s", str(config.grace_s)]
    engine = _engine_argv(config, model) + grace
    cache_argv = ["--address", cache, "--cache-backend", config.cache_backend,
                  "--metrics-port", str(metrics["cache"][0]), *grace]
    if config.cache_byte_budget:
        cache_argv += ["--byte-budget", config.cache_byte_budget]
    services = [Service("cache", cache, cache_argv, metrics=metrics["cache"][1])]
    if config.mode == "disaggregated":
        services.append(Service("prefill", prefill, ["--address", prefill, "--cache-address", cache,
                                                     "--metrics-port", str(metrics["prefill"][0]), *engine],
                                metrics=metrics["prefill"][1]))
    services.append(Service("decode", decode, ["--address", decode, "--cache-address", cache,
                                               "--kv-load-failure-policy", config.kv_load_failure_policy,
                                               "--metrics-port", str(metrics["decode"][0]), *engine],
                            metrics=metrics["decode"][1]))
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
                        ("--torch-threads", config.torch_threads),
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
    env = {API_KEYS_ENV: config.api_keys} if config.api_keys is not None else None
    return Service("gateway", f"http://{host}:{config.http_port}", argv, env=env,
                   grpc_api=f"{host}:{grpc_api_port}", metrics=f"http://{host}:{config.http_port}/metrics")


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
    model = config.model or str(default_model_dir())
    if not (Path(model) / "config.json").is_file():
        print(f"kdamesh up: {model} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    services = plan_services(config, model)
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
        while all(s.alive for s in services):
            time.sleep(0.5)
        dead = [s for s in services if not s.alive]
        print(f"kdamesh up: the {dead[0].role} service exited (code {dead[0].proc.returncode}); stopping the mesh",
              file=sys.stderr, flush=True)
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


def wait_ready(services: list[Service], timeout_s: float) -> None:
    """Polls until every service is ready; RuntimeError when one exits or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending:
        for s in list(pending):
            if not s.alive:
                raise RuntimeError(f"the {s.role} service exited during start-up (code {s.proc.returncode})")
            ready = _http_ready(s.address) if s.role == "gateway" else _grpc_ready(s.address)
            if ready:
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
