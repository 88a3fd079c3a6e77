"""`PrepSettings`: the options of the gateway's request preparation (gateway/prepare.py), apart so that the gateway's
config can hold them without importing the preparation machinery (which reaches the planner, which reads the
config).

Contract: a frozen dataclass; `__post_init__` refuses out-of-range values with a `ValueError` naming each flag.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrepSettings:
    workers: int = 2  # threads preparing requests
    queue_limit: int = 512  # requests waiting for a thread beyond those being prepared
    timeout_s: float = 30.0  # deadline of one request's preparation, queueing included (seconds)
    small_bytes: int = 64 << 10  # requests of at most this many bytes have their own lane
    switch_interval_ms: float = 1.0  # the interpreter's thread switch interval in the gateway's process (ms)
    processes: int = 2  # preparation processes of the large lane; 0: threads

    def __post_init__(self):
        if self.workers < 1 or self.queue_limit < 0 or self.timeout_s <= 0 or self.small_bytes < 0 \
                or self.switch_interval_ms <= 0 or self.processes < 0:
            raise ValueError("--prepare-workers must be >= 1, --prepare-queue-limit >= 0, --prepare-timeout-s > 0, "
                             "--prepare-small-bytes >= 0, --switch-interval-ms > 0 and --prepare-processes >= 0 "
                             f"(got {self.workers}, {self.queue_limit}, {self.timeout_s}, {self.small_bytes}, "
                             f"{self.switch_interval_ms}, {self.processes})")
