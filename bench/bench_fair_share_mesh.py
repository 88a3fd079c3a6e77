"""Fair share through a launched mesh (issue 27, as the issue measures it): tenant B's short chat on the idle mesh,
then while tenant A floods every slot.

Usage: `python -m bench.bench_fair_share_mesh [--preset tiny-k3 | --model DIR] [--flood 64] [--flood-tokens 512]
[--short-tokens 8] [--shorts 5] [--stream-flood] [--threads 1] [--out FILE]`

Starts `kdamesh up --mode colocated` (gateway, decode worker with `--flood` slots and the cache service, each its own
process, one torch thread each) with two API keys (tenant-a, tenant-b), and drives it with the official `openai`
client. Phases, B's chats sent one after another (`--shorts` each, `--short-tokens` tokens, greedy, EOS ignored):
`idle before` (after one warm-up chat), `flood` (A's `--flood` chats of `--flood-tokens` tokens sent at once —
non-streamed, or streamed with `--stream-flood` —; B starts once the decode worker's gauges show all of A's running),
`idle after` (once A's flood ended). Reported: B's latency per phase (median, max; seconds), the flood median over
the median of both idle phases (the issue's "within 5x its time on an idle mesh"), and the flood's engine steps per
second and tokens the engine ran per second while B ran (the decode worker's `/metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from bench.common import model_folder, report
from deploy.launcher import free_port

PROMPT = "Name three lighthouses."


def start_mesh(model: Path, args: argparse.Namespace, folder: Path) -> tuple[subprocess.Popen, int, dict]:
    """`kdamesh up` on free ports, its log in `folder` -> (its process, the gateway's port, the services' metrics
    URLs) once every service is ready."""
    keys, log = folder / "keys.json", folder / "up.log"
    keys.write_text(json.dumps({"key-a": "tenant-a", "key-b": "tenant-b"}))
    port = free_port()
    cmd = [sys.executable, "-m", "deploy.cli", "--log-level", "warning", "up", "--model", str(model), "--port",
           str(port), "--mode", "colocated", "--no-restart", "--torch-threads", str(args.threads), "--max-num-seqs",
           str(args.flood), "--kv-cache-memory", "96MiB", "--api-keys-file", str(keys)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        line = next((x for x in log.read_text().splitlines() if x.startswith("metrics ")), None)
        if line is not None:  # printed once every service is ready
            return proc, port, json.loads(line[len("metrics "):])
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError(f"kdamesh up did not become ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


async def chat(client: openai.AsyncOpenAI, model: str, text: str, tokens: int, stream: bool = False) -> int:
    """One greedy chat of `tokens` tokens (EOS ignored) -> its completion tokens."""
    kwargs = dict(model=model, messages=[{"role": "user", "content": text}], max_tokens=tokens,
                  temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        return (await client.chat.completions.create(**kwargs)).usage.completion_tokens
    chunks = await client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    return [c async for c in chunks][-1].usage.completion_tokens


async def shorts(client: openai.AsyncOpenAI, args: argparse.Namespace) -> list[float]:
    """B's chats one after another -> their seconds."""
    seconds = []
    for _ in range(args.shorts):
        start = time.monotonic()
        assert await chat(client, args.served, PROMPT, args.short_tokens) == args.short_tokens
        seconds.append(time.monotonic() - start)
    return seconds


async def scrape(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The decode worker's series this bench reads: A's running requests, engine steps and the tokens they ran."""
    wanted = {'kdamesh_decode_tenant_running_requests{tenant="tenant-a"}': "a_running",
              "vllm:iteration_tokens_total_count": "steps", "vllm:iteration_tokens_total_sum": "tokens"}
    values = {}
    for line in (await http.get(url)).text.splitlines():
        name, _, value = line.rpartition(" ")
        key = name.split("{model_name")[0] if name.startswith("vllm:") else name
        if key in wanted:
            values[wanted[key]] = values.get(wanted[key], 0.0) + float(value)
    return values


async def flood_phase(a: openai.AsyncOpenAI, b: openai.AsyncOpenAI, url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(timeout=10) as http:
        flood = [asyncio.create_task(chat(a, args.served, f"Tell the story of lighthouse number {i}.",
                                          args.flood_tokens, args.stream_flood)) for i in range(args.flood)]
        while (await scrape(http, url)).get("a_running", 0) < args.flood:
            if any(t.done() for t in flood):
                raise RuntimeError("the flood ended before it filled the batch: raise --flood-tokens")
            await asyncio.sleep(0.05)
        before, start = await scrape(http, url), time.monotonic()
        seconds = await shorts(b, args)
        after, elapsed = await scrape(http, url), time.monotonic() - start
        if any(t.done() for t in flood):
            raise RuntimeError("the flood ended while B ran: raise --flood-tokens")
        await asyncio.gather(*flood)
    return {"seconds": seconds, "steps_per_s": (after["steps"] - before["steps"]) / elapsed,
            "tokens_per_s": (after["tokens"] - before["tokens"]) / elapsed}


async def run(port: int, metrics: dict, args: argparse.Namespace) -> dict:
    def client(key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=600)
    a, b = client("key-a"), client("key-b")
    await chat(b, args.served, PROMPT, args.short_tokens)  # warm-up
    rows = {"idle before": {"seconds": await shorts(b, args)}}
    rows["flood"] = await flood_phase(a, b, metrics["decode"], args)
    rows["idle after"] = {"seconds": await shorts(b, args)}
    return rows


def table(rows: dict, args: argparse.Namespace) -> str:
    idle = statistics.median(rows["idle before"]["seconds"] + rows["idle after"]["seconds"])
    kind = "streamed" if args.stream_flood else "non-streamed"
    lines = [f"| phase (A: {args.flood} {kind} chats of {args.flood_tokens} tokens) | B median (s) | B max (s) | "
             "x idle | flood steps/s | engine tokens/s |", "| --- | --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        med = statistics.median(row["seconds"])
        row["x_idle"] = med / idle
        flood = name == "flood"
        lines.append(f"| {name} | {med:.3f} | {max(row['seconds']):.3f} | {med / idle:.1f} | "
                     f"{row['steps_per_s']:.0f} | {row['tokens_per_s']:.0f} |" if flood else
                     f"| {name} | {med:.3f} | {max(row['seconds']):.3f} | {med / idle:.1f} | - | - |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_fair_share_mesh", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-k3")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the preset, generated once)")
    parser.add_argument("--flood", type=int, default=64, help="A's chats, and the decode worker's slots")
    parser.add_argument("--flood-tokens", type=int, default=512)
    parser.add_argument("--short-tokens", type=int, default=8)
    parser.add_argument("--shorts", type=int, default=5, help="B's chats per phase")
    parser.add_argument("--stream-flood", action="store_true", help="A streams its chats")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, metrics = start_mesh(model_folder(args), args, Path(tmp))
        try:
            args.served = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10,
                                    headers={"Authorization": "Bearer key-b"}).json()["data"][0]["id"]
            rows = asyncio.run(run(port, metrics, args))
        finally:
            proc.terminate()
            proc.wait(60)
    return report(table(rows, args), args, rows)


if __name__ == "__main__":
    sys.exit(main())
