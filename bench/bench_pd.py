"""Disaggregated vs colocated serving: time to first token (TTFT) and inter-token latency (ITL), same run.

Usage: `python -m bench.bench_pd [--preset small-k3] [--prompt-len 2048] [--concurrency 8] [--num-requests N]
[--max-tokens 32] [--threads 1] [--out FILE]`

Starts a cache service, a prefill worker and a decode worker as separate processes (as `kdamesh up` does), then
sends the same kind of load through the gateway's `MeshClient` twice, alternating per phase:
- colocated: every request prefills and decodes on the decode worker (`Decode` with a local prompt);
- disaggregated: `Prefill` on the prefill worker, handoff through the cache service, `Decode` from the handoff
  (P/D threshold 0: every request goes remote).
Prompts are random `--prompt-len`-token id sequences, unique per request (no prefix-cache hits); outputs are
`--max-tokens` greedy tokens with EOS ignored. Each mode runs at concurrency 1 (the handoff's cost alone) and at
`--concurrency` (`--num-requests` requests, default one burst of `--concurrency`, sent by a closed loop of
`--concurrency` clients). With more requests than clients the loop under-states the TTFT of the mode whose decode is
slower (its next requests are sent later: coordinated omission), so the default is one burst. TTFT is measured at
the client from sending the request to receiving the first token; ITL is (last token time - first token time) /
(tokens - 1) per request. The handoff overhead ratio is disaggregated TTFT / colocated TTFT (target <= 1.3).

Each worker process runs torch with `--threads` threads. On a small CPU box the two modes do not get the same
hardware: disaggregated runs prefill and decode in two processes at once, colocated in one. Prints markdown tables;
`--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import model_folder, report
from deploy.launcher import Service, free_port, wait_ready
from gateway.mesh_client import MeshClient, MeshRequest, PDDecider
from protos import common_pb2

VOCAB_FOR_PROMPTS = 7900


def start_workers(model: Path, args: argparse.Namespace) -> tuple[list[Service], dict[str, str]]:
    ports = {role: f"127.0.0.1:{free_port()}" for role in ("cache", "prefill", "decode")}
    engine = ["--model", str(model), "--max-num-seqs", str(max(args.concurrency, 1)), "--torch-threads",
              str(args.threads), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    services = [Service("cache", ports["cache"], ["--address", ports["cache"]]),
                Service("prefill", ports["prefill"], ["--address", ports["prefill"], "--cache-address",
                                                      ports["cache"], *engine]),
                Service("decode", ports["decode"], ["--address", ports["decode"], "--cache-address",
                                                    ports["cache"], *engine])]
    for s in services:
        s.start("WARNING")
    wait_ready(services, 600)
    return services, ports


async def one_request(client: MeshClient, prompt: list[int], max_tokens: int, request_id: str) -> dict:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    times: list[float] = []
    route = ""
    async for event in client.generate(MeshRequest(request_id, tuple(prompt), sampling, timeout_s=3600)):
        now = time.perf_counter()
        times.extend([now] * len(event.token_ids))
        if event.usage is not None:
            route = event.route
    assert len(times) == max_tokens, f"{request_id}: {len(times)} tokens"
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return {"ttft": times[0] - t0, "itl": itl, "e2e": times[-1] - t0, "route": route}


async def load(client: MeshClient, prompts: list[list[int]], concurrency: int, max_tokens: int, tag: str) -> dict:
    queue = list(enumerate(prompts))
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            i, prompt = queue.pop(0)
            results.append(await one_request(client, prompt, max_tokens, f"{tag}-{i}"))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(r["itl"] for r in results)
    return {"requests": len(results), "concurrency": concurrency, "wall_s": wall,
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
            "itl_mean_ms": 1e3 * statistics.mean(itl), "itl_p50_ms": 1e3 * _pct(itl, 50),
            "itl_p90_ms": 1e3 * _pct(itl, 90), "output_tok_s": len(results) * max_tokens / wall,
            "routes": sorted({r["route"] for r in results})}


def _pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def run(args: argparse.Namespace, ports: dict[str, str]) -> dict:
    rng = random.Random(args.seed)

    def prompts(n: int) -> list[list[int]]:
        return [[rng.randrange(VOCAB_FOR_PROMPTS) for _ in range(args.prompt_len)] for _ in range(n)]

    clients = {"colocated": MeshClient([ports["decode"]]),
               "disaggregated": MeshClient([ports["decode"]], [ports["prefill"]], PDDecider(0))}
    rows: dict[str, dict] = {}
    try:
        for mode, client in clients.items():  # warm-up: first calls pay one-off costs (kernels, allocations)
            await load(client, prompts(1), 1, 4, f"warm-{mode}")
        for phase, (n, conc) in {"c1": (args.single_requests, 1),
                                 f"c{args.concurrency}": (args.num_requests, args.concurrency)}.items():
            for mode in ("colocated", "disaggregated"):
                stats = clients[mode].stats
                before = (stats.remote, stats.handoff_bytes, stats.prefill_ms, stats.publish_ms)
                row = await load(clients[mode], prompts(n), conc, args.max_tokens, f"{phase}-{mode}")
                remote = stats.remote - before[0]
                if remote:
                    row["handoff_kib_mean"] = (stats.handoff_bytes - before[1]) / remote / 1024
                    row["prefill_worker_ms_mean"] = (stats.prefill_ms - before[2]) / remote
                    row["publish_ms_mean"] = (stats.publish_ms - before[3]) / remote
                rows[f"{phase} {mode}"] = row
                rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
                print(f"{phase} {mode}: {json.dumps(rounded)}", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.close()
    return rows


def table(rows: dict[str, dict], args: argparse.Namespace) -> str:
    lines = [f"Disaggregated vs colocated, {args.preset}, {args.prompt_len}-token prompts, {args.max_tokens} output "
             f"tokens, {args.threads} torch thread(s) per worker", "",
             "| phase / mode | requests | TTFT mean (s) | TTFT p50 (s) | TTFT p90 (s) | ITL mean (ms) | ITL p90 (ms) | "
             "out tok/s | handoff (KiB) | publish (ms) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['requests']} | {r['ttft_mean_s']:.3f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p90_s']:.3f} | {r['itl_mean_ms']:.1f} | {r['itl_p90_ms']:.1f} | "
                     f"{r['output_tok_s']:.2f} | {r.get('handoff_kib_mean', 0):.0f} | "
                     f"{r.get('publish_ms_mean', 0):.1f} |")
    lines.append("")
    for phase in dict.fromkeys(n.split()[0] for n in rows):
        co, dis = rows[f"{phase} colocated"], rows[f"{phase} disaggregated"]
        lines.append(f"- {phase}: handoff overhead ratio (disaggregated / colocated TTFT, mean) = "
                     f"{dis['ttft_mean_s'] / co['ttft_mean_s']:.2f}x (p50 {dis['ttft_p50_s'] / co['ttft_p50_s']:.2f}x;"
                     f" target <= 1.3x); ITL ratio {dis['itl_mean_ms'] / co['itl_mean_ms']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_pd", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-k3")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the preset, generated once)")
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=None, help="default: --concurrency (one burst)")
    parser.add_argument("--single-requests", type=int, default=3, help="requests at concurrency 1 per mode")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the numbers as JSON")
    args = parser.parse_args(argv)
    args.num_requests = args.num_requests or args.concurrency
    model = model_folder(args)
    services, ports = start_workers(model, args)
    try:
        rows = asyncio.run(run(args, ports))
    finally:
        for s in reversed(services):
            s.stop(15)
    return report(table(rows, args), args, rows)


if __name__ == "__main__":
    sys.exit(main())
