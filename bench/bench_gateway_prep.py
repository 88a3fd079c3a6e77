"""A chat's preparation on the gateway: structure hints in two prefix renders vs one render per hinted prefix, same
process, same run (issue 27 point 2).

Usage: `python -m bench.bench_gateway_prep [--preset tiny-k3] [--messages 1000,2000,4000,10000] [--out FILE]`

For chats of `--messages` short alternating user/assistant messages (K3 chat format, the preset's tokenizer), the
CPU seconds of the gateway's whole planning (`ChatPlanner.plan`: render, structure hints, sampling) against the
planning the hints did before (the full render plus one render per hinted prefix: the system block and the last
15 message ends, 17 renders), interleaved, best of `--repeats`, with the cyclic garbage collector paused during
each call (its full collections cost in proportion to everything alive: an interpreter cost, the same for both).
Prints a markdown table; `--out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from bench.common import model_folder, report
from engine.tokenizer import KimiTokenizer
from gateway.chat import ChatFormatError, ChatRenderer
from gateway.config import GatewayConfig
from gateway.plan import ChatPlanner
from gateway.protocol import parse_chat

OLD_PREFIX_RENDERS = 16  # the system block and the last 15 message ends, each rendered on its own


def _chat(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": f"short message {i}"} for i in range(n)]


def _cpu_s(fn) -> float:
    gc.collect()
    gc.disable()
    start = time.process_time()
    try:
        fn()
    finally:
        spent = time.process_time() - start
        gc.enable()
    return spent


def _old_planning(renderer: ChatRenderer, messages: list[dict]) -> None:
    """The render and the per-prefix renders of the hints before this change."""
    renderer.render(messages, None, True)
    for k in [0, *range(max(1, len(messages) - OLD_PREFIX_RENDERS + 1), len(messages))]:
        try:
            renderer.render(messages[:k], None, False)
        except ChatFormatError:  # k = 0 without a system block: nothing to render (skipped then too)
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-k3")
    parser.add_argument("--model", default=None, help="a checkpoint folder instead of the preset's")
    parser.add_argument("--messages", default="1000,2000,4000,10000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    folder = model_folder(args)
    tokenizer = KimiTokenizer.from_pretrained(folder)
    renderer = ChatRenderer.from_pretrained(folder, tokenizer)
    config = GatewayConfig(model=str(folder), decode_addresses=("127.0.0.1:1",), mode="colocated")
    planner = ChatPlanner(renderer, config, lambda: 10**9, None, frozenset(tokenizer.special_tokens.values()))
    rows = []
    for n in (int(x) for x in args.messages.split(",")):
        request = parse_chat({"model": config.model_name, "messages": _chat(n)}, config.served_names)
        new, old = [], []
        for _ in range(args.repeats):  # interleaved
            new.append(_cpu_s(lambda: planner.plan(request)))
            old.append(_cpu_s(lambda: _old_planning(renderer, request.messages)))
        rows.append({"messages": n, "plan_s": min(new), "before_s": min(old), "speedup": min(old) / min(new)})
    lines = ["| messages | planning now (CPU s) | hints as before (CPU s) | speed-up |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['messages']:,} | {r['plan_s']:.3f} | {r['before_s']:.3f} | {r['speedup']:.1f}x |" for r in rows]
    return report("\n".join(lines), args, rows)


if __name__ == "__main__":
    sys.exit(main())
