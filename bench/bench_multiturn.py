"""Multi-turn chat through the mesh: how much of each turn's prompt the prefix cache serves, and the TTFT per turn.

Usage: `python -m bench.bench_multiturn [--preset tiny-k3 | --model DIR | --url http://HOST:PORT] [--conversations 8]
[--turns 6] [--max-tokens 16] [--system-rules 24] [--mode disaggregated] [--out FILE]`

Without `--url` it starts `kdamesh up` (cache, prefill, decode, gateway on free ports; the generated `--preset`
checkpoint unless `--model`) and stops it at the end. `--conversations` chats run at once, each `--turns` turns
through `/v1/chat/completions` (streamed, greedy, `stream_options.include_usage`): every chat starts with the same
system prompt (`--system-rules` sentences, a few hundred tokens) and a user message of its own, and each next turn
appends the assistant's answer and a new user message. Per turn the table shows, averaged over the conversations:
prompt tokens, `cached_tokens` (usage.prompt_tokens_details), the hit rate over the whole prompt, the hit rate over
the previous turns' tokens (cached / (previous turn's prompt + completion tokens), what the cache could serve; turn
1: over its own prompt, of which the other conversations share the system prompt), and TTFT (ms, mean and max; from sending the request to the first streamed content). With tiny-k3 on 2 CPU cores the
whole run takes about a minute. `--out` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import model_folder, report
from deploy.launcher import free_port

USER_TOPICS = ("the lighthouse", "the harbour", "the old mill", "the river ferry", "the market square",
               "the northern cape", "the fishing fleet", "the bell tower")


@dataclass
class Turn:
    """One request of one conversation."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float
    text: str


def system_prompt(rules: int) -> str:
    return " ".join(f"Rule {i}: answer politely and cite the harbour log entry {i * 7}." for i in range(rules))


def user_message(conversation: int, turn: int) -> str:
    topic = USER_TOPICS[conversation % len(USER_TOPICS)]
    return f"Question {turn + 1} of visitor {conversation}: tell me one more fact about {topic}."


async def one_turn(http: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> Turn:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, parts, usage = time.perf_counter(), None, [], {}
    async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if ttft is None and (piece or delta.get("role") is None):
                    ttft = time.perf_counter() - start
                parts.append(delta.get("content") or "")
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return Turn(usage.get("prompt_tokens", 0), details.get("cached_tokens") or 0, usage.get("completion_tokens", 0),
                ttft if ttft is not None else time.perf_counter() - start, "".join(parts))


async def conversation(http: httpx.AsyncClient, model: str, index: int, args: argparse.Namespace) -> list[Turn]:
    messages = [{"role": "system", "content": system_prompt(args.system_rules)}]
    turns: list[Turn] = []
    for t in range(args.turns):
        messages.append({"role": "user", "content": user_message(index, t)})
        turn = await one_turn(http, model, messages, args.max_tokens)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.text or "I see."})
    return turns


def turn_rows(chats: list[list[Turn]]) -> list[dict]:
    """One row per turn, averaged over the conversations."""
    rows = []
    for t in range(len(chats[0])):
        turns = [chat[t] for chat in chats]
        previous = [chat[t - 1].prompt_tokens + chat[t - 1].completion_tokens if t else chat[0].prompt_tokens
                    for chat in chats]
        cached = sum(x.cached_tokens for x in turns)
        rows.append({"turn": t + 1, "prompt_tokens": statistics.mean(x.prompt_tokens for x in turns),
                     "cached_tokens": statistics.mean(x.cached_tokens for x in turns),
                     "hit_rate": cached / max(1, sum(x.prompt_tokens for x in turns)),
                     "hit_rate_previous": cached / max(1, sum(previous)),
                     "ttft_ms_mean": 1000 * statistics.mean(x.ttft_s for x in turns),
                     "ttft_ms_max": 1000 * max(x.ttft_s for x in turns)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| turn | prompt tokens | cached tokens | hit rate (prompt) | hit rate (previous turns) | TTFT mean ms | "
             "TTFT max ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | {r['hit_rate']:.1%} | "
                     f"{r['hit_rate_previous']:.1%} | {r['ttft_ms_mean']:.1f} | {r['ttft_ms_max']:.1f} |")
    return "\n".join(lines)


async def run(base_url: str, model: str, args: argparse.Namespace) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        chats = await asyncio.gather(*(conversation(http, model, i, args) for i in range(args.conversations)))
    return turn_rows(list(chats))


def start_mesh(model: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`kdamesh up` on free ports; returns the process and the gateway's base URL once /health answers."""
    port = free_port()
    cmd = [sys.executable, "-m", "deploy.cli", "--log-level", "warning", "up", "--model", str(model), "--port",
           str(port), "--mode", args.mode, "--no-restart", "--torch-threads", str(args.threads)]
    proc = subprocess.Popen(cmd)
    base_url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kdamesh up exited with {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return proc, base_url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    raise RuntimeError("kdamesh up did not become ready within 600 s")


def served_model(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/models", timeout=10).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_multiturn", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny-k3")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the preset, generated once)")
    parser.add_argument("--url", default=None, help="an already running gateway (nothing is started)")
    parser.add_argument("--mode", default="disaggregated", choices=["disaggregated", "colocated"])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--system-rules", type=int, default=24, help="sentences in the shared system prompt")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args(argv)
    proc = None
    if args.url is None:
        proc, base_url = start_mesh(model_folder(args), args)
    else:
        base_url = args.url.rstrip("/")
    try:
        rows = asyncio.run(run(base_url, served_model(base_url), args))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return report(table(rows), args, rows)


if __name__ == "__main__":
    sys.exit(main())
