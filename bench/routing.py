"""KV-event routing vs round-robin vs the old guess, same run: prefix hit rate and TTFT over 2 + 2 workers.

Usage: `python -m bench.routing [--settings local,shared] [--preset tiny-k3] [--tenants 4] [--prefixes 4]
[--requests-per-family 6] [--prefix-len 512] [--suffix-len 32] [--output-len 4] [--concurrency 4] [--out FILE]`

Per setting and policy, a fresh mesh in this process (cache service, 2 prefill + 2 decode workers, generated
checkpoint, CPU, greedy): `tenants × prefixes` families (one tenant's salt + one shared random prefix of
`prefix-len` tokens), each asked `requests-per-family` times with a new random suffix, shuffled, sent by
`concurrency` closed-loop clients through the gateway's `MeshClient` (P/D decision at its default 256 uncached
tokens; the client follows the cache service's KV events, `cache_address`). Settings:
- `local`: worker-local caches only (`load_remote_prefix=False` on every worker, `--no-load-remote-prefix`): a
  prefix hits only on a worker that computed it, so routing decides every hit (llm-d's setting).
- `shared`: workers import any prefix the cache service holds (the default): routing decides transfers, not hits.
Policies:
- `kv_events`: the gateway's router (gateway/routing.py): reusable tokens from each worker's KV event stream and
  the cache service's (for workers that import) + load; the P/D decision from the same pick.
- `round_robin`: each pool's workers in turn (the P/D decision reads the same indexes as `kv_events`).
- `guess`: the router before KV events, kept here only as a baseline: a per-worker LRU of the prefixes this gateway
  sent there (65536 hashes), cost = guessed uncached blocks + 8 × requests in flight; its P/D decision believes
  the decode worker holds whatever was sent through it.
Reported per setting and policy: prompt-token hit rate (cached / prompt tokens, as the workers report them), the
hit rate of the reusable tokens (the prefix of every request after its family's first), the share of requests the
P/D decision colocated, and TTFT p50 / p90 (first token event).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import OrderedDict
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path

from bench.common import model_folder, report
from gateway.mesh_client import MeshClient, MeshRequest, PDDecider
from gateway.prefix_index import HashSpace
from gateway.routing import Pick, Router

POLICIES = ("kv_events", "round_robin", "guess")
SETTINGS = ("local", "shared")
GUESS_SPACE = HashSpace(b"guess", 16)


class RoundRobinRouter(Router):
    """Each healthy worker in turn (the baseline of llm-d's comparison)."""

    _turn = 0

    def _pick(self, prompt):
        picks = self._costs(prompt)
        if not picks:
            return super()._pick(prompt)
        self._turn += 1
        return picks[self._turn % len(picks)]


class GuessRouter(Router):
    """The router before KV events: what this gateway sent a worker is what it is assumed to hold (an LRU)."""

    def __init__(self, addresses, capacity: int = 65536):
        super().__init__(addresses)
        self._sent = {a: OrderedDict() for a in addresses}
        self._capacity = capacity

    def _pick(self, prompt):
        hashes = prompt.hashes(GUESS_SPACE) if prompt is not None else []
        best = None
        for address, worker in self._workers.items():
            cached = next((i for i, h in enumerate(hashes) if h not in self._sent[address]), len(hashes))
            cost = len(hashes) - cached + 8.0 * worker.active
            if worker.healthy and (best is None or cost < best.cost):
                best = Pick(address, cached * 16, (len(hashes) - cached) * 16, worker.active, 0.0, cost)
        sent = self._sent[best.address]
        for h in reversed(hashes):
            sent[h] = None
            sent.move_to_end(h)
        while len(sent) > self._capacity:
            sent.popitem(last=False)
        return best


@dataclass
class Sample:
    prompt_tokens: int
    cached_tokens: int
    reusable: int
    ttft_s: float
    route: str  # "remote" | "local" (colocated) | "fallback"


def workload(args) -> list[tuple[bytes, list[int], int]]:
    """(tenant salt, prompt, reusable tokens) per request, shuffled."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(7936) for _ in range(args.prefix_len)] for _ in range(args.prefixes)]
    jobs = []
    for t in range(args.tenants):
        for prefix in prefixes:
            for r in range(args.requests_per_family):
                suffix = [rng.randrange(7936) for _ in range(args.suffix_len)]
                jobs.append((bytes([t + 1]) * 16, prefix + suffix, (t, prefixes.index(prefix))))
    rng.shuffle(jobs)
    seen, out = set(), []
    for salt, prompt, family in jobs:
        out.append((salt, prompt, args.prefix_len if family in seen else 0))
        seen.add(family)
    return out


async def one(client: MeshClient, salt: bytes, prompt: list[int], reusable: int, output_len: int) -> Sample:
    from protos import common_pb2

    sampling = common_pb2.SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    request = MeshRequest(f"b-{random.getrandbits(40):x}", tuple(prompt), sampling, tenant_salt=salt,
                          timeout_s=600.0)
    start, ttft, usage, route = time.perf_counter(), None, None, ""
    async with aclosing(client.generate(request)) as events:
        async for event in events:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            usage, route = event.usage or usage, event.route or route
    return Sample(usage.prompt_tokens, usage.cached_tokens, reusable, ttft, route)


async def run_policy(policy: str, setting: str, args, model_dir: Path) -> list[Sample]:
    from tests.integration.kv_pools import start_worker
    from tests.integration.mesh_harness import Mesh

    overrides = dict(kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=1024, snapshot_interval=64)
    async with Mesh(model_dir, engine=overrides, load_remote_prefix=setting == "shared") as mesh:
        extra = [await start_worker(mesh, role, model_dir, engine=overrides) for role in ("prefill", "decode")]
        decoders, prefillers = [mesh.decode_address, extra[1][1]], [mesh.prefill_address, extra[0][1]]
        client = MeshClient(decoders, prefillers, PDDecider(), cache_address=mesh.cache_address)
        if policy == "round_robin":
            client.decode_router, client.prefill_router = (RoundRobinRouter(decoders, cache_view=client.cache_view),
                                                           RoundRobinRouter(prefillers, cache_view=client.cache_view))
        elif policy == "guess":
            client.decode_router, client.prefill_router = GuessRouter(decoders), GuessRouter(prefillers)
        client.start_kv_events()
        await asyncio.sleep(0.5)  # the first snapshots
        queue = list(workload(args))
        samples: list[Sample] = []

        async def worker():
            while queue:
                salt, prompt, reusable = queue.pop(0)
                samples.append(await one(client, salt, prompt, reusable, args.output_len))

        try:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        finally:
            await client.close()
            for server, _ in extra:
                await server.stop(0)
    return samples


def summarize(setting: str, policy: str, samples: list[Sample]) -> dict:
    ttfts = sorted(s.ttft_s for s in samples)
    reusable = sum(s.reusable for s in samples)
    return {"setting": setting, "policy": policy, "requests": len(samples),
            "hit_rate": sum(s.cached_tokens for s in samples) / sum(s.prompt_tokens for s in samples),
            "reusable_hit_rate": sum(min(s.cached_tokens, s.reusable) for s in samples) / max(1, reusable),
            "colocated": sum(s.route == "local" for s in samples) / len(samples),
            "ttft_p50_s": statistics.median(ttfts), "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny-k3")
    p.add_argument("--model", default=None)
    for name, default in (("tenants", 4), ("prefixes", 4), ("requests-per-family", 6), ("prefix-len", 512),
                          ("suffix-len", 32), ("output-len", 4), ("concurrency", 4)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--kv-cache-memory", default=str(64 << 20))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    model_dir = model_folder(args)
    settings, policies = args.settings.split(","), args.policies.split(",")
    unknown = sorted(set(settings) - set(SETTINGS)) + sorted(set(policies) - set(POLICIES))
    if unknown:
        p.error(f"unknown setting or policy: {', '.join(unknown)} (settings: {SETTINGS}, policies: {POLICIES})")
    rows = [summarize(setting, policy, asyncio.run(run_policy(policy, setting, args, model_dir)))
            for setting in settings for policy in policies]
    lines = ["| setting | policy | requests | prompt hit rate | reusable-prefix hit rate | colocated | TTFT p50 (s) | "
             "TTFT p90 (s) |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['policy']} | {r['requests']} | {r['hit_rate']:.1%} | "
              f"{r['reusable_hit_rate']:.1%} | {r['colocated']:.0%} | {r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} |"
              for r in rows]
    return report("\n".join(lines), args, rows)


if __name__ == "__main__":
    sys.exit(main())
