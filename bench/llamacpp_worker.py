"""kdamesh's side of bench/llamacpp.py: an `EngineCore` in a worker process of its own, driven by JSON lines.

Contract:
- `KdameshWorker(model_dir, max_num_seqs, max_context, threads, prefix_caching, compilation_config)` starts
  `python -m bench.llamacpp_worker CONFIG`: the worker sets torch's threads to `threads` before it builds its engine
  (a compiled step traces its kernel routing at that count, as a serving worker's does), warms it up (a compiled
  step's bucket of one row is built) and answers `{"pool_bytes", "one_tile_tokens"}`; then `call(op, **kw)` sends
  one command and returns its JSON answer (an error answer raises `RuntimeError`), `close()` -> its peak RSS.
- Ops: `greedy` (the sanity check's tokens and printed bytes), `decode` (batch-1 decode tok/s after the first
  token), `long` (bench/long_context.py: prefill tok/s, decode ms/token, FLOP model), `prefill` (prompt tok/s to the
  first token), `batch` (concurrent prompts: generated tok/s, whole run and decode phase), `memory`.
- `random_prompt(length, seed)`, `run_requests(core, prompts, max_tokens)` are shared with other benches.
stdout carries the answers only (the engine's prints go to stderr).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT_VOCAB = 7900  # random prompt ids below the generated tokenizers' base vocabulary (no specials)
SANITY_PROMPT = "The quick brown fox jumps over the lazy dog. def fibonacci(n):"


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(PROMPT_VOCAB) for _ in range(length)]


class KdameshWorker:
    """An `EngineCore` in its own process; `call(op, **kw)` sends one command and returns its JSON answer."""

    def __init__(self, model_dir: Path, max_num_seqs: int, max_context: int, threads: int,
                 prefix_caching: bool = False, compilation_config: str | None = None):
        config = {"model": str(model_dir), "max_num_seqs": max_num_seqs, "max_context": max_context,
                  "threads": threads, "prefix_caching": prefix_caching, "compilation_config": compilation_config}
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.llamacpp_worker", json.dumps(config)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def call(self, op: str, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the kdamesh worker exited ({self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"kdamesh worker: {answer['error']}")
        return answer

    def close(self) -> dict:
        answer = self.call("memory")
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        return answer


def worker_main(config: dict) -> int:
    """The worker's loop: answers one JSON line per command line (stdout carries answers only)."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr  # the engine's prints must not interleave with the answers
    _threads(config["threads"])  # before the engine: a compiled step's routing is traced at this count
    core = _engine(config)
    answers.write(json.dumps({"pool_bytes": core.plan.kv_bytes + core.plan.state_bytes,
                              "one_tile_tokens": one_tile_tokens(core)}) + "\n")
    answers.flush()
    ops = {"greedy": _greedy, "decode": _decode, "prefill": _prefill, "batch": _batch, "memory": _memory,
           "long": _long}
    for line in sys.stdin:
        command = json.loads(line)
        try:
            answer = ops[command.pop("op")](core, **command)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


def one_tile_tokens(core) -> int:
    """The longest context whose MLA decode gathers one tile (kernels/attention/torch_paged.py): a compiled step
    builds another graph past it."""
    from kernels.attention.torch_paged import ONE_TILE_KEY_ELEMS

    (_, block_size, row), _ = core.runner.block_shape()
    return ONE_TILE_KEY_ELEMS // (block_size * row) * block_size


def _engine(config: dict):
    import torch

    from engine.config import EngineArgs
    from engine.core import EngineCore

    torch.manual_seed(0)
    block = 16
    blocks = config["max_num_seqs"] * math.ceil((config["max_context"] + block) / block)
    caching = config["prefix_caching"]  # one snapshot slot per 1K tokens of context: the prompt end stays cached
    args = EngineArgs(model=config["model"], max_num_seqs=config["max_num_seqs"], block_size=block,
                      num_kv_blocks=blocks, enable_prefix_caching=caching, kv_cache_memory=64 << 30,
                      num_snapshot_slots=config["max_context"] // 1024 + 2 if caching else None,
                      compilation_config=config["compilation_config"])
    core = EngineCore(args)
    run_requests(core, [random_prompt(16, seed=1)], 4)  # warm-up (compiled: the bucket of one row is built)
    return core


_REQUEST_IDS = itertools.count()


def run_requests(core, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True) -> dict:
    """Runs `prompts` to completion; -> the tokens, the start, the moment every request had its first token, the end."""
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    start = time.perf_counter()
    ids = [f"bench-{next(_REQUEST_IDS)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        core.add_request(request_id, {"prompt_token_ids": prompt}, params)
    tokens = {i: [] for i in ids}
    all_first = None
    while core.has_unfinished_requests():
        outs = core.step()
        now = time.perf_counter()
        for out in outs:
            tokens[out.request_id] += out.outputs[0].delta_token_ids if out.outputs else []
        if all_first is None and all(tokens.values()):
            all_first = now
    return {"tokens": [tokens[i] for i in ids], "start": start, "all_first": all_first, "end": time.perf_counter()}


def _threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _greedy(core, prompt_ids: list[int], tokens: int, threads: int) -> dict:
    _threads(threads)
    out = run_requests(core, [prompt_ids], tokens, ignore_eos=False)["tokens"][0]
    if len(out) < tokens and core.tokenizer.is_special(out[-1]):
        out = out[:-1]  # the stop token ended it; llama-simple does not print its end-of-generation token
    return {"ids": out, "bytes_hex": core.tokenizer.decode_bytes(prompt_ids + out).hex(),
            "own_prompt_ids": core.tokenizer.encode(SANITY_PROMPT)}


def _decode(core, prompt_len: int, tokens: int, threads: int, seed: int) -> dict:
    _threads(threads)
    run = run_requests(core, [random_prompt(prompt_len, seed)], tokens + 1)
    seconds = run["end"] - run["all_first"]
    return {"tok_s": tokens / seconds, "ms_per_token": 1e3 * seconds / tokens}


def _long(core, prompt_len: int, tokens: int, threads: int, seed: int) -> dict:
    """One request of a `prompt_len`-token prompt and `tokens` + 1 outputs (bench/long_context.py): prefill tok/s,
    decode ms/token after it, and the FLOP model's matmul FLOPs per prompt token."""
    from bench.bench_engine import prefill_flops

    _threads(threads)
    run = run_requests(core, [random_prompt(prompt_len, seed)], tokens + 1)
    prefill_s, decode_s = run["all_first"] - run["start"], run["end"] - run["all_first"]
    chunk = core.args.max_num_batched_tokens
    return {"prefill_tok_s": prompt_len / prefill_s, "decode_ms": 1e3 * decode_s / tokens,
            "flops_per_prompt_token": prefill_flops(core.model, prompt_len, chunk) / prompt_len}


def _prefill(core, prompt_len: int, threads: int, seed: int) -> dict:
    _threads(threads)
    run = run_requests(core, [random_prompt(prompt_len, seed)], 1)
    return {"tok_s": prompt_len / (run["all_first"] - run["start"])}


def _batch(core, n: int, prompt_len: int, tokens: int, threads: int, seed: int) -> dict:
    _threads(threads)
    run = run_requests(core, [random_prompt(prompt_len, seed + i) for i in range(n)], tokens)
    generated = sum(len(t) for t in run["tokens"])
    return {"gen_tok_s": generated / (run["end"] - run["start"]),
            "decode_tok_s": (generated - n) / (run["end"] - run["all_first"])}


def _memory(core) -> dict:
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "pool_bytes": core.plan.kv_bytes + core.plan.state_bytes}


if __name__ == "__main__":
    sys.exit(worker_main(json.loads(sys.argv[1])))
