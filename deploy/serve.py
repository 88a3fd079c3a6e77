"""`kdamesh serve --role cache|prefill|decode|gateway [flags]`: runs one service until SIGINT/SIGTERM.

Contract:
- Each role parses its own flags (`role_parser(role)`); engine flags follow `vllm serve` (`--model`,
  `--max-num-seqs`, `--kv-cache-memory`, `--enable-prefix-caching`, ...). The cache role is the cache service's own
  command line (`cache_service.cli.build_parser`).
- The worker roles share `deploy.flags.add_vllm_flags` (parallelism and the `vllm serve` flags not built yet) and
  refuse, naming it, such a flag set to anything but its no-op value. The gateway role also accepts the workers'
  `--enable-prefix-caching` and `--trust-remote-code` (no effect there), `--disable-log-requests`,
  `--uvicorn-log-level` and `--instance-id` (echoed by its /health: the launcher's readiness check), and the image
  URL flags (`deploy.flags.add_media_flags`); a flag value its config refuses is argparse's error naming it.
- `run_role(role, argv)` prints one line `kdamesh <role> service listening on HOST:PORT` once the service is ready
  (for prefill and decode: once the model is loaded; a model that fails to load exits 1), then serves until SIGINT
  or SIGTERM, when it stops gracefully (`--grace-s` seconds for calls in flight) and returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from deploy.flags import add_media_flags, add_vllm_flags, refusal
from engine.config import EngineArgs
from telemetry.mesh_auth import mesh_token_from_env

log = logging.getLogger(__name__)

ROLES = ("cache", "prefill", "decode", "gateway")


# -- flags ---------------------------------------------------------------------------------------------------------


def add_engine_flags(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    d = EngineArgs(model="")
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required, help="checkpoint folder (config.json, *.safetensors, tokenizer)")
    g.add_argument("--served-model-name", default=None, help="name clients use (default: the folder's name)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--load-format", default=d.load_format, choices=["safetensors", "fastsafetensors", "dummy"])
    g.add_argument("--device", default=d.device)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument("--kv-cache-memory", default=str(d.kv_cache_memory),
                   help="bytes for the KV block and KDA state pools together, e.g. 1GiB")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-forward-tokens", type=int, default=d.max_forward_tokens,
                   help="tokens per model forward within a step (default: 2048 on CPU, unlimited on GPU)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--snapshot-interval", default="auto", help="tokens between KDA state snapshots, or 'auto'")
    g.add_argument("--snapshot-budget", default=None, help="bytes for KDA state snapshots, e.g. 2GiB (default: auto)")
    g.add_argument("--snapshot-policy", default=d.snapshot_policy, choices=["hybrid", "periodic"], help="KDA snapshots")
    add_vllm_flags(g)  # --tensor-parallel-size, --trust-remote-code, ...: the one table (deploy/flags.py)
    g.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's)")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    memory = ns.kv_cache_memory
    interval = ns.snapshot_interval if ns.snapshot_interval == "auto" else int(ns.snapshot_interval)
    return EngineArgs(model=ns.model, tokenizer=ns.tokenizer, dtype=ns.dtype, load_format=ns.load_format,
                      device=ns.device, seed=ns.seed, block_size=ns.block_size,
                      kv_cache_memory=int(memory) if memory.isdigit() else memory, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens, max_forward_tokens=ns.max_forward_tokens,
                      max_model_len=ns.max_model_len,
                      enable_prefix_caching=ns.enable_prefix_caching, snapshot_interval=interval,
                      tensor_parallel_size=ns.tensor_parallel_size, enable_expert_parallel=ns.enable_expert_parallel,
                      snapshot_budget=ns.snapshot_budget, snapshot_policy=ns.snapshot_policy,
                      speculative_config=ns.speculative_config)


def _common(p: argparse.ArgumentParser, default_address: str) -> None:
    p.add_argument("--address", default=default_address, help="host:port to listen on (port 0: a free port)")
    p.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace period for calls in flight (seconds)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this HTTP port (on the --address host; 0: a free port)")


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def role_parser(role: str) -> argparse.ArgumentParser:
    if role == "cache":
        from cache_service.cli import build_parser

        return build_parser()
    p = argparse.ArgumentParser(prog=f"kdamesh serve --role {role}")
    if role == "prefill":
        _common(p, "127.0.0.1:50052")
        add_engine_flags(p)
        p.add_argument("--cache-address", required=True, help="host:port of the cache service")
        p.add_argument("--handoff-full-kv", action="store_true",
                       help="put every KV block in the handoff (default: the tail block; full blocks are shared)")
        p.add_argument("--load-remote-prefix", action=argparse.BooleanOptionalAction, default=True,
                       help="load cached prefixes from the cache service")
    elif role == "decode":
        _common(p, "127.0.0.1:50054")
        add_engine_flags(p)
        p.add_argument("--cache-address", default=None, help="host:port of the cache service (handoffs)")
        p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"],
                       help="when a handoff cannot be loaded: compute the prompt here, or fail the request")
        p.add_argument("--load-remote-prefix", action=argparse.BooleanOptionalAction, default=True,
                       help="colocated prompts: load cached prefixes from the cache service")
    elif role == "gateway":
        _add_gateway_role_flags(p)
    else:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    return p


def _add_gateway_role_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder (tokenizer and chat format are read from it)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", "--port", dest="http_port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=50051,
                   help="the public gRPC API (kdamesh.v1.Generation); 0: a free port, -1: off")
    p.add_argument("--decode-workers", "--decode-addresses", dest="decode_addresses", type=_addresses,
                   required=True, help="comma-separated host:port list of decode workers, or one "
                                       "dns:///NAME:PORT (every address of a headless Service, re-resolved)")
    p.add_argument("--prefill-workers", "--prefill-addresses", dest="prefill_addresses", type=_addresses,
                   default=(), help="comma-separated host:port list of prefill workers, or one dns:///NAME:PORT")
    p.add_argument("--cache-address", default=None,
                   help="host:port of the cache service: the gateway follows its KV events, so a prefix it holds "
                        "counts as reusable (a transfer) on workers that load remote prefixes (default: none)")
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    p.add_argument("--pd-min-uncached-tokens", type=int, default=256,
                   help="prefill remotely only when at least this many prompt tokens are uncached on the decode "
                        "worker (0: always, when prefill workers exist)")
    p.add_argument("--pd-max-prefill-inflight", type=int, default=0,
                   help="colocate when this many remote prefills are in flight (0: no limit)")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--grace-s", type=float, default=5.0,
                   help="shutdown grace period for streams and calls in flight (seconds)")
    p.add_argument("--handoff-ttl-ms", type=int, default=0, help="0: the cache service's default (30 s)")
    p.add_argument("--api-keys-file", default=None,
                   help="JSON object of API key -> tenant (or {tenant, rpm, tpm, max_concurrency}); also read: "
                        "KDAMESH_API_KEYS='key1=tenantA,key2=tenantB'. No keys: the gateway is open")
    p.add_argument("--tenant-rpm", type=int, default=None, help="requests/minute per tenant (0, default: no limit)")
    p.add_argument("--tenant-tpm", type=int, default=None, help="tokens/minute per tenant (default 20M; 0: none)")
    p.add_argument("--tenant-max-concurrency", type=int, default=None, help="in flight per tenant (default 256)")
    _gateway_guard_flags(p)
    p.add_argument("--tool-call-parser", default=None, choices=["kimi_k3", "kimi_k2"])
    p.add_argument("--reasoning-parser", default=None, choices=["kimi_k3", "kimi_k2"])
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let the model decide to call tools (tool_choice "auto"; needs --tool-call-parser)')
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length reported by /tokenize and /v1/models (default: the checkpoint's)")
    p.add_argument("--health-check-interval-s", type=float, default=5.0,
                   help="seconds between gRPC health checks of the workers")
    _gateway_serving_flags(p)


def _gateway_serving_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--discovery-refresh-s", type=float, default=10.0,
                   help="dns: worker pools: seconds between re-resolutions (also right after a health check fails)")
    p.add_argument("--discovery-startup-timeout-s", type=float, default=300.0,
                   help="dns: worker pools: seconds to wait at start-up for the first address of each pool")
    p.add_argument("--instance-id", default=None,
                   help="echoed by GET /health as X-Kdamesh-Instance (the launcher's readiness check)")
    p.add_argument("--disable-log-requests", action="store_true", help="no access-log line per request")
    p.add_argument("--uvicorn-log-level", default=None, help="the HTTP server's log level (default: --log-level)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="accepted so one flag set fits every role: prefix caching is the workers' (their flag)")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted, no effect (the code is built in)")


def _gateway_guard_flags(p: argparse.ArgumentParser) -> None:
    """The gateway's per-request caps (gateway/caps.py), what API keys guard beyond the API, and the image URLs it
    may read (gateway/media_fetch.py)."""
    p.add_argument("--max-prompts-per-request", type=int, default=256, help="prompts in one /v1/completions")
    p.add_argument("--max-sequences-per-request", type=int, default=256,
                   help="n x prompts: sequences one request may generate")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="tokens in one prompt, 413 beyond (default: the context length alone)")
    p.add_argument("--public-docs", action="store_true", help="serve /openapi.json, /docs, /redoc without a key")
    p.add_argument("--public-metrics", action="store_true", help="serve /metrics without a key")
    add_media_flags(p)


def gateway_config_from(ns: argparse.Namespace, api_keys: str | None = None):
    """The gateway's config from its flags (and the KDAMESH_API_KEYS value)."""
    from gateway.config import GatewayConfig

    return GatewayConfig(model=ns.model, decode_addresses=ns.decode_addresses,
                         prefill_addresses=ns.prefill_addresses, served_model_name=ns.served_model_name,
                         cache_address=ns.cache_address,
                         mode=ns.mode, pd_min_uncached_tokens=ns.pd_min_uncached_tokens,
                         pd_max_prefill_inflight=ns.pd_max_prefill_inflight, host=ns.host, http_port=ns.http_port,
                         grpc_port=None if ns.grpc_port < 0 else ns.grpc_port,
                         request_timeout_s=ns.request_timeout_s, handoff_ttl_ms=ns.handoff_ttl_ms,
                         api_keys=api_keys, api_keys_file=ns.api_keys_file, tenant_rpm=ns.tenant_rpm,
                         tenant_tpm=ns.tenant_tpm, tenant_max_concurrency=ns.tenant_max_concurrency,
                         max_prompts_per_request=ns.max_prompts_per_request, max_prompt_tokens=ns.max_prompt_tokens,
                         max_sequences_per_request=ns.max_sequences_per_request, public_docs=ns.public_docs,
                         public_metrics=ns.public_metrics,
                         tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                         enable_auto_tool_choice=ns.enable_auto_tool_choice,
                         max_model_len=ns.max_model_len, health_check_interval_s=ns.health_check_interval_s,
                         shutdown_grace_s=ns.grace_s, mesh_token=mesh_token_from_env(),
                         allowed_media_domains=tuple(ns.allowed_media_domains or ()),
                         allowed_local_media_path=ns.allowed_local_media_path,
                         media_fetch_timeout_s=ns.media_fetch_timeout_s,
                         instance_id=ns.instance_id, discovery_refresh_s=ns.discovery_refresh_s,
                         discovery_startup_timeout_s=ns.discovery_startup_timeout_s)


# -- running one role ----------------------------------------------------------------------------------------------


async def _serve_worker(role: str, ns: argparse.Namespace) -> int:
    if role == "prefill":
        from prefill_service.server import PrefillServiceConfig, serve

        config = PrefillServiceConfig(engine=engine_args_from(ns), cache_address=ns.cache_address,
                                      address=ns.address, served_model_name=ns.served_model_name,
                                      handoff_full_kv=ns.handoff_full_kv, load_remote_prefix=ns.load_remote_prefix,
                                      torch_threads=ns.torch_threads, metrics_port=ns.metrics_port,
                                      mesh_token=mesh_token_from_env())
    else:
        from decode_service.server import DecodeServiceConfig, serve

        config = DecodeServiceConfig(engine=engine_args_from(ns), cache_address=ns.cache_address,
                                     address=ns.address, served_model_name=ns.served_model_name,
                                     kv_load_failure_policy=ns.kv_load_failure_policy,
                                     load_remote_prefix=ns.load_remote_prefix,
                                     torch_threads=ns.torch_threads, metrics_port=ns.metrics_port,
                                     mesh_token=mesh_token_from_env())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server, port = await serve(config)
    ready = asyncio.ensure_future(server.ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        log.error("%s worker could not load %s: %s", role, ns.model, ready.exception())
        await server.stop(0)
        return 1
    if ready.done():
        host = ns.address.rsplit(":", 1)[0]
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port is not None else ""
        print(f"kdamesh {role} service listening on {host}:{port} (model {config.model_name}{metrics})", flush=True)
        await stopped
    else:
        ready.cancel()
    log.info("%s service stopping (grace %.1f s)", role, ns.grace_s)
    await server.stop(ns.grace_s)
    return 0


def run_role(role: str, argv: list[str], log_level: str = "INFO") -> int:
    if role not in ROLES:
        raise SystemExit(f"unknown role {role!r}; choose one of {', '.join(ROLES)}")
    if role == "cache":
        from cache_service.cli import main

        return main(argv)
    parser = role_parser(role)
    ns = parser.parse_args(argv)
    if role == "gateway":
        from gateway.app import serve
        from gateway.tenancy import API_KEYS_ENV

        if ns.disable_log_requests:
            logging.getLogger("uvicorn.access").disabled = True
        try:
            config = gateway_config_from(ns, os.environ.get(API_KEYS_ENV))
        except ValueError as exc:  # a flag's value the gateway refuses: argparse's error naming it (exit 2)
            parser.error(str(exc))
        asyncio.run(serve(config, log_level=ns.uvicorn_log_level or log_level))
        return 0
    if refusal(ns) is not None:
        parser.error(refusal(ns))
    if ns.torch_threads:
        import torch

        torch.set_num_threads(ns.torch_threads)
    from cache_service.malloc_tuning import tune_malloc

    tune_malloc()  # KV blocks and state snapshots move as MiB-sized buffers (see the module)
    return asyncio.run(_serve_worker(role, ns))
