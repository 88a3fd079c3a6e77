"""Service discovery for the gateway's worker pools: every pod behind a (headless) DNS name, re-resolved.

Why: a Kubernetes Service name dialled through one gRPC channel (`pick_first`) sends a whole pool's traffic to one
pod. A headless Service answers one A/AAAA record per ready pod instead; the gateway dials each of them and routes
per request (gateway/routing.py).

Contract:
- A pool flag (`--decode-workers`, `--prefill-workers`) is either a static `host:port,...` list or exactly one DNS
  target: `dns:///NAME:PORT` (gRPC's spelling; also `dns:NAME:PORT`). `pool_target(addresses, flag)` -> the
  `DnsTarget` or None (static); a DNS target mixed with other entries, or without a port, is a ValueError naming
  the flag.
- A `Resolver` is `async (host, port) -> addresses` ("ip:port", IPv6 as "[ip]:port"). `system_resolver` asks the
  host's resolver (getaddrinfo: every A/AAAA record), sorted and deduplicated; a name with no records (NXDOMAIN /
  NODATA: a headless Service with no ready pod) resolves to (); any other failure raises `ResolveError`. Tests
  inject a fake.
- `PoolWatcher(role, target, resolver, settings)`: `resolve()` asks once, within `settings.resolve_timeout_s`, and
  returns the new address set, or None when nothing is to change: unchanged, the resolution failed or timed out
  (the last set is kept, logged), or it was empty for the decode pool (the mesh needs a decode worker; the last set
  is kept). An empty prefill set is applied (every request then takes the colocated path). `run(apply)` resolves
  every `refresh_s`, and at once after `notify_failure()` but never more often than every `min_refresh_s`, and
  gives each new set to `apply` (`MeshClient.set_worker_addresses(role, addresses)`), within `apply_timeout_s`.
- `Discovery(config, resolver, settings)` serves one `GatewayConfig` (typed here as `PoolsConfig`, the fields it
  reads): `active` when a pool is a DNS target (the
  prefill pool only in disaggregated mode). `resolve_config()` waits, within `settings.startup_timeout_s`, until
  every DNS pool resolved to at least one address (RuntimeError naming the target otherwise) and returns the config
  with those addresses (for `make_mesh`); a static config comes back as it is. `start(mesh)` runs one watcher task
  per DNS pool; `notify_failure(address)` (a worker failed its health check: pods may have moved) wakes the watcher
  of its pool; `stop()` cancels the tasks and waits for them, within `settings.stop_timeout_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


class PoolsConfig(Protocol):
    """What discovery reads of the gateway's config (`gateway.config.GatewayConfig`, a frozen dataclass; this
    module does not import it)."""

    decode_addresses: tuple[str, ...]
    prefill_addresses: tuple[str, ...]
    mode: str
    discovery_refresh_s: float
    discovery_startup_timeout_s: float


Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
Apply = Callable[[tuple[str, ...]], Awaitable[object]]
DNS_PREFIXES = ("dns:///", "dns:")
_NO_RECORDS = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}


class ResolveError(Exception):
    """The resolver failed (not: the name has no records)."""


@dataclass(frozen=True)
class DnsTarget:
    host: str
    port: int

    def __str__(self) -> str:
        return f"dns:///{self.host}:{self.port}"


@dataclass(frozen=True)
class DiscoverySettings:
    refresh_s: float = 10.0  # re-resolve this often (seconds)
    min_refresh_s: float = 1.0  # never more often than this, however many failures are notified
    resolve_timeout_s: float = 2.0  # one resolution's deadline
    apply_timeout_s: float = 10.0  # one `apply` (channels opened, event streams started / stopped)
    startup_timeout_s: float = 300.0  # `resolve_config`: how long the gateway waits for its first workers
    stop_timeout_s: float = 5.0

    def __post_init__(self):
        for name, value in dataclasses.asdict(self).items():
            if value <= 0:
                raise ValueError(f"discovery {name} must be positive, got {value}")
        if self.min_refresh_s > self.refresh_s:
            raise ValueError(f"min_refresh_s ({self.min_refresh_s}) must be <= refresh_s ({self.refresh_s})")


def pool_target(addresses: Sequence[str], flag: str) -> DnsTarget | None:
    """The DNS target of a pool flag's entries, or None for a static list (see the module docstring)."""
    dns = [a for a in addresses if a.startswith(DNS_PREFIXES[1])]
    if not dns:
        return None
    if len(addresses) != 1:
        raise ValueError(f"{flag}: a dns: target must be the pool's only entry, got {', '.join(addresses)}")
    text = dns[0]
    rest = text[len(DNS_PREFIXES[0]):] if text.startswith(DNS_PREFIXES[0]) else text[len(DNS_PREFIXES[1]):]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: expected dns:///NAME:PORT, got {text!r}")
    return DnsTarget(host.strip("[]"), int(port))


def _format(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


async def system_resolver(host: str, port: int) -> tuple[str, ...]:
    """Every A/AAAA record of `host`, as sorted "ip:port" strings (see the module docstring)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_RECORDS:
            return ()
        raise ResolveError(f"resolving {host}: {exc}") from exc
    return tuple(sorted({_format(info[4][0].split("%")[0], port) for info in infos}))


class PoolWatcher:
    """Keeps one pool's address set in step with its DNS target (see the module docstring)."""

    def __init__(self, role: str, target: DnsTarget, resolver: Resolver, settings: DiscoverySettings):
        self.role, self.target, self.settings = role, target, settings
        self._resolver = resolver
        self.addresses: tuple[str, ...] = ()  # the last set applied (or taken at start-up)
        self.last_error = ""
        self._wake = asyncio.Event()

    async def resolve(self) -> tuple[str, ...] | None:
        try:
            async with asyncio.timeout(self.settings.resolve_timeout_s):
                found = await self._resolver(self.target.host, self.target.port)
        except (ResolveError, OSError, TimeoutError) as exc:
            self.last_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("%s pool: resolving %s failed (%s); keeping %d workers", self.role, self.target,
                        self.last_error, len(self.addresses))
            return None
        found = tuple(sorted(set(found)))
        if found == self.addresses:
            return None
        if not found and self.role == "decode":
            self.last_error = "no addresses"
            log.warning("%s pool: %s has no addresses; keeping the last %d workers", self.role, self.target,
                        len(self.addresses))
            return None
        self.last_error = ""
        return found

    def notify_failure(self) -> None:
        self._wake.set()

    async def run(self, apply: Apply) -> None:
        """Re-resolves and applies until cancelled."""
        while True:
            try:  # asyncio.timeout, not wait_for: a cancellation racing the timeout is never lost (3.11)
                async with asyncio.timeout(self.settings.refresh_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            found = await self.resolve()
            if found is not None:
                await self._apply(apply, found)
            await asyncio.sleep(self.settings.min_refresh_s)

    async def _apply(self, apply: Apply, found: tuple[str, ...]) -> None:
        try:
            async with asyncio.timeout(self.settings.apply_timeout_s):
                await apply(found)
        except Exception as exc:  # noqa: BLE001 - one failed update must not stop discovery; retried next round
            log.error("%s pool: applying %d addresses from %s failed: %s", self.role, len(found), self.target, exc)
            return
        log.info("%s pool: %s now resolves to %s (was %s)", self.role, self.target, list(found),
                 list(self.addresses))
        self.addresses = found


class Discovery:
    """The gateway's watchers, one per DNS pool (see the module docstring)."""

    def __init__(self, config: PoolsConfig, resolver: Resolver = system_resolver,
                 settings: DiscoverySettings | None = None):
        self.config = config
        self.settings = settings or DiscoverySettings(refresh_s=config.discovery_refresh_s,
                                                      min_refresh_s=min(1.0, config.discovery_refresh_s),
                                                      startup_timeout_s=config.discovery_startup_timeout_s)
        pools = {"decode": pool_target(config.decode_addresses, "--decode-workers")}
        if config.mode == "disaggregated":
            pools["prefill"] = pool_target(config.prefill_addresses, "--prefill-workers")
        self.watchers = {role: PoolWatcher(role, target, resolver, self.settings)
                         for role, target in pools.items() if target is not None}
        self._tasks: list[asyncio.Task] = []

    @property
    def active(self) -> bool:
        return bool(self.watchers)

    async def resolve_config(self) -> PoolsConfig:
        """The config with every DNS pool's first non-empty address set (see the module docstring)."""
        deadline = time.monotonic() + self.settings.startup_timeout_s
        for watcher in self.watchers.values():
            while not watcher.addresses:
                found = await watcher.resolve()
                if found:
                    watcher.addresses = found
                    log.info("%s pool: %s resolves to %s", watcher.role, watcher.target, list(found))
                    break
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"{watcher.role} pool: {watcher.target} resolved to no worker within "
                                       f"{self.settings.startup_timeout_s:g} s ({watcher.last_error or 'no addresses'})")
                await asyncio.sleep(min(self.settings.min_refresh_s, max(0.0, deadline - time.monotonic())))
        resolved = {f"{role}_addresses": w.addresses for role, w in self.watchers.items()}
        return dataclasses.replace(self.config, **resolved) if resolved else self.config

    def start(self, mesh) -> None:
        """Runs the watchers, feeding `mesh.set_worker_addresses(role, addresses)`."""
        for role, watcher in self.watchers.items():
            async def apply(addresses: tuple[str, ...], role: str = role):
                return await mesh.set_worker_addresses(role, addresses)

            self._tasks.append(asyncio.create_task(watcher.run(apply), name=f"discovery-{role}"))

    def notify_failure(self, address: str) -> None:
        for watcher in self.watchers.values():
            if address in watcher.addresses:
                watcher.notify_failure()

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.settings.stop_timeout_s)
