"""What `kdamesh up` starts: the launch options (`LaunchConfig`), one child process (`Service`), and the plan of
the mesh (`plan_services`): every service's flags, ports and metrics port.

Contract:
- `plan_services(config, model)` -> the services in start order: cache, the prefill replicas (disaggregated mode;
  `prefill_replicas`), the decode replicas (`decode_replicas`), the gateway. With `grpc_port` P the gRPC ports are
  consecutive: cache P, prefill P+1 … P+N, decode P+N+1 … P+N+M, and the gateway's public gRPC API P+N+M+1 (with
  one replica each: P+1, P+2, P+3 as before); without it, free ports. `/metrics` ports follow the same order from
  `metrics_port` (cache, prefill…, decode…). A replica's `name` is its role, or `role-i` when its role has several.
- The gateway is given every worker address (`--decode-addresses a,b`, `--prefill-addresses c,d`) and routes over
  them from their KV event streams (gateway/routing.py).
- `Service.start` runs `python -m deploy.cli serve --role ROLE …` with the launcher's environment (API keys for the
  gateway only) plus the service's own `env`; every child dies with the launcher (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

API_KEYS_ENV = "KDAMESH_API_KEYS"
FAMILY_FORMATS = {"kimi_k3": "kimi_k3", "kimi_linear": "kimi_k2"}
MODES = ("disaggregated", "colocated")

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
    load_remote_prefix: bool = True  # False: both roles get --no-load-remote-prefix
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
    speculative_config: str | None = None  # --speculative-config JSON for both workers (engine/spec/config.py)
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
    allowed_media_domains: tuple[str, ...] = ()  # image URLs the gateway may read (gateway/media_fetch.py)
    allowed_local_media_path: str | None = None
    media_fetch_timeout_s: float | None = None  # None: the gateway's default (5 s)
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
    prefill_replicas: int = 1  # prefill workers (disaggregated mode), each with its own ports
    decode_replicas: int = 1  # decode workers

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError(f"--prefill-replicas and --decode-replicas must be >= 1, got {self.prefill_replicas}, "
                             f"{self.decode_replicas}")
        if self.mode == "colocated" and self.prefill_replicas != 1:
            raise ValueError("--prefill-replicas needs --mode disaggregated (colocated mode runs no prefill worker)")


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
    name: str = ""  # unique in the mesh: the role, or "role-i" for one of several replicas ("": the role)

    def __post_init__(self):
        self.name = self.name or self.role

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



# -- the mesh ----------------------------------------------------------------------------------------------------


def plan_services(config: LaunchConfig, model: str) -> list[Service]:
    """The processes to start, in start order, with their flags (see the module docstring)."""
    host = config.host
    roles = ["cache", *(["prefill"] * (config.prefill_replicas if config.mode == "disaggregated" else 0)),
             *(["decode"] * config.decode_replicas)]
    grpc_ports = _ports(host, config.grpc_port, len(roles))
    metrics_ports = _ports(host, config.metrics_port, len(roles))
    grace = [] if config.grace_s is None else ["--grace-s", str(config.grace_s)]
    engine = _engine_argv(config, model) + grace
    cache = f"{host}:{grpc_ports[0]}"
    services = []
    for i, (role, port, metrics_port) in enumerate(zip(roles, grpc_ports, metrics_ports)):
        address = f"{host}:{port}"
        if role == "cache":
            argv = ["--address", address, "--cache-backend", config.cache_backend, "--metrics-port",
                    str(metrics_port), *grace]
            argv += ["--byte-budget", config.cache_byte_budget] if config.cache_byte_budget else []
        else:
            argv = ["--address", address, "--cache-address", cache, "--metrics-port", str(metrics_port), *engine]
            if role == "decode":
                argv[4:4] = ["--kv-load-failure-policy", config.kv_load_failure_policy]
            argv += [] if config.load_remote_prefix else ["--no-load-remote-prefix"]
        same = roles.count(role)
        name = role if same == 1 else f"{role}-{i - roles.index(role)}"
        services.append(Service(role, address, argv, metrics=f"http://{host}:{metrics_port}/metrics",
                                ports=(port, metrics_port), name=name))
    gateway_grpc = grpc_ports[-1] + 1 if config.grpc_port is not None else None
    services.append(_gateway(config, model, [s.address for s in services if s.role == "decode"],
                             [s.address for s in services if s.role == "prefill"], grace, gateway_grpc, cache))
    return services


def _ports(host: str, first: int | None, count: int) -> list[int]:
    """`count` ports: `first` and the ones after it, or free ones."""
    return [first + i for i in range(count)] if first is not None else [free_port(host) for _ in range(count)]


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
                        ("--speculative-config", config.speculative_config),
                        ("--served-model-name", config.served_model_name)):
        if value is not None:
            argv += [flag, str(value)]
    if not config.enable_prefix_caching:
        argv.append("--no-enable-prefix-caching")
    if config.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    return argv


def _media_flags(config: LaunchConfig) -> list[str]:
    argv = ["--allowed-media-domains", *config.allowed_media_domains] if config.allowed_media_domains else []
    if config.allowed_local_media_path:
        argv += ["--allowed-local-media-path", str(Path(config.allowed_local_media_path).resolve())]
    if config.media_fetch_timeout_s is not None:
        argv += ["--media-fetch-timeout-s", str(config.media_fetch_timeout_s)]
    return argv


def _gateway(config: LaunchConfig, model: str, decode: list[str], prefill: list[str], grace: list[str],
             default_grpc_port: int | None, cache: str) -> Service:
    host = config.host
    argv = ["--model", model, "--host", host, "--http-port", str(config.http_port), "--mode", config.mode,
            "--decode-addresses", ",".join(decode), "--pd-min-uncached-tokens", str(config.pd_min_uncached_tokens),
            "--cache-address", cache, *grace]
    if config.mode == "disaggregated":
        argv += ["--prefill-addresses", ",".join(prefill)]
    if config.served_model_name:
        argv += ["--served-model-name", config.served_model_name]
    if config.gateway_grpc_port is not None:
        grpc_api_port = config.gateway_grpc_port
    else:
        grpc_api_port = default_grpc_port if default_grpc_port is not None else free_port(host)
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
    argv += _media_flags(config)
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
