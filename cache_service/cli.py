"""The cache service's command line: `python -m cache_service [flags]` and `kdamesh serve --role cache [flags]`.

Contract: `build_parser()` is generated from the flagged fields of `CacheServiceConfig` (cache_service/config.py;
byte sizes as `4GiB`, `512MiB`, `2GB` or plain bytes) and `CacheCliOptions`; `config_from_args(args)` builds the
config;
the mesh token comes from `KDAMESH_MESH_TOKEN` (never a flag: it would show in `ps`);
`main(argv)` runs one service until SIGINT/SIGTERM, printing `kdamesh cache service listening on HOST:PORT (...)`
once it serves, then stops it with `--grace-s` seconds for calls in flight and returns 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import dataclass

from cache_service.config import CacheServiceConfig
from cache_service.malloc_tuning import tune_malloc
from cache_service.server import serve
from telemetry.mesh_auth import mesh_token_from_env
from telemetry.options import add_options, from_namespace, log_level_option


@dataclass(frozen=True)
class CacheCliOptions:
    """The process's own flags beside the service's config."""

    log_level: str = log_level_option()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kdamesh serve --role cache", description="The kdamesh cache service.")
    add_options(p, CacheServiceConfig)
    add_options(p, CacheCliOptions)
    return p


def config_from_args(args: argparse.Namespace) -> CacheServiceConfig:
    return from_namespace(CacheServiceConfig, args, mesh_token=mesh_token_from_env())


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
    config = config_from_args(args)
    asyncio.run(_run_until_signal(config, config.shutdown_grace_s))
    return 0
