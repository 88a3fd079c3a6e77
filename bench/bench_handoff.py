"""Handoff time of a large handoff, whole vs streamed, and hashing on one thread vs several (issue 30, item 5).

Usage: `python -m bench.bench_handoff [--preset small-k3] [--mb 64,256] [--block-size 64] [--rounds 2]
[--threads N] [--out FILE]`

A synthetic handoff of `--mb` MB of KV blocks (random latents; small-k3's 2 MLA layers × 288 fp32 values, 2,304
bytes per token, make 256 MB about 116K tokens) for a decode engine of `--preset` with `--block-size`-token
blocks, through a cache service in its own process (memory backend, payloads through its shared-memory arena, as
deployed on one host). The prefill side is `worker/handoff_publish.py`'s `HandoffPublisher`, the decode side `worker/handoff_fetch.py`'s
`HandoffFetcher` and the engine's import, as in the workers. One handoff's time runs from the exported state on the
prefill side to the decode engine's first new token (publish, then — as the gateway does once prefill answers —
read, check, import and one decode step). Rows:
- `whole`: one BatchPut of every block and the handoff, one group read and checked before anything is imported,
  the state made whole and imported at once (the path before streaming; `--handoff-part-bytes` and
  `--handoff-fetch-bytes` above the handoff's size);
- `streamed`: the manifest and head first, the blocks published in groups of 8 MiB in the background (group k+1
  serialised while k is sent), the decode side importing group k into the engine while k+1 is fetched;
each with every block's sha256 on 1 thread or on `--threads` (default worker/hash_pool.py's `HASH_THREADS`).
Also sha256 of `--mb` MB in 1 MiB parts on 1 thread vs `--threads` (`hashing`). Times are the best of `--rounds`,
in seconds.
Prints a markdown table; `--out` writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch

import worker.hash_pool as hash_pool
from bench.bench_cache import ServiceProcess
from bench.common import report
from cache_service.client import CacheClient
from engine.async_engine import AsyncEngine
from engine.config import EngineArgs
from engine.model.checkpoint import make_checkpoint
from engine.sampling import SamplingParams
from engine.transfer import RequestState
from protos import common_pb2
from cache_service.objects import object_key
from worker.handoff_fetch import FetchCounters, HandoffFetcher
from worker.handoff_publish import HandoffPublisher
from worker.tenancy import engine_cache_salt, prompt_block_hashes

GROUP_BYTES = 8 << 20
HUGE = 1 << 40


class Counters(FetchCounters):
    published_bytes = published_blocks = publish_failures = handoff_parts = 0
    publish_seconds = 0.0


def synthetic_state(engine: AsyncEngine, megabytes: int, salt: bytes) -> RequestState:
    layout = engine.layout
    layers, bs, dim = layout.kv_block_shape
    full = (megabytes << 20) // layout.kv_block_bytes
    n = full * bs + bs // 2  # a tail half a block long
    g = torch.Generator().manual_seed(megabytes)
    prompt = torch.randint(0, 7900, (n,), generator=g).tolist()
    kv = torch.randn(layers, full + 1, bs, dim, generator=g) * 0.1  # fp32, the pool's dtype on CPU
    state = {name: torch.randn(shape, generator=g) * 0.1 for name, shape in layout.state_shapes.items()}
    return RequestState(prompt, [11], n, bs, layout.fingerprint, kv, state,
                        prompt_block_hashes(layout, prompt, salt), sampling_seed=0,
                        cache_salt=engine_cache_salt(salt))


async def one_handoff(engine: AsyncEngine, cache: CacheClient, state: RequestState, salt: bytes,
                      streamed: bool, run: int) -> dict[str, float]:
    """Publish -> read -> import -> the first new token; -> seconds of each phase and in total."""
    layout = engine.layout
    key = object_key(layout.fingerprint, salt, common_pb2.OBJECT_KIND_HANDOFF, hashlib.sha256(salt).digest())
    counters = Counters()
    part = GROUP_BYTES if streamed else HUGE
    publisher = HandoffPublisher(cache, layout.fingerprint, part, False, counters)
    fetcher = HandoffFetcher(cache, engine, GROUP_BYTES if streamed else HUGE, 60.0, counters, lambda keys: None)
    t0 = time.perf_counter()
    published = await publisher.publish(key, salt, state, state.block_hashes, list(range(len(state.block_hashes))),
                                        600.0)
    t1 = time.perf_counter()
    loaded = await fetcher.load(key, state.block_hashes, lambda s: None, _NoSpan(), None)
    t2 = time.perf_counter()
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    async for _ in engine.import_request(f"bench-{run}", loaded.state, params, lean=loaded.lean):
        pass
    t3 = time.perf_counter()
    await publisher.drain()
    several_groups = len(state.block_hashes) * layout.kv_block_bytes > GROUP_BYTES
    assert published.streamed == streamed and loaded.lean == (streamed and several_groups), (published, loaded)
    assert counters.publish_failures == 0, vars(counters)
    assert engine.core.scheduler.num_import_recomputes == 0
    await engine.run_in_engine(engine.core.reset_prefix_cache)
    keys = [key] + [object_key(layout.fingerprint, salt, common_pb2.OBJECT_KIND_KV_BLOCK, h)
                    for h in state.block_hashes]
    await cache.remove(keys, force=True)
    return {"publish": t1 - t0, "read_import": t2 - t1, "waiting": counters.handoff_wait_seconds,
            "first_token": t3 - t2, "total": t3 - t0}


class _NoSpan:
    def set_attribute(self, *_):
        pass


def hashing(megabytes: int, threads: int) -> dict[str, float]:
    """MB/s of sha256 over `megabytes` 1 MiB parts: in this thread, on `threads` plain threads (hashlib's own
    scaling), and on the workers' pool (worker/hash_pool.py: lowest CPU priority, so it yields to other load)."""
    parts = [os.urandom(1 << 20) for _ in range(megabytes)]
    plain = concurrent.futures.ThreadPoolExecutor(threads)
    ways = {"1 thread": lambda: [hashlib.sha256(p).digest() for p in parts],
            "plain threads": lambda: list(plain.map(lambda p: hashlib.sha256(p).digest(), parts)),
            "hash pool": lambda: hash_pool.digests(parts, threads=threads)}
    out = {}
    for name, fn in ways.items():
        start = time.perf_counter()
        fn()
        out[name] = megabytes * 1.048576 / (time.perf_counter() - start)
    plain.shutdown()
    return out


async def run(args: argparse.Namespace) -> dict:
    model = make_checkpoint(args.preset, Path(tempfile.mkdtemp()) / args.preset, seed=1)
    biggest = max(args.mb)
    engine = await AsyncEngine.create(EngineArgs(model=str(model), block_size=args.block_size, max_num_seqs=2,
                                                 kv_cache_memory=(biggest * 2 + 64) << 20,
                                                 max_num_batched_tokens=args.block_size * 4))
    service = ServiceProcess("memory")
    cache = CacheClient(service.address, timeout_s=300)
    rows: dict = {}
    try:
        run_id = 0
        for mb in args.mb:
            for streamed in (False, True):
                for threads in (1, args.threads):
                    best: dict[str, float] = {}
                    for _ in range(args.rounds):
                        run_id += 1
                        salt = f"bench-{run_id}".encode()
                        state = synthetic_state(engine, mb, salt)
                        hash_pool.HASH_THREADS = threads
                        got = await one_handoff(engine, cache, state, salt, streamed, run_id)
                        best = got if not best or got["total"] < best["total"] else best
                    rows[f"{mb} MB, {'streamed' if streamed else 'whole'}, {threads} hash thread(s)"] = best
            rows[f"sha256 of {mb} MB in 1 MiB parts (MB/s)"] = hashing(mb, args.threads)
    finally:
        await cache.close()
        await service.stop()
        await engine.shutdown()
    return rows


def table(rows: dict, threads: int) -> str:
    lines = ["| handoff | publish (s) | read + import (s) | of which waiting for parts | first token (s) | total (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {name} | {r['publish']:.2f} | {r['read_import']:.2f} | {r['waiting']:.2f} | {r['first_token']:.2f} "
              f"| **{r['total']:.2f}** |" for name, r in rows.items() if "total" in r]
    lines += ["", f"| hashing (MB/s) | 1 thread | {threads} plain threads | hash pool, {threads} threads |",
              "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name.removesuffix(' (MB/s)')} | " + " | ".join(f"{v:.0f}" for v in r.values()) + " |"
              for name, r in rows.items() if name.startswith("sha256")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small-k3")
    parser.add_argument("--mb", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=hash_pool.HASH_THREADS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    rows = asyncio.run(run(args))
    return report(table(rows, args.threads), args, rows)


if __name__ == "__main__":
    raise SystemExit(main())
