"""The decode service's options: `DecodeServiceConfig` (served by decode_service/server.py).

Contract: a field a user sets carries its flag (telemetry/options.py; `engine` is a section of `EngineArgs` flags),
so `kdamesh serve --role decode` and `kdamesh up` generate their parsers from it (deploy/serve.py);
`kv_load_failure_policy` must be one of `KV_LOAD_FAILURE_POLICIES` (ValueError). Importing this module loads no
torch and no engine runtime: the command lines read it before any model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.config import EngineArgs
from telemetry.units import byte_size
from telemetry.options import (address_option, cache_address_option, grace_option, load_remote_prefix_option,
                               metrics_port_option, option, section, served_model_name_option, torch_threads_option)
from worker.kv_events import KVEventConfig

KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")  # when a handoff cannot be loaded: compute here, or fail the call


@dataclass(frozen=True)
class DecodeServiceConfig:
    engine: EngineArgs = section(EngineArgs, "engine")
    # host:port of the cache service handoffs come from; None: every handoff is unusable (local prefill only).
    cache_address: str | None = cache_address_option("host:port of the cache service (handoffs)", default=None)
    # host:port to listen on; port 0 picks a free port.
    address: str = address_option("127.0.0.1:50054")
    # Name clients use for the model; None: the model folder's name.
    served_model_name: str | None = served_model_name_option()
    # What to do when a handoff cannot be loaded: "recompute" the prompt here, or "fail" the call (UNAVAILABLE).
    kv_load_failure_policy: str = option("--kv-load-failure-policy", default="recompute",
                                         choices=KV_LOAD_FAILURE_POLICIES,
                                         help="when a handoff cannot be loaded: compute the prompt here, or fail the "
                                              "request")
    # A handoff's full KV blocks are read in groups of about this many bytes; with more than one group, each is
    # written into the engine while the next is fetched (worker/handoff_fetch.py).
    handoff_fetch_bytes: int = option("--handoff-fetch-bytes", default=64 << 20, parse=byte_size,
                                      help="KV bytes of a handoff read and imported per group; more than one group "
                                           "streams into the engine (default 64MiB)")
    # Longest wait for a part of a streamed handoff that the prefill worker has not stored yet (seconds); past it
    # the handoff is unusable (late_part) and the prompt is recomputed.
    handoff_part_wait_s: float = option("--handoff-part-wait-s", default=10.0, parse=float,
                                        help="longest wait for a part of a streamed handoff not stored yet, in "
                                             "seconds (default 10)")
    # Colocated prompts: load the longer cached prefix (blocks + snapshot) the cache service holds before computing.
    load_remote_prefix: bool = load_remote_prefix_option()
    # Deadline of each cache service call (seconds); gRPC message limit both ways (bytes).
    cache_timeout_s: float = 10.0
    max_message_bytes: int = 16 << 20
    # torch intra-op threads for this process; None: torch's default.
    torch_threads: int | None = torch_threads_option()
    # Serve Prometheus /metrics on this port (0: a free port), on the host of `address`; None: no HTTP endpoint.
    metrics_port: int | None = metrics_port_option()
    # On SIGTERM/SIGINT: how long streams in flight get to finish before they are aborted (seconds).
    shutdown_grace_s: float = grace_option()
    # The shared mesh token: required on calls to this worker and sent on its cache calls; None: open worker.
    mesh_token: str | None = field(default=None, repr=False)
    # The KV event stream to the gateways (worker/kv_events.py): drain period, heartbeat, subscriber queue.
    kv_events: KVEventConfig = KVEventConfig()

    def __post_init__(self):
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if self.handoff_fetch_bytes <= 0:
            raise ValueError(f"--handoff-fetch-bytes must be positive, got {self.handoff_fetch_bytes}")
        if not self.handoff_part_wait_s > 0:
            raise ValueError(f"--handoff-part-wait-s must be positive, got {self.handoff_part_wait_s}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.engine.model).name
