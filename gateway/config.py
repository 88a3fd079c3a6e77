"""The gateway's configuration: one frozen dataclass, built by `kdamesh serve --role gateway` (deploy/serve.py).

Contract:
- Every field a user sets carries its flag (telemetry/options.py); `serve --role gateway` and `kdamesh up`
  generate their parsers from them. `mode_option`, `host_option` and `http_port_option` are the flags `kdamesh up`
  shares with the gateway (one declaration each).
- `GatewayConfig` validates on construction (`ValueError`): at least one decode worker; prefill workers in
  disaggregated mode; parser names registered (`gateway.parsers`) and naming one output format; positive limits.
- `model_name` is what clients put in `model` (`served_model_name`, else the folder's name); `served_names` also
  accepts the folder path.
- `make_mesh()` builds the `MeshClient` over the worker lists (colocated mode ignores prefill workers). A pool given
  as one `dns:///NAME:PORT` target (a headless Service) is resolved first by `gateway.discovery.Discovery`
  (`GatewayCore.start`), which builds the mesh from the resolved config and keeps the pool's addresses current.
- `tenant_limits()` is the default per-tenant limit (`--tenant-rpm`, `--tenant-tpm`, `--tenant-max-concurrency`),
  which an `--api-keys-file` entry may override for its tenant; it applies to the anonymous tenant of an open
  gateway too. A field left None takes the documented default (`DEFAULT_TENANT_LIMITS`: unlimited rpm, 20M tokens
  per minute, 256 requests in flight); 0 means unlimited.
- `request_caps()` are the per-request caps (gateway/caps.py): `--max-prompts-per-request`,
  `--max-sequences-per-request` (n × prompts), `--max-prompt-tokens`.
- `media_fetch()` is the image URL policy (gateway/media_fetch.py): `--allowed-media-domains`,
  `--allowed-local-media-path` (both unset: only data: URLs), `--media-fetch-timeout-s`.
- `responses_store_size` (`--responses-store-size`), `responses_store_mib` (`--responses-store-mib`): how many
  Responses API responses the gateway keeps in memory, in how many MiB (gateway/responses/store.py); 0 responses
  turns the store off.
- `prepare_settings()` bounds the preparation pool (gateway/prepare.py: `--prepare-workers`,
  `--prepare-queue-limit`, `--prepare-timeout-s`, `--prepare-small-bytes`, `--switch-interval-ms`, `--prepare-processes`); `stall_policy()` is when a silent worker ends a request
  (gateway/stall.py: `--stall-timeout-s`, `--stall-prefill-tokens-per-s`); `sse_keepalive_s` spaces the SSE
  `: keep-alive` comments (0: none).
- `public_docs` / `public_metrics`: with API keys configured, `/openapi.json`, `/docs`, `/redoc` (and `/metrics`)
  need a key too unless these open them. `relay_worker_metrics` (default on): `/metrics` carries the workers'
  series too (gateway/worker_metrics.py); off where Prometheus scrapes every worker, which would count them twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.caps import DEFAULT_MAX_PROMPTS, DEFAULT_MAX_SEQUENCES, RequestCaps
from gateway.discovery import DiscoverySettings, pool_target
from gateway.media_fetch import DEFAULT_TIMEOUT_S, DOMAINS_FLAG, LOCAL_FLAG, MediaFetchConfig
from gateway.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS
from gateway.prep_settings import PrepSettings
from gateway.ratelimit import TenantLimits
from gateway.routing import RouterConfig
from gateway.stall import StallPolicy
from telemetry.options import grace_option, option, served_model_name_option
from telemetry.units import parse_bytes

if TYPE_CHECKING:
    from gateway.mesh_client import MeshClient

MODES = ("disaggregated", "colocated")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# A tenant's limits when neither a flag nor its key entry says otherwise (None: unlimited).
DEFAULT_TENANT_LIMITS = TenantLimits(rpm=None, tpm=20_000_000, max_concurrency=256)


def mode_option() -> Any:
    """`--mode`, the gateway's and `kdamesh up`'s (deploy/mesh_plan.py)."""
    return option("--mode", default="disaggregated", choices=MODES,
                  help="disaggregated: prefill workers + the P/D decision; colocated: every request prefills on its "
                       "decode worker")


def host_option() -> Any:
    return option("--host", default="127.0.0.1", help="the REST API's host")


def http_port_option() -> Any:
    return option("--port", "--http-port", default=8000, parse=int, dest="http_port", help="the REST API's port")


def _addresses(text: str) -> tuple[str, ...]:
    """A pool flag's comma-separated host:port list."""
    return tuple(a.strip() for a in text.split(",") if a.strip())


def _grpc_port(text: str) -> int | None:
    """`--grpc-port`: a port, 0 (a free one) or -1 (off, None)."""
    port = int(text)
    return None if port < 0 else port


@dataclass(frozen=True)
class GatewayConfig:
    # The model folder (its tokenizer and chat format are used here) and the name clients use (None: folder name).
    model: str = option("--model", help="checkpoint folder (tokenizer and chat format are read from it)")
    decode_addresses: tuple[str, ...] = option(
        "--decode-addresses", "--decode-workers", parse=_addresses, show=",".join,
        help="comma-separated host:port list of decode workers, or one dns:///NAME:PORT (every address of a "
             "headless Service, re-resolved)")
    prefill_addresses: tuple[str, ...] = option(
        "--prefill-addresses", "--prefill-workers", default=(), parse=_addresses, show=",".join,
        help="comma-separated host:port list of prefill workers, or one dns:///NAME:PORT")
    served_model_name: str | None = served_model_name_option()
    # host:port of the cache service whose KV events the routing follows (gateway/routing.py); None: not followed.
    cache_address: str | None = option(
        "--cache-address", default=None,
        help="host:port of the cache service: the gateway follows its KV events, so a prefix it holds counts as "
             "reusable (a transfer) on workers that load remote prefixes (default: none)")
    # "disaggregated": prefill workers + P/D decider; "colocated": every request prefills on its decode worker.
    mode: str = mode_option()
    # Remote prefill only when at least this many prompt tokens are not in the decode worker's prefix cache.
    pd_min_uncached_tokens: int = option(
        "--pd-min-uncached-tokens", default=256, parse=int,
        help="prefill remotely only when at least this many prompt tokens are uncached on the decode worker (0: "
             "always, when prefill workers exist)")
    # Colocate when this many prefills are already in flight from this gateway (0: no limit).
    pd_max_prefill_inflight: int = option("--pd-max-prefill-inflight", default=0, parse=int,
                                          help="colocate when this many remote prefills are in flight (0: no limit)")
    host: str = host_option()
    http_port: int = http_port_option()
    # The public gRPC API (protos/gateway.proto); None: not served, 0: a free port.
    grpc_port: int | None = option("--grpc-port", default=50051, parse=_grpc_port,
                                   show=lambda port: str(-1 if port is None else port),
                                   help="the public gRPC API (kdamesh.v1.Generation); 0: a free port, -1: off")
    # Deadline of one request through the mesh (seconds).
    request_timeout_s: float = option("--request-timeout-s", default=600.0, parse=float)
    # On SIGTERM/SIGINT: how long running streams and calls get to finish (seconds); streams still running near
    # the end get a clean error event.
    shutdown_grace_s: float = grace_option()
    # TTL of handoff objects (milliseconds); 0: the cache service's default (30 s).
    handoff_ttl_ms: int = option("--handoff-ttl-ms", default=0, parse=int, help="0: the cache service's default (30 s)")
    # Tenancy: the KDAMESH_API_KEYS value ("key=tenant,..."), and/or a JSON file of key -> tenant (or limits).
    api_keys: str | None = None
    api_keys_file: str | None = option(
        "--api-keys-file", default=None,
        help="JSON object of API key -> tenant (or {tenant, rpm, tpm, max_concurrency}); also read: "
             "KDAMESH_API_KEYS='key1=tenantA,key2=tenantB'. No keys: the gateway is open")
    # Default per-tenant limits (None: DEFAULT_TENANT_LIMITS, 0: unlimited).
    tenant_rpm: int | None = option("--tenant-rpm", default=None, parse=int,
                                    help="requests/minute per tenant (0, default: no limit)")
    tenant_tpm: int | None = option("--tenant-tpm", default=None, parse=int,
                                    help="tokens/minute per tenant (default 20M; 0: none)")
    tenant_max_concurrency: int | None = option("--tenant-max-concurrency", default=None, parse=int,
                                                help="in flight per tenant (default 256)")
    # Per-request caps (gateway/caps.py; max_prompt_tokens None: the context length alone).
    max_prompts_per_request: int = option("--max-prompts-per-request", default=DEFAULT_MAX_PROMPTS, parse=int,
                                          help="prompts in one /v1/completions")
    max_sequences_per_request: int = option("--max-sequences-per-request", default=DEFAULT_MAX_SEQUENCES, parse=int,
                                            help="n x prompts: sequences one request may generate")
    max_prompt_tokens: int | None = option("--max-prompt-tokens", default=None, parse=int,
                                           help="tokens in one prompt, 413 beyond (default: the context length alone)")
    # Image URLs the gateway may read (gateway/media_fetch.py): http(s) hosts, a local directory, the fetch deadline.
    allowed_media_domains: tuple[str, ...] = option(
        DOMAINS_FLAG, default=(), kind="list", metavar="HOST",
        help="host names whose http(s) image URLs the gateway fetches (exact names, any port); unset: none (only "
             "data: URLs, and files under --allowed-local-media-path)")
    allowed_local_media_path: str | None = option(
        LOCAL_FLAG, default=None, metavar="DIR",
        help="a directory whose files image parts may name as file:///... URLs (symlinks and .. must resolve inside "
             "it); unset: none. Only for trusted clients")
    media_fetch_timeout_s: float = option("--media-fetch-timeout-s", default=DEFAULT_TIMEOUT_S, parse=float,
                                          help="deadline of fetching one image URL, redirects and body included "
                                               "(seconds)")
    # Request preparation off the event loop (gateway/prepare.py): threads, waiting requests, deadline (seconds).
    prepare_workers: int = option("--prepare-workers", default=2, parse=int,
                                  help="threads that prepare requests (JSON decoding, chat rendering, tokenisation, "
                                       "schemas, images) off the event loop")
    prepare_queue_limit: int = option("--prepare-queue-limit", default=512, parse=int,
                                      help="requests waiting for a preparation thread; beyond: 503 server_busy with "
                                           "Retry-After")
    prepare_timeout_s: float = option("--prepare-timeout-s", default=30.0, parse=float,
                                      help="deadline of one request's preparation, waiting included (seconds); "
                                           "beyond: 503 prepare_timeout")
    prepare_small_bytes: int = option("--prepare-small-bytes", default=64 << 10, parse=parse_bytes,
                                      help="requests of at most this many bytes (body and fetched images) are "
                                           "prepared on their own threads, never behind larger ones")
    prepare_processes: int = option("--prepare-processes", default=2, parse=int,
                                    help="processes that prepare the requests over --prepare-small-bytes (off the "
                                         "gateway process's GIL; a cancelled request's process is killed); 0: "
                                         "threads")
    switch_interval_ms: float = option("--switch-interval-ms", default=1.0, parse=float,
                                       help="the gateway process's thread switch interval (milliseconds; Python's "
                                            "default 5): how long the event loop may wait for a preparing thread")
    # A worker that stops answering (gateway/mesh_client.py): the longest silence between two messages of a
    # stream, and between a request and its first message beyond the prompt's expected prefill time (seconds).
    stall_timeout_s: float = option("--stall-timeout-s", default=10.0, parse=float,
                                    help="a worker silent this long within a request's stream ends the request "
                                         "(a stalled prefill falls back to the decode worker) (seconds)")
    stall_prefill_tokens_per_s: float = option(
        "--stall-prefill-tokens-per-s", default=2000.0, parse=float,
        help="the slowest prefill rate expected: a prompt of N tokens gets N / this many seconds more before its "
             "first message counts as a stall")
    # SSE streams: a `: keep-alive` comment after this many seconds without output (0: none).
    sse_keepalive_s: float = option("--sse-keepalive-s", default=5.0, parse=float,
                                    help="a streamed response sends a ': keep-alive' comment after this many seconds "
                                         "without output (0: never)")
    # With API keys configured: serve the API docs / the Prometheus metrics without a key.
    public_docs: bool = option("--public-docs", default=False, kind="switch",
                               help="serve /openapi.json, /docs, /redoc without a key")
    public_metrics: bool = option("--public-metrics", default=False, kind="switch",
                                  help="serve /metrics without a key")
    relay_worker_metrics: bool = option("--relay-worker-metrics", default=True, kind="toggle",
                                        help="/metrics also carries the workers' series, scraped over gRPC "
                                             "(--no-relay-worker-metrics where Prometheus scrapes every worker)")
    # Output parsers (vLLM flags): None leaves the model's text as content.
    tool_call_parser: str | None = option("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS))
    reasoning_parser: str | None = option("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS))
    enable_auto_tool_choice: bool = option(
        "--enable-auto-tool-choice", default=False, kind="switch",
        help='let the model decide to call tools (tool_choice "auto"; needs --tool-call-parser)')
    # An optional upper bound on the context length the workers report (gateway/core.py); None: theirs alone.
    max_model_len: int | None = option("--max-model-len", default=None, parse=int,
                                       help="an optional upper bound on the context length the workers report")
    # Echoed by GET /health as X-Kdamesh-Instance: the launcher's proof that it reached its own gateway.
    instance_id: str | None = option("--instance-id", default=None,
                                     help="echoed by GET /health as X-Kdamesh-Instance (the launcher's readiness "
                                          "check)")
    # Seconds between gRPC health checks of the workers.
    health_check_interval_s: float = option("--health-check-interval-s", default=5.0, parse=float,
                                            help="seconds between gRPC health checks of the workers")
    # One queued request on a worker costs as much as this many uncached prompt tokens (routing, gateway/routing.py).
    route_load_weight: float = 128.0
    # The shared mesh token sent on every worker call (KDAMESH_MESH_TOKEN); None: the workers are open.
    mesh_token: str | None = field(default=None, repr=False)
    # A `dns:///NAME:PORT` pool (gateway/discovery.py): re-resolved this often (seconds), and the first workers
    # awaited this long at start-up (seconds).
    discovery_refresh_s: float = option(
        "--discovery-refresh-s", default=10.0, parse=float,
        help="dns: worker pools: seconds between re-resolutions (also right after a health check fails)")
    discovery_startup_timeout_s: float = option(
        "--discovery-startup-timeout-s", default=300.0, parse=float,
        help="dns: worker pools: seconds to wait at start-up for the first address of each pool")
    # The Responses API's in-memory store (gateway/responses/store.py): responses kept for previous_response_id and
    # GET /v1/responses/{id}; 0: off (store: true is refused).
    responses_store_size: int = option("--responses-store-size", default=1024, parse=int,
                                       help="Responses API responses kept in memory for previous_response_id and "
                                            "GET /v1/responses/{id} (least recently used dropped); 0: no store")
    responses_store_mib: int = option("--responses-store-mib", default=256, parse=int,
                                      help="memory the Responses API store may hold, MiB (its entries' JSON text)")
    # The HTTP server (deploy/serve.py runs it): no access-log line per request; its log level (None: --log-level).
    disable_log_requests: bool = option("--disable-log-requests", default=False, kind="switch",
                                        help="no access-log line per request")
    uvicorn_log_level: str | None = option("--uvicorn-log-level", default=None, choices=UVICORN_LOG_LEVELS,
                                           help="the HTTP server's log level (default: --log-level)")

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.decode_addresses:
            raise ValueError("the gateway needs at least one decode worker address")
        if self.mode == "disaggregated" and not self.prefill_addresses:
            raise ValueError("disaggregated mode needs at least one prefill worker address")
        if self.pd_min_uncached_tokens < 0 or self.pd_max_prefill_inflight < 0:
            raise ValueError("pd_min_uncached_tokens and pd_max_prefill_inflight must be >= 0")
        for flag, name, registry in (("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSERS),
                                     ("--reasoning-parser", self.reasoning_parser, REASONING_PARSERS)):
            if name is not None and name not in registry:
                raise ValueError(f"{flag} {name!r} is not registered; choose one of {sorted(registry)}")
        if (self.tool_call_parser and self.reasoning_parser
                and TOOL_CALL_PARSERS[self.tool_call_parser] is not REASONING_PARSERS[self.reasoning_parser]):
            raise ValueError("--tool-call-parser and --reasoning-parser name different output formats")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.responses_store_size < 0 or self.responses_store_mib < 0:
            raise ValueError("--responses-store-size and --responses-store-mib must be >= 0")
        if self.health_check_interval_s <= 0:
            raise ValueError("health_check_interval_s must be positive")
        pool_target(self.decode_addresses, "--decode-workers")  # a dns: target alone in its pool (ValueError)
        pool_target(self.prefill_addresses, "--prefill-workers")
        DiscoverySettings(refresh_s=self.discovery_refresh_s, min_refresh_s=min(1.0, self.discovery_refresh_s),
                          startup_timeout_s=self.discovery_startup_timeout_s)  # positive (ValueError)
        self.tenant_limits()  # validates the limits
        self.request_caps()  # and the caps
        self.media_fetch()  # and the image URL policy
        self.prepare_settings()  # and the preparation pool
        self.stall_policy()  # and the stall deadline
        if self.sse_keepalive_s < 0:
            raise ValueError(f"--sse-keepalive-s must be >= 0, got {self.sse_keepalive_s}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    @property
    def served_names(self) -> set[str]:
        return {self.model_name, self.model}

    def tenant_limits(self) -> TenantLimits:
        def limit(value: int | None, default: int | None) -> int | None:
            return default if value is None else None if value == 0 else value

        d = DEFAULT_TENANT_LIMITS
        return TenantLimits(rpm=limit(self.tenant_rpm, d.rpm), tpm=limit(self.tenant_tpm, d.tpm),
                            max_concurrency=limit(self.tenant_max_concurrency, d.max_concurrency))

    def request_caps(self) -> RequestCaps:
        return RequestCaps(self.max_prompts_per_request, self.max_sequences_per_request, self.max_prompt_tokens)

    def media_fetch(self) -> MediaFetchConfig:
        return MediaFetchConfig(self.allowed_media_domains, self.allowed_local_media_path, self.media_fetch_timeout_s)

    def prepare_settings(self) -> PrepSettings:
        return PrepSettings(self.prepare_workers, self.prepare_queue_limit, self.prepare_timeout_s,
                            self.prepare_small_bytes, self.switch_interval_ms, self.prepare_processes)

    def stall_policy(self) -> StallPolicy:
        return StallPolicy(self.stall_timeout_s, self.stall_prefill_tokens_per_s)

    def make_mesh(self) -> MeshClient:
        from gateway.mesh_client import MeshClient, PDDecider  # grpc: the command lines read this module first

        prefill = self.prefill_addresses if self.mode == "disaggregated" else ()
        return MeshClient(self.decode_addresses, prefill,
                          PDDecider(self.pd_min_uncached_tokens, self.pd_max_prefill_inflight), self.handoff_ttl_ms,
                          router_config=RouterConfig(load_weight=self.route_load_weight), model=self.model_name,
                          mesh_token=self.mesh_token, cache_address=self.cache_address, stall=self.stall_policy())
