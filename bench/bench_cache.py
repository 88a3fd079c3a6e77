"""Cache service throughput: put and get of 1 MiB objects through the cache service vs raw redis-py, same run.

Usage: `python -m bench.bench_cache [--objects 64] [--object-bytes 1MiB] [--rounds 9] [--redis redis://127.0.0.1:6379/0]
[--in-process] [--out FILE]`

Rows (`CacheClient.put_objects` / `get_objects` unless raw):
- `service (memory, shm)`: memory backend, payloads through the service's shared-memory arena (data_plane="auto";
  the client checksums on put, the service verifies at Commit; the client verifies its copy on get).
- `service (memory, grpc)`: memory backend, payloads over the gRPC streams (data_plane="grpc").
- `service (redis, direct)`: Redis backend, the client runs the store's pipelines against Redis itself
  (data_plane="auto"; one checksum on put, one verification on get).
- `service (redis, grpc)`: Redis backend, payloads over the gRPC streams (data_plane="grpc"; checksums on the client
  and the service, both ways).
- `raw redis-py`: one pipelined SET of every object, then one pipelined GET, on the same Redis with the same bytes,
  no checksums: the baseline.
Checksums are XXH3-64 (the client's default). This process tunes malloc first (`malloc_tuning`), so the baseline
gets it too; the service process tunes its own. The service runs in its own process (`python -m cache_service`, as
deployed) unless `--in-process`; each service row asserts it used the plane it names. Each round moves all objects
in one call, right after raw redis-py did the same (paired, so machine load hits both alike); MB/s (10^6 bytes per
second of payload) is the best of `--rounds` rounds after one warm-up round, "vs raw" the median of the per-round
paired ratios. Keys live under the prefix `kdamesh-bench:` and are deleted at the end, the service's counter hash
with them. Prints a markdown table (target: >= 0.7x raw Redis); `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis

from bench.common import report
from cache_service.client import CacheClient, PutObject
from cache_service.malloc_tuning import tune_malloc
from cache_service.objects import Status, object_key
from cache_service.server import CacheServer, CacheServiceConfig, serve
from protos import common_pb2
from telemetry.units import byte_size

PREFIX = "kdamesh-bench:"
FINGERPRINT = b"bench-fingerprint"


def make_objects(count: int, size: int) -> list[bytes]:
    return [os.urandom(size) for _ in range(count)]


async def timed(fn: Callable[[], Awaitable[None]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


# -- the paths: each is a (put, get) pair of coroutine functions moving every object once --------------------------


class ServiceProcess:
    """`python -m cache_service` in a child process, on a free port."""

    def __init__(self, backend: str):
        cmd = [sys.executable, "-m", "cache_service", "--address", "127.0.0.1:0", "--cache-backend", backend,
               "--byte-budget", "4GiB", "--redis-key-prefix", PREFIX + "svc:", "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (\S+):(\d+)", line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"cache service did not start: {line!r}")
        self.address = f"127.0.0.1:{match.group(2)}"

    async def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


class InProcessService:
    """The service on this process's event loop."""

    def __init__(self, server: CacheServer, port: int):
        self.server = server
        self.address = f"127.0.0.1:{port}"

    @classmethod
    async def start(cls, backend: str) -> InProcessService:
        config = CacheServiceConfig(address="127.0.0.1:0", backend=backend, byte_budget=4 << 30,
                                    redis_key_prefix=PREFIX + "svc:")
        return cls(*await serve(config))

    async def stop(self) -> None:
        await self.server.stop(1)


class ServicePath:
    """One client of a service, on one data plane ("shm", "redis" or "grpc"), with keys of its own."""

    def __init__(self, service, objects: list[bytes], plane: str):
        self.service = service
        self.plane = plane
        self.client = CacheClient(service.address, timeout_s=120, data_plane="grpc" if plane == "grpc" else "auto")
        self.objects = objects
        self.keys = [object_key(FINGERPRINT, plane.encode(), common_pb2.OBJECT_KIND_KV_BLOCK, i.to_bytes(8, "big"))
                     for i in range(len(objects))]

    async def put(self) -> None:
        results = await self.client.put_objects([PutObject(k, d) for k, d in zip(self.keys, self.objects)])
        assert all(r.status == Status.STORED for r in results), results[0]
        assert self.client.data_planes.kind == self.plane, f"wanted {self.plane}, got {self.client.data_planes.kind}"

    async def get(self) -> None:
        results = await self.client.get_objects(self.keys)
        assert all(r.status == Status.FOUND for r in results), results[0]

    async def close(self) -> None:
        assert [r.data for r in await self.client.get_objects(self.keys)] == self.objects, "bytes differ"
        await self.client.remove(self.keys, force=True)
        await self.client.close()


class RawRedisPath:
    """Pipelined SET / GET with redis-py, with the service's connection settings (1 MiB socket reads)."""

    def __init__(self, url: str, objects: list[bytes]):
        self.redis = redis.Redis.from_url(url, socket_read_size=1 << 20)
        self.names = [f"{PREFIX}raw:{i}" for i in range(len(objects))]
        self.objects = objects

    async def put(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for name, data in zip(self.names, self.objects):
            pipe.set(name, data)
        pipe.execute()

    async def get(self) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for name in self.names:
            pipe.get(name)
        assert all(v is not None for v in pipe.execute())

    async def close(self) -> None:
        self.redis.delete(*self.names)
        self.redis.close()


async def start_service(backend: str, in_process: bool):
    return await InProcessService.start(backend) if in_process else ServiceProcess(backend)


async def measure(paths: dict, nbytes: int, rounds: int) -> dict[str, dict[str, float]]:
    """One warm-up round, then `rounds` rounds. In each, every service path's put and get is timed right after the
    same operation of raw redis-py, so each ratio compares two runs a few milliseconds apart (background load on a
    shared machine swings raw Redis alone by 2x between rounds). -> per path, MB/s of its fastest put and get, and
    the median over rounds of its paired put and get ratios to raw redis-py."""
    raw_name = "raw redis-py"
    raw = paths[raw_name]
    times = {name: {"put": [], "get": []} for name in paths}
    ratios = {name: {"put": [], "get": []} for name in paths}
    for r in range(rounds + 1):
        for name, path in paths.items():
            if name == raw_name:
                continue
            for op in ("put", "get"):
                raw_s, path_s = await timed(getattr(raw, op)), await timed(getattr(path, op))
                if r > 0:
                    times[raw_name][op].append(raw_s)
                    times[name][op].append(path_s)
                    ratios[name][op].append(raw_s / path_s)
                    ratios[raw_name][op].append(1.0)
    return {name: {"put_mb_s": nbytes / min(t["put"]) / 1e6, "get_mb_s": nbytes / min(t["get"]) / 1e6,
                   "put_vs_raw": statistics.median(ratios[name]["put"]),
                   "get_vs_raw": statistics.median(ratios[name]["get"])}
            for name, t in times.items()}


# -- report ------------------------------------------------------------------------------------------------------


def table(rows: dict[str, dict[str, float]], args: argparse.Namespace) -> str:
    lines = [f"Cache throughput: {args.objects} objects x {args.object_bytes} bytes, {args.rounds} rounds "
             f"({'in-process' if args.in_process else 'separate-process'} service); MB/s: the fastest round; "
             "vs raw: median over rounds of the ratio to raw redis-py timed just before", "",
             "| path | put MB/s | get MB/s | put vs raw | get vs raw |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['put_mb_s']:.0f} | {r['get_mb_s']:.0f} | "
                     f"{r['put_vs_raw']:.2f}x | {r['get_vs_raw']:.2f}x |")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    objects = make_objects(args.objects, args.object_bytes)
    memory = await start_service("memory", args.in_process)
    on_redis = await start_service(args.redis, args.in_process)
    paths = {"service (memory, shm)": ServicePath(memory, objects, "shm"),
             "service (memory, grpc)": ServicePath(memory, objects, "grpc"),
             "service (redis, direct)": ServicePath(on_redis, objects, "redis"),
             "service (redis, grpc)": ServicePath(on_redis, objects, "grpc"),
             "raw redis-py": RawRedisPath(args.redis, objects)}
    try:
        return await measure(paths, sum(map(len, objects)), args.rounds)
    finally:
        for path in paths.values():
            await path.close()
        for service in (memory, on_redis):
            await service.stop()
        with redis.Redis.from_url(args.redis) as client:
            client.delete(PREFIX + "svc:stats")  # the service's counters (see redis_store)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_cache", description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=64)
    parser.add_argument("--object-bytes", type=byte_size, default=1 << 20)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--in-process", action="store_true", help="run the service in this process")
    parser.add_argument("--out", type=Path, help="write the numbers as JSON")
    args = parser.parse_args(argv)
    tune_malloc()  # before any payload is allocated; raw redis-py gets it too (same process)
    rows = asyncio.run(run(args))
    return report(table(rows, args), args, rows)


if __name__ == "__main__":
    sys.exit(main())
