"""The cache service's command line: `python -m cache_service [flags]` and `kdamesh serve --role cache [flags]`.

Contract: `build_parser()` declares one flag per `CacheServiceConfig` field a user sets (byte sizes as `4GiB`,
`512MiB`, `2GB` or plain bytes: `telemetry.units.parse_bytes`); `config_from_args(args)` builds the config;
the mesh token comes from `KDAMESH_MESH_TOKEN` (never a flag: it would show in `ps`);
`main(argv)` runs one service until SIGINT/SIGTERM, printing `kdamesh cache service listening on HOST:PORT (...)`
once it serves, then stops it with `--grace-s` seconds for calls in flight and returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from cache_service.config import CacheServiceConfig
from cache_service.malloc_tuning import tune_malloc
from cache_service.server import serve
from telemetry.mesh_auth import mesh_token_from_env
from telemetry.units import byte_size


def build_parser() -> argparse.ArgumentParser:
    d = CacheServiceConfig()
    p = argparse.ArgumentParser(prog="kdamesh serve --role cache", description="The kdamesh cache service.")
    p.add_argument("--address", default=d.address, help="host:port to listen on (port 0: a free port)")
    p.add_argument("--cache-backend", "--backend", dest="backend", default=d.backend,
                   help="'memory', redis://host:port/db, or a Redis Cluster redis+cluster://host:port,host:port")
    p.add_argument("--byte-budget", type=byte_size, default=d.byte_budget, help="memory backend budget, e.g. 4GiB")
    p.add_argument("--high-watermark", type=float, default=d.high_watermark)
    p.add_argument("--low-watermark", type=float, default=d.low_watermark)
    p.add_argument("--handoff-ttl-s", type=float, default=d.handoff_ttl_s)
    p.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s)
    p.add_argument("--chunk-bytes", type=byte_size, default=d.chunk_bytes)
    p.add_argument("--max-message-bytes", type=byte_size, default=d.max_message_bytes)
    p.add_argument("--max-object-bytes", type=byte_size, default=d.max_object_bytes)
    p.add_argument("--redis-key-prefix", default=d.redis_key_prefix)
    p.add_argument("--redis-inline-bytes", type=byte_size, default=d.redis_inline_bytes,
                   help="Redis backend: payloads up to this size are stored inside their manifest")
    p.add_argument("--memory-arena", choices=("shm", "heap"), default=d.memory_arena,
                   help="memory backend: payloads in a shared-memory arena local clients map (shm), or the heap")
    p.add_argument("--shm-dir", default=d.shm_dir, help="directory of the shared-memory arena (a tmpfs)")
    p.add_argument("--verify-commits", action="store_true",
                   help="re-verify shared-memory puts at Commit (reads always verify)")
    p.add_argument("--no-data-plane", dest="data_plane", action="store_false",
                   help="offer no direct data plane (Redis URL, shared-memory arena): payloads over gRPC only")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--grace-s", type=float, default=5.0, help="shutdown grace period (seconds)")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from_args(args: argparse.Namespace) -> CacheServiceConfig:
    return CacheServiceConfig(
        address=args.address, backend=args.backend, byte_budget=args.byte_budget,
        high_watermark=args.high_watermark, low_watermark=args.low_watermark, handoff_ttl_s=args.handoff_ttl_s,
        lease_ttl_s=args.lease_ttl_s, chunk_bytes=args.chunk_bytes, max_message_bytes=args.max_message_bytes,
        max_object_bytes=args.max_object_bytes, redis_key_prefix=args.redis_key_prefix,
        redis_inline_bytes=args.redis_inline_bytes, memory_arena=args.memory_arena, shm_dir=args.shm_dir,
        verify_commits=args.verify_commits,
        data_plane=args.data_plane, metrics_port=args.metrics_port, mesh_token=mesh_token_from_env())


async def _run_until_signal(config: CacheServiceConfig, grace_s: float) -> None:
    server, port = await serve(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host = config.address.rsplit(":", 1)[0]
    extra = f", metrics on :{server.metrics_port}" if server.metrics_port is not None else ""
    try:
        print(f"kdamesh cache service listening on {host}:{port} (backend {server.store.backend}{extra})",
              flush=True)
        await stop.wait()
    finally:  # stopped by a signal, or by an error or a cancellation: the arena goes either way
        await server.stop(grace_s)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tune_malloc()  # MiB payload buffers reuse heap memory instead of faulting in fresh pages (see malloc_tuning)
    asyncio.run(_run_until_signal(config_from_args(args), args.grace_s))
    return 0
