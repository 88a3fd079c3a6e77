"""`kdamesh bench serve`: the online serving benchmark of `vllm bench serve` — its flags, metric definitions and
result JSON field names — against any OpenAI-compatible endpoint (a kdamesh gateway or another server).

Modules: `cli` (flags, one run), `datasets` (random / prefix_repetition / custom JSONL prompts), `client` (streamed
httpx requests, SSE parsing, timing), `runner` (arrival schedule, concurrency cap), `metrics` (TTFT, TPOT, ITL, E2EL,
throughput, goodput), `results` (the printed summary and the JSON). `python -m servebench --help` lists the flags.

A package of its own, not part of `bench/`, because the `kdamesh` command line (deploy/) runs it and nothing may
import `bench/`. It imports httpx, numpy and, for local tokenizers and chat formats, the torch-free
`engine.tokenizer` and `gateway.chat`; `bench/` (plots.py) drives it too.
"""

from servebench.cli import add_cli_args, main, run_cli

__all__ = ["add_cli_args", "main", "run_cli"]
