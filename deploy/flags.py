"""The one flag table of the local mesh: `kdamesh up` and `kdamesh serve MODEL` (a drop-in for `vllm serve`).

Contract:
- `add_mesh_flags(parser, model_positional)` adds every flag `up` / `serve MODEL` take: the `vllm serve` flags that
  apply (`--tensor-parallel-size`, `--trust-remote-code`, `--load-format`, `--enable-prefix-caching`,
  `--enable-auto-tool-choice`, `--tool-call-parser`, `--reasoning-parser`, `--max-model-len`, `--max-num-seqs`,
  `--max-num-batched-tokens`, `--dtype`, `--seed`, `--host`, `--port`, `--api-key`, `--served-model-name`,
  `--disable-log-requests`, `--uvicorn-log-level`, ...) and the mesh's own (`--mode`, `--grpc-port`, `--no-restart`,
  ..., and the KDA snapshot options `--snapshot-interval`, `--snapshot-budget`, `--snapshot-policy` passed to both
  workers). `launch_config_from(ns)` turns the parsed flags into the launcher's `LaunchConfig`.
- `add_vllm_flags(group)` adds the `vllm serve` flags the worker roles (deploy/serve.py) share: tensor and expert
  parallelism, and those whose feature is not built yet. `refusal(ns)` is the message naming the first such flag
  set to something other than its no-op value (`--tensor-parallel-size` < 1, `--kv-cache-dtype` other than auto,
  `--gpu-memory-utilization` at all: the KV cache is sized by `--kv-cache-memory`) or a `--speculative-config`
  that does not parse (engine/spec/config.py: the message names the JSON field), else None. A refused flag is never silently accepted.
- `--speculative-config '{json}'` (vLLM's field names) goes to both workers: every request of a worker speculates
  (docs/api.md says which run plain).
- `add_media_flags(group)` adds the gateway's image URL flags, shared by `up` / `serve MODEL` and
  `serve --role gateway`: `--allowed-media-domains HOST [HOST ...]`, `--allowed-local-media-path DIR` (vLLM's
  names; unset here means off, see gateway/media_fetch.py) and `--media-fetch-timeout-s`. `media_refusal(ns)` is
  the message naming one with a bad value (a URL instead of a host name, a path that is no directory), else None.
- `--trust-remote-code` is accepted and has no effect: the model code is part of kdamesh, nothing is downloaded.
"""

from __future__ import annotations

import argparse

PARSER_CHOICES = "'auto' (the model family's format), 'none', kimi_k3 or kimi_k2"


def add_vllm_flags(g) -> None:
    """`vllm serve` flags the workers share: parallelism, and those accepted at their no-op value only (`refusal`)."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="rank processes each worker splits its model over (engine/parallel/executor.py)")
    g.add_argument("--enable-expert-parallel", action="store_true", help="split the routed experts by expert")
    g.add_argument("--speculative-config", default=None,
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4} (engine/spec/config.py)')
    g.add_argument("--kv-cache-dtype", default="auto", help="auto only (the KV cache has the model's dtype)")
    g.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="refused: size the KV cache with --kv-cache-memory")
    g.add_argument("--trust-remote-code", action="store_true", help="accepted, no effect (the model code is built in)")


def refusal(ns: argparse.Namespace) -> str | None:
    """The message naming the first flag of `add_vllm_flags` that asks for a feature not built yet."""
    if ns.tensor_parallel_size < 1:
        return f"--tensor-parallel-size {ns.tensor_parallel_size}: must be at least 1"
    if ns.speculative_config is not None:
        from engine.errors import EngineConfigError
        from engine.spec.config import SpeculativeConfig

        try:
            SpeculativeConfig.parse(ns.speculative_config)
        except EngineConfigError as e:
            return f"--speculative-config: {e}"
    if ns.kv_cache_dtype != "auto":
        return f"--kv-cache-dtype {ns.kv_cache_dtype}: only auto (the model's dtype) is built"
    if ns.gpu_memory_utilization is not None:
        return "--gpu-memory-utilization: not built; size the KV cache of each worker with --kv-cache-memory"
    return None


def add_media_flags(g) -> None:
    g.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="host names whose http(s) image URLs the gateway fetches (exact names, any port); "
                        "unset: none (only data: URLs, and files under --allowed-local-media-path)")
    g.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="a directory whose files image parts may name as file:///... URLs (symlinks and .. must "
                        "resolve inside it); unset: none. Only for trusted clients")
    g.add_argument("--media-fetch-timeout-s", type=float, default=5.0,
                   help="deadline of fetching one image URL, redirects and body included (seconds)")


def media_refusal(ns: argparse.Namespace) -> str | None:
    """The message naming an `add_media_flags` flag whose value the gateway would refuse, else None."""
    from gateway.media_fetch import MediaFetchConfig

    try:
        MediaFetchConfig(tuple(ns.allowed_media_domains or ()), ns.allowed_local_media_path, ns.media_fetch_timeout_s)
    except ValueError as exc:
        return str(exc)
    return None


def add_mesh_flags(p: argparse.ArgumentParser, model_positional: bool) -> None:
    if model_positional:
        p.add_argument("model", help="checkpoint folder (config.json, *.safetensors, tokenizer) or demo-k3")
    else:
        p.add_argument("--model", default=None, help="checkpoint folder or demo-k3 (default: demo-k3, the trained demo shipped in deploy/models)")
    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", "--http-port", dest="http_port", type=int, default=8000, help="the gateway's REST port")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="first of consecutive ports for the cache, prefill and decode services, in that order "
                        "(default: free)")
    p.add_argument("--prefill-replicas", type=int, default=1,
                   help="prefill workers (disaggregated mode), each on its own ports; the gateway routes over them")
    p.add_argument("--decode-replicas", type=int, default=1,
                   help="decode workers, each on its own ports; the gateway routes over them")
    p.add_argument("--cache-backend", default="memory", help="'memory' or redis://host:port/db")
    p.add_argument("--cache-byte-budget", default=None, help="memory backend budget, e.g. 4GiB")
    p.add_argument("--pd-min-uncached-tokens", type=int, default=256,
                   help="prefill remotely only when at least this many prompt tokens are uncached")
    p.add_argument("--kv-load-failure-policy", default="recompute", choices=["recompute", "fail"])
    p.add_argument("--load-remote-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="workers import cached prefixes from the cache service before computing (off: each "
                        "worker's own cache only; the gateway's routing then decides every hit)")
    _add_engine_flags(p.add_argument_group("engine (both workers)"))
    _add_gateway_flags(p.add_argument_group("gateway"))
    p.add_argument("--metrics-port", type=int, default=None,
                   help="first of consecutive Prometheus /metrics ports for the cache, prefill and decode services "
                        "(default: free); the gateway's /metrics is on its REST port")
    p.add_argument("--grace-s", type=float, default=None,
                   help="on Ctrl-C/SIGTERM: how long every service lets calls and streams in flight finish (seconds; "
                        "default: each service's own, 5 s)")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="a service that exits stops the whole mesh (default: restart it with backoff)")
    add_vllm_flags(p.add_argument_group("vllm serve: parallelism, and flags not built yet (refused by name)"))


def _add_engine_flags(g) -> None:
    """The engine options passed to both workers (unset: the engine's defaults)."""
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--kv-cache-memory", default=None, help="per worker, e.g. 1GiB")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--load-format", default=None, choices=["safetensors", "fastsafetensors", "dummy"])
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--device", default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--torch-threads", type=int, default=None, help="torch threads per worker process")
    g.add_argument("--snapshot-interval", default=None, help="tokens between KDA state snapshots, or 'auto'")
    g.add_argument("--snapshot-budget", default=None, help="bytes for KDA state snapshots per worker, e.g. 2GiB")
    g.add_argument("--snapshot-policy", default=None, choices=["hybrid", "periodic"],
                   help="where the workers snapshot KDA state (default: the engine's, hybrid)")


def _add_gateway_flags(g) -> None:
    g.add_argument("--served-model-name", default=None)
    g.add_argument("--gateway-grpc-port", type=int, default=None,
                   help="the gateway's public gRPC API (default: --grpc-port + 3, or a free port)")
    g.add_argument("--api-keys-file", default=None,
                   help="JSON object of API key -> tenant for the gateway (KDAMESH_API_KEYS is passed through too)")
    g.add_argument("--api-key", default=None, help="one API key every client must send (tenant 'default')")
    for flag in ("--tool-call-parser", "--reasoning-parser"):
        g.add_argument(flag, default="auto", help=PARSER_CHOICES)
    g.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help='tool_choice "auto" (needs a tool-call parser)')
    add_media_flags(g)
    g.add_argument("--disable-log-requests", action="store_true", help="no access log line per request")
    g.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug",
                                                                  "trace"],
                   help="the gateway's HTTP server log level (default: --log-level)")


def launch_config_from(ns: argparse.Namespace, log_level: str, log_format: str, trace_exporter: str):
    """The launcher's config from `add_mesh_flags` flags and the global logging flags."""
    from deploy.launcher import LaunchConfig

    return LaunchConfig(
        model=ns.model, mode=ns.mode, host=ns.host, http_port=ns.http_port, grpc_port=ns.grpc_port,
        cache_backend=ns.cache_backend, cache_byte_budget=ns.cache_byte_budget,
        pd_min_uncached_tokens=ns.pd_min_uncached_tokens, kv_load_failure_policy=ns.kv_load_failure_policy,
        load_remote_prefix=ns.load_remote_prefix,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_cache_memory=ns.kv_cache_memory, max_model_len=ns.max_model_len, dtype=ns.dtype,
        load_format=ns.load_format, seed=ns.seed, device=ns.device, enable_prefix_caching=ns.enable_prefix_caching,
        torch_threads=ns.torch_threads, tensor_parallel_size=ns.tensor_parallel_size,
        enable_expert_parallel=ns.enable_expert_parallel, snapshot_interval=ns.snapshot_interval, snapshot_budget=ns.snapshot_budget,
        snapshot_policy=ns.snapshot_policy, served_model_name=ns.served_model_name,
        speculative_config=ns.speculative_config,
        gateway_grpc_port=ns.gateway_grpc_port, api_keys_file=ns.api_keys_file,
        api_keys=None if ns.api_key is None else f"{ns.api_key}=default",
        tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice, disable_log_requests=ns.disable_log_requests,
        allowed_media_domains=tuple(ns.allowed_media_domains or ()),
        allowed_local_media_path=ns.allowed_local_media_path, media_fetch_timeout_s=ns.media_fetch_timeout_s,
        uvicorn_log_level=ns.uvicorn_log_level, log_level=log_level.upper(), log_format=log_format,
        trace_exporter=trace_exporter, metrics_port=ns.metrics_port, grace_s=ns.grace_s, restart=ns.restart,
        prefill_replicas=ns.prefill_replicas, decode_replicas=ns.decode_replicas)
