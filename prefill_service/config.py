"""The prefill service's options: `PrefillServiceConfig` (served by prefill_service/server.py).

Contract: a field a user sets carries its flag (telemetry/options.py; `engine` is a section of `EngineArgs` flags),
so `kdamesh serve --role prefill` and `kdamesh up` generate their parsers from it (deploy/serve.py). Importing this
module loads no torch and no engine runtime: the command lines read it before any model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineArgs
from telemetry.units import byte_size
from telemetry.options import (address_option, cache_address_option, grace_option, load_remote_prefix_option,
                               metrics_port_option, option, section, served_model_name_option, torch_threads_option)
from worker.kv_events import KVEventConfig


@dataclass(frozen=True)
class PrefillServiceConfig:
    engine: EngineArgs = section(EngineArgs, "engine")
    # host:port of the cache service the handoffs go through.
    cache_address: str = cache_address_option("host:port of the cache service")
    # host:port to listen on; port 0 picks a free port.
    address: str = address_option("127.0.0.1:50052")
    # Name clients use for the model (requests naming another are NOT_FOUND); None: the model folder's name.
    served_model_name: str | None = served_model_name_option()
    # Put every KV block in the handoff instead of only the tail partial block (more bytes, one fewer dependency).
    handoff_full_kv: bool = option("--handoff-full-kv", default=False, kind="switch",
                                   help="put every KV block in the handoff (default: the tail block; full blocks are "
                                        "shared)")
    # A handoff bigger than this streams: a manifest, head pieces and block groups of at most this many bytes
    # (worker/handoff_publish.py); keep it at or below the cache service's --max-object-bytes.
    handoff_part_bytes: int = option("--handoff-part-bytes", default=256 << 20, parse=byte_size,
                                     help="largest handoff object; a bigger handoff streams in parts (default "
                                          "256MiB)")
    # Load cached prefixes (blocks + snapshots) from the cache service when it holds more than the local cache.
    load_remote_prefix: bool = load_remote_prefix_option()
    # Deadline of each cache service call (seconds); gRPC message limit both ways (bytes).
    cache_timeout_s: float = 10.0
    max_message_bytes: int = 16 << 20
    # torch intra-op threads for this process; None: torch's default.
    torch_threads: int | None = torch_threads_option()
    # Serve Prometheus /metrics on this port (0: a free port), on the host of `address`; None: no HTTP endpoint.
    metrics_port: int | None = metrics_port_option()
    # On SIGTERM/SIGINT: how long calls in flight get to finish (seconds).
    shutdown_grace_s: float = grace_option()
    # The shared mesh token: required on calls to this worker and sent on its cache calls; None: open worker.
    mesh_token: str | None = field(default=None, repr=False)
    # The KV event stream to the gateways (worker/kv_events.py): drain period, heartbeat, subscriber queue.
    kv_events: KVEventConfig = KVEventConfig()

    def __post_init__(self) -> None:
        if self.handoff_part_bytes <= 0:
            raise ValueError(f"--handoff-part-bytes must be positive, got {self.handoff_part_bytes}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name
