"""`kdamesh bench serve`'s client side without a server: SSE parsing, the streamed request functions (against an
in-process httpx transport) and the runner's concurrency cap."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from servebench.client import (REQUEST_FUNCS, RequestInput, SSEDecoder, request_chat_completions,
                               request_completions, request_func_for)
from servebench.runner import RunConfig, run_requests
from tests.unit.bench.timelines import ok


def test_sse_decoder_handles_any_split():
    stream = ('data: {"a": 1}\n\n: ping\n\ndata: {"b": "é"}\r\n\r\ndata: line1\ndata: line2\n\n'
              'event: x\ndata:[DONE]').encode()
    expected = ['{"a": 1}', '{"b": "é"}', "line1\nline2", "[DONE]"]
    for size in (1, 2, 3, 7, len(stream)):
        decoder = SSEDecoder()
        events = []
        for i in range(0, len(stream), size):
            events += decoder.feed(stream[i:i + size])
        events += decoder.flush()
        assert events == expected, size


def _sse(*messages) -> list[bytes]:
    return [f"data: {json.dumps(m) if not isinstance(m, str) else m}\n\n".encode() for m in messages]


def _client(chunks: list[bytes], status: int = 200, delay_s: float = 0.0, seen: list | None = None):
    async def body():
        for c in chunks:
            if delay_s:
                await asyncio.sleep(delay_s)
            yield c

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "no such model"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _completion(text, finish=None):
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                                  "prompt_tokens_details": {"cached_tokens": 5}}}


def _run(coro):
    return asyncio.run(coro)


def test_completions_request_is_timed_per_chunk():
    chunks = _sse(_completion("a"), _completion("bc"), _completion("d", "length"), USAGE, "[DONE]")
    seen: list = []

    async def go():
        async with _client(chunks, delay_s=0.02, seen=seen) as client:
            inp = RequestInput(prompt=[1, 2, 3], api_url="http://x/v1/completions", prompt_len=3, output_len=4,
                               model="m", ignore_eos=True, extra_body={"temperature": 0})
            return await request_completions(inp, client)

    out = _run(go())
    assert out.success and out.error == ""
    assert out.generated_text == "abcd"
    assert len(out.itl) == 2  # three choice chunks; the usage chunk is not a token
    assert out.ttft >= 0.015 and all(gap >= 0.015 for gap in out.itl)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    assert (out.output_tokens, out.prompt_len, out.cached_tokens) == (4, 7, 5)
    body = seen[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["model"] == "m"


def test_chat_request_reads_deltas():
    def chat(delta):
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    chunks = _sse(chat({"role": "assistant", "content": ""}), chat({"reasoning_content": "hm "}),
                  chat({"content": "hi"}), USAGE, "[DONE]")
    seen: list = []

    async def go():
        async with _client(chunks, seen=seen) as client:
            inp = RequestInput(prompt="hello", api_url="http://x/v1/chat/completions", prompt_len=3, output_len=4,
                               model="m", model_name="served")
            return await request_chat_completions(inp, client)

    out = _run(go())
    assert out.success and out.generated_text == "hm hi" and len(out.itl) == 2 and out.output_tokens == 4
    assert seen[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert seen[0]["max_completion_tokens"] == 4 and seen[0]["model"] == "served"


@pytest.mark.parametrize("chunks, status, reason", [
    ([], 404, "HTTP 404"),
    (_sse(_completion("a"), {"error": {"message": "deadline exceeded", "code": 504}}, "[DONE]"), 200,
     "deadline exceeded"),
    (_sse(USAGE, "[DONE]"), 200, "Never received a valid chunk"),
    ([b"data: {not json\n\n"], 200, "JSONDecodeError"),
])
def test_failed_requests_carry_the_reason(chunks, status, reason):
    async def go():
        async with _client(chunks, status=status) as client:
            inp = RequestInput(prompt="p", api_url="http://x/v1/completions", prompt_len=1, output_len=2, model="m")
            return await request_completions(inp, client)

    out = _run(go())
    assert not out.success and reason in out.error


def test_backend_and_endpoint_choose_the_request_function():
    assert request_func_for("openai", "/v1/completions") is request_completions
    assert request_func_for("vllm", "/v1/completions") is request_completions
    assert request_func_for("openai-chat", "/v1/chat/completions") is request_chat_completions
    assert request_func_for("openai", "/v1/chat/completions") is request_chat_completions
    assert set(REQUEST_FUNCS) == {"openai", "openai-chat", "vllm"}
    with pytest.raises(ValueError):
        request_func_for("tgi", "/generate")


def test_runner_caps_concurrency_and_keeps_order():
    """Four requests at rate inf with --max-concurrency 2: never more than two in flight; outputs in request order."""
    in_flight = {"now": 0, "peak": 0}

    async def fake(inp, client):
        started = time.perf_counter()
        in_flight["now"] += 1
        in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
        await asyncio.sleep(0.02)
        in_flight["now"] -= 1
        return ok(started, 0.01, [0.01], 2, text=inp.request_id)

    from servebench.datasets import SampleRequest

    requests = [SampleRequest("p", 1, 2, f"r{i}") for i in range(4)]
    config = RunConfig(api_url="http://x/v1/completions", model_id="m", model_name=None, request_func=fake,
                       max_concurrency=2, num_warmups=1, log=lambda s: None)
    result = _run(run_requests(config, requests, client=None))
    assert in_flight["peak"] == 2
    assert [o.generated_text for o in result.outputs] == ["r0", "r1", "r2", "r3"]
    assert result.duration >= 0.04  # two waves
    assert max(o.client_queue_time for o in result.outputs) > 0.01  # the second wave waited for a slot
