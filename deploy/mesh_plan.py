"""What `kdamesh up` starts: the launch options (`LaunchConfig`), one child process (`Service`), and the plan of
the mesh (`plan_services`): every service's options, flags, ports and metrics port.

Contract:
- `LaunchConfig` is the launcher's own options (mode, ports, replicas, restarts, output parsers "auto") and holds
  the option objects of every service: `engine` (`EngineArgs`, both workers), `prefill`, `decode`, `cache` and
  `gateway` (their service configs), `vllm` (deploy/flags.py). Every field a flag sets carries it
  (telemetry/options.py), so `kdamesh up` / `serve MODEL` parse straight into it; the fields the plan assigns
  (`WORKER_WIRING`, `CACHE_WIRING`, `GATEWAY_WIRING`: addresses, ports, the model path, the context length) are
  not flags there and hold placeholders until then.
- `config.options(role, wiring)` is the option object the service of `role` runs with (the user's options plus the
  plan's `Wiring`); `config.to_argv(role, wiring)` its command line: the flags that rebuild exactly that object
  through the role's parser (deploy/serve.py). One default per flag: a value equal to the default is not written.
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

import argparse

import dataclasses
import json
import os
import random
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cache_service.config import CacheServiceConfig
from decode_service.config import DecodeServiceConfig
from deploy.flags import PARSER_CHOICES, VllmCompat
from engine.config import EngineArgs
from gateway.config import MODES, GatewayConfig, host_option, http_port_option, mode_option
from prefill_service.config import PrefillServiceConfig
from telemetry import options
from telemetry.options import add_options, from_namespace, grace_option, option, section

API_KEYS_ENV = "KDAMESH_API_KEYS"
FAMILY_FORMATS = {"kimi_k3": "kimi_k3", "kimi_linear": "kimi_k2"}
PLANNED = "planned.invalid:0"  # a wiring field's value until the plan assigns it
WORKER_WIRING = ("engine", "cache_address", "address", "metrics_port", "shutdown_grace_s")
CACHE_WIRING = ("address", "metrics_port", "shutdown_grace_s")
GATEWAY_WIRING = ("model", "decode_addresses", "prefill_addresses", "cache_address", "mode", "host", "http_port",
                  "grpc_port", "shutdown_grace_s", "max_model_len", "instance_id", "tool_call_parser",
                  "reasoning_parser", "enable_auto_tool_choice")


def _worker_template(cls):
    return cls(engine=EngineArgs(model=""), cache_address=PLANNED)


def _gateway_template() -> GatewayConfig:
    return GatewayConfig(model="", decode_addresses=(PLANNED,), prefill_addresses=(PLANNED,))


def _default_tenant_key(key: str) -> str:
    """`--api-key KEY`: the KDAMESH_API_KEYS value of one key for the tenant 'default'."""
    return f"{key}=default"


@dataclass(frozen=True)
class Wiring:
    """What the plan assigns one service: its address and metrics port, and where the others are."""

    model: str
    address: str
    cache_address: str
    metrics_port: int | None = None
    decode_addresses: tuple[str, ...] = ()
    prefill_addresses: tuple[str, ...] = ()
    grpc_port: int | None = None  # the gateway's public gRPC API


@dataclass(frozen=True)
class LaunchConfig:
    model: str | None = option(  # None: DEFAULT_PRESET (the shipped demo-k3); a shipped model's name or a folder
        "--model", default=None,
        help="checkpoint folder or demo-k3 (default: demo-k3, the trained demo shipped in deploy/models)")
    mode: str = mode_option()
    host: str = host_option()
    http_port: int = http_port_option()  # the gateway's REST API
    grpc_port: int | None = option(  # first port of the mesh's gRPC services (cache, prefill, decode); None: free
        "--grpc-port", default=None, parse=int,
        help="first of consecutive ports for the cache, prefill and decode services, in that order (default: free)")
    prefill_replicas: int = option(  # prefill workers (disaggregated mode), each with its own ports
        "--prefill-replicas", default=1, parse=int,
        help="prefill workers (disaggregated mode), each on its own ports; the gateway routes over them")
    decode_replicas: int = option("--decode-replicas", default=1, parse=int,
                                  help="decode workers, each on its own ports; the gateway routes over them")
    # The gateway's public gRPC API port (None: the port after the last worker's, or a free port).
    gateway_grpc_port: int | None = option(
        "--gateway-grpc-port", default=None, parse=int,
        help="the gateway's public gRPC API (default: the port after the last worker's with --grpc-port, else free)")
    # KDAMESH_API_KEYS for the gateway (None: the launcher's own environment's).
    api_keys: str | None = option("--api-key", default=None, parse=_default_tenant_key, metavar="KEY",
                                  help="one API key every client must send (tenant 'default')")
    # Output parsers: "auto": the model family's format; "none": off; or a parser name (the gateway's).
    tool_call_parser: str = option("--tool-call-parser", default="auto", help=PARSER_CHOICES)
    reasoning_parser: str = option("--reasoning-parser", default="auto", help=PARSER_CHOICES)
    enable_auto_tool_choice: bool = option("--enable-auto-tool-choice", default=True, kind="toggle",
                                           help='tool_choice "auto" (needs a tool-call parser)')
    # First of the consecutive /metrics ports (cache, prefill…, decode…); None: free ports.
    metrics_port: int | None = option(
        "--metrics-port", default=None, parse=int,
        help="first of consecutive Prometheus /metrics ports for the cache, prefill and decode services (default: "
             "free); the gateway's /metrics is on its REST port")
    grace_s: float = grace_option()  # every service's shutdown grace (seconds)
    restart: bool = option("--no-restart", default=True, kind="off",  # False: a service that exits stops the mesh
                           help="a service that exits stops the whole mesh (default: restart it with backoff)")
    log_level: str = "INFO"
    log_format: str = "text"  # "text" | "json" (telemetry/logs.py), for every service
    trace_exporter: str = "auto"  # "auto" | "none" | "console" | "otlp" (telemetry/tracing.py), for every service
    startup_timeout_s: float = 600.0
    stop_timeout_s: float = 15.0  # per service, after SIGTERM, before SIGKILL (at least grace_s + 10 s)
    # The option objects of the services (their wiring fields are the plan's).
    engine: EngineArgs = section(EngineArgs, "engine (both workers)", default=EngineArgs(model=""), skip=("model",))
    prefill: PrefillServiceConfig = section(PrefillServiceConfig, "prefill workers",
                                            default=_worker_template(PrefillServiceConfig), skip=WORKER_WIRING)
    decode: DecodeServiceConfig = section(DecodeServiceConfig, "decode workers",
                                          default=_worker_template(DecodeServiceConfig), skip=WORKER_WIRING)
    cache: CacheServiceConfig = section(CacheServiceConfig, "cache service", default=CacheServiceConfig(),
                                        skip=CACHE_WIRING, aliases={"byte_budget": ("--cache-byte-budget",)})
    gateway: GatewayConfig = section(GatewayConfig, "gateway", default=_gateway_template(), skip=GATEWAY_WIRING)
    vllm: VllmCompat = section(VllmCompat, "vllm serve: flags accepted at their no-op value only (refused by name)",
                               default=VllmCompat())

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.prefill_replicas < 1 or self.decode_replicas < 1:
            raise ValueError(f"--prefill-replicas and --decode-replicas must be >= 1, got {self.prefill_replicas}, "
                             f"{self.decode_replicas}")
        if self.mode == "colocated" and self.prefill_replicas != 1:
            raise ValueError("--prefill-replicas needs --mode disaggregated (colocated mode runs no prefill worker)")

    def options(self, role: str, wiring: Wiring):
        """The option object the service of `role` runs with: the user's options and the plan's wiring."""
        if role == "cache":
            return dataclasses.replace(self.cache, address=wiring.address, metrics_port=wiring.metrics_port,
                                       shutdown_grace_s=self.grace_s)
        if role in ("prefill", "decode"):
            return dataclasses.replace(getattr(self, role), engine=dataclasses.replace(self.engine, model=wiring.model),
                                       cache_address=wiring.cache_address, address=wiring.address,
                                       metrics_port=wiring.metrics_port, shutdown_grace_s=self.grace_s)
        if role == "gateway":
            return self._gateway_options(wiring)
        raise ValueError(f"unknown role {role!r}")

    def to_argv(self, role: str, wiring: Wiring) -> list[str]:
        """The command line of `role`'s service: the flags that rebuild `self.options(role, wiring)`."""
        return options.to_argv(self.options(role, wiring))

    def _gateway_options(self, wiring: Wiring) -> GatewayConfig:
        tool_parser = _parser_flag(self.tool_call_parser, wiring.model)
        local = self.gateway.allowed_local_media_path
        return dataclasses.replace(
            self.gateway, model=wiring.model, decode_addresses=wiring.decode_addresses,
            prefill_addresses=wiring.prefill_addresses if self.mode == "disaggregated" else (),
            cache_address=wiring.cache_address, mode=self.mode, host=self.host, http_port=self.http_port,
            grpc_port=wiring.grpc_port, shutdown_grace_s=self.grace_s, tool_call_parser=tool_parser,
            reasoning_parser=_parser_flag(self.reasoning_parser, wiring.model),
            enable_auto_tool_choice=bool(tool_parser) and self.enable_auto_tool_choice,
            allowed_local_media_path=str(Path(local).resolve()) if local else None)


LISTEN_PORTS = range(20000, 27000)  # below Linux's ephemeral range (32768-60999), clear of the CI Redis Cluster's 27100-27102
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a service started later: picked below the kernel's ephemeral range, so
    the outgoing connections and `bind(0)` calls the mesh's own processes make meanwhile cannot take it (a port
    from `bind(0)` was seen taken by another service's socket before its own service bound it); never the same
    port twice in one process."""
    for _ in range(200):
        port = random.choice(LISTEN_PORTS)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a crowded range: the kernel's pick
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
    options: object | None = None  # the option object `argv` rebuilds (LaunchConfig.options)

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
    """The processes to start, in start order, with their options and flags (see the module docstring)."""
    host = config.host
    roles = ["cache", *(["prefill"] * (config.prefill_replicas if config.mode == "disaggregated" else 0)),
             *(["decode"] * config.decode_replicas)]
    grpc_ports = _ports(host, config.grpc_port, len(roles))
    metrics_ports = _ports(host, config.metrics_port, len(roles))
    cache = f"{host}:{grpc_ports[0]}"
    services = []
    for i, (role, port, metrics_port) in enumerate(zip(roles, grpc_ports, metrics_ports)):
        address = f"{host}:{port}"
        same = roles.count(role)
        name = role if same == 1 else f"{role}-{i - roles.index(role)}"
        services.append(_service(config, role, Wiring(model, address, cache, metrics_port), name=name,
                                 metrics=f"http://{host}:{metrics_port}/metrics", ports=(port, metrics_port)))
    if config.gateway_grpc_port is not None:
        grpc_api_port = config.gateway_grpc_port
    else:
        grpc_api_port = grpc_ports[-1] + 1 if config.grpc_port is not None else free_port(host)
    wiring = Wiring(model, f"http://{host}:{config.http_port}", cache,
                    decode_addresses=tuple(s.address for s in services if s.role == "decode"),
                    prefill_addresses=tuple(s.address for s in services if s.role == "prefill"),
                    grpc_port=grpc_api_port)
    env = {API_KEYS_ENV: config.api_keys} if config.api_keys is not None else None
    services.append(_service(config, "gateway", wiring, env=env, grpc_api=f"{host}:{grpc_api_port}",
                             metrics=f"http://{host}:{config.http_port}/metrics",
                             ports=(config.http_port, grpc_api_port)))
    return services


def _service(config: LaunchConfig, role: str, wiring: Wiring, **kwargs) -> Service:
    opts = config.options(role, wiring)
    return Service(role, wiring.address, options.to_argv(opts), options=opts, **kwargs)


def _ports(host: str, first: int | None, count: int) -> list[int]:
    """`count` ports: `first` and the ones after it, or free ones."""
    return [first + i for i in range(count)] if first is not None else [free_port(host) for _ in range(count)]


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


def add_mesh_flags(p: argparse.ArgumentParser, model_positional: bool) -> None:
    if model_positional:
        p.add_argument("model", help="checkpoint folder (config.json, *.safetensors, tokenizer) or demo-k3")
    add_options(p, LaunchConfig, skip=("model",) if model_positional else ())


def launch_config_from(ns: argparse.Namespace, log_level: str, log_format: str, trace_exporter: str):
    """The launcher's config from `add_mesh_flags` flags and the global logging flags."""

    return from_namespace(LaunchConfig, ns, base=LaunchConfig(), model=ns.model, log_level=log_level.upper(),
                          log_format=log_format, trace_exporter=trace_exporter)
