"""`kdamesh serve --role cache|prefill|decode|gateway [flags]`: runs one service until SIGINT/SIGTERM.

Contract:
- Each role's parser (`role_parser(role)`) is generated from its options object (telemetry/options.py):
  `PrefillServiceConfig` / `DecodeServiceConfig` with their `EngineArgs` (engine flags follow `vllm serve`:
  `--model`, `--max-num-seqs`, `--kv-cache-memory`, `--enable-prefix-caching`, ...) and `deploy.flags.VllmCompat`;
  `GatewayConfig`; the cache role is the cache service's own command line (`cache_service.cli.build_parser`).
  `worker_config_from(role, ns)`, `engine_args_from(ns)` and `gateway_config_from(ns)` build the objects back.
- The worker roles refuse, naming it, a `VllmCompat` flag set to anything but its no-op value
  (`deploy.flags.refusal`). The gateway role also accepts the workers' `--enable-prefix-caching` and
  `--trust-remote-code` (no effect there); a flag value its config refuses is argparse's error naming it.
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

from decode_service.config import DecodeServiceConfig
from deploy.flags import VllmCompat, refusal
from engine.config import EngineArgs
from gateway.config import GatewayConfig
from prefill_service.config import PrefillServiceConfig
from telemetry.mesh_auth import mesh_token_from_env
from telemetry.options import add_options, from_namespace

log = logging.getLogger(__name__)

ROLES = ("cache", "prefill", "decode", "gateway")
WORKER_CONFIGS = {"prefill": PrefillServiceConfig, "decode": DecodeServiceConfig}
VLLM_GROUP = "vllm serve: flags accepted at their no-op value only (refused by name)"


# -- flags ---------------------------------------------------------------------------------------------------------


def role_parser(role: str) -> argparse.ArgumentParser:
    if role == "cache":
        from cache_service.cli import build_parser

        return build_parser()
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    p = argparse.ArgumentParser(prog=f"kdamesh serve --role {role}")
    if role == "gateway":
        add_options(p, GatewayConfig)
        ignored = p.add_argument_group("accepted so one flag set fits every role (the workers' flags, no effect here)")
        add_options(ignored, EngineArgs, only=("enable_prefix_caching",))
        add_options(ignored, VllmCompat, only=("trust_remote_code",))
    else:
        add_options(p, WORKER_CONFIGS[role])
        add_options(p.add_argument_group(VLLM_GROUP), VllmCompat)
    return p


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return from_namespace(EngineArgs, ns)


def worker_config_from(role: str, ns: argparse.Namespace):
    """The prefill or decode service's config from its flags (and the mesh token of the environment)."""
    return from_namespace(WORKER_CONFIGS[role], ns, mesh_token=mesh_token_from_env())


def gateway_config_from(ns: argparse.Namespace, api_keys: str | None = None) -> GatewayConfig:
    """The gateway's config from its flags (and the KDAMESH_API_KEYS value)."""
    return from_namespace(GatewayConfig, ns, api_keys=api_keys, mesh_token=mesh_token_from_env())


# -- running one role ----------------------------------------------------------------------------------------------


async def _serve_worker(role: str, config) -> int:
    if role == "prefill":
        from prefill_service.server import serve
    else:
        from decode_service.server import serve
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server, port = await serve(config)
    ready = asyncio.ensure_future(server.ready())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    if ready.done() and ready.exception() is not None:
        log.error("%s worker could not load %s: %s", role, config.engine.model, ready.exception())
        await server.stop(0)
        return 1
    if ready.done():
        host = config.address.rsplit(":", 1)[0]
        metrics = f", metrics on :{server.metrics_port}" if server.metrics_port is not None else ""
        print(f"kdamesh {role} service listening on {host}:{port} (model {config.model_name}{metrics})", flush=True)
        await stopped
    else:
        ready.cancel()
    log.info("%s service stopping (grace %.1f s)", role, config.shutdown_grace_s)
    await server.stop(config.shutdown_grace_s)
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
        return _run_gateway(parser, ns, log_level)
    if refusal(ns) is not None:
        parser.error(refusal(ns))
    try:
        config = worker_config_from(role, ns)
    except ValueError as exc:  # EngineConfigError and the config's own checks name the option
        parser.error(str(exc))
    if config.torch_threads:
        import torch

        torch.set_num_threads(config.torch_threads)
    from cache_service.malloc_tuning import tune_malloc

    tune_malloc()  # KV blocks and state snapshots move as MiB-sized buffers (see the module)
    return asyncio.run(_serve_worker(role, config))


def _run_gateway(parser: argparse.ArgumentParser, ns: argparse.Namespace, log_level: str) -> int:
    from gateway.app import serve
    from gateway.tenancy import API_KEYS_ENV

    try:
        config = gateway_config_from(ns, os.environ.get(API_KEYS_ENV))
    except ValueError as exc:  # a flag's value the gateway refuses: argparse's error naming it (exit 2)
        parser.error(str(exc))
    if config.disable_log_requests:
        logging.getLogger("uvicorn.access").disabled = True
    asyncio.run(serve(config, log_level=config.uvicorn_log_level or log_level))
    return 0
