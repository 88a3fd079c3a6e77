"""End to end: `kdamesh up --prefill-replicas 2 --decode-replicas 2` on tiny-k3 serves a chat through the official
`openai` client; every replica is its own process on its own ports, listed in the printed endpoints."""

from __future__ import annotations

import json

import openai

from tests.e2e.launched import launch, stop

MESSAGES = [{"role": "user", "content": "Name three rivers of Europe and one city on each of them, briefly."}]


def test_up_with_pools_serves_a_chat(tmp_path):
    launched = launch(tmp_path, "endpoints ", up_flags=["--prefill-replicas", "2", "--decode-replicas", "2"])
    try:
        endpoints = json.loads(launched.line)
        workers = {name: address for name, address in endpoints.items() if name.startswith(("prefill", "decode"))}
        assert set(workers) == {"prefill-0", "prefill-1", "decode-0", "decode-1"}
        assert len(set(workers.values())) == 4
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{launched.port}/v1", api_key="x", max_retries=0,
                               timeout=60)
        first = client.chat.completions.create(model="tiny-k3", messages=MESSAGES, max_tokens=6, temperature=0)
        again = client.chat.completions.create(model="tiny-k3", messages=MESSAGES, max_tokens=6, temperature=0)
        assert first.usage.completion_tokens == 6 and first.choices[0].message == again.choices[0].message
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the repeat finds the prompt cached
    finally:
        stop(launched.proc)
    assert launched.proc.returncode == 0
