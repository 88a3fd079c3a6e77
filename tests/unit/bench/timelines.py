"""Synthetic request outcomes for the serving benchmark's tests: `ok(...)`, `failed(...)` and `timeline()`, four
requests with known metrics."""

from __future__ import annotations

from servebench.metrics import RequestOutput


def ok(start, ttft, itl, output_tokens, prompt_len=10, latency=None, text="x"):
    return RequestOutput(generated_text=text, success=True, start_time=start, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl) if latency is None else latency, output_tokens=output_tokens,
                         prompt_len=prompt_len)


def failed(prompt_len=10):
    return RequestOutput(success=False, prompt_len=prompt_len, error="boom")


def timeline() -> list[RequestOutput]:
    """A: 4 tokens (usage), B: a single token, C: failed, D: 3 tokens counted from chunks (no usage)."""
    return [ok(0.0, 0.1, [0.02, 0.03, 0.05], 4, prompt_len=10, latency=0.2),
            ok(0.05, 0.2, [], 1, prompt_len=20, latency=0.2),
            failed(prompt_len=30),
            ok(0.2, 0.3, [0.01, 0.01], 0, prompt_len=40, latency=0.32)]
