"""Bad input never makes a 500: a table of malformed requests to every endpoint, each answered with the right
status and the OpenAI error envelope (and, where it applies, the offending field as `param`)."""

from __future__ import annotations

import asyncio

import httpx

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.core import GatewayCore
from tests.integration.gateway_harness import checkpoint_fixture
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**fields):
    return {"model": MODEL, "messages": MSG, **fields}


# (endpoint, body (bytes: raw), status, param or None)
CASES = [
    ("/v1/chat/completions", b" " * (33 << 20), 413, None),  # over MAX_REQUEST_BYTES (32 MiB)
    ("/v1/completions", b"[" * (33 << 20), 413, None),
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"\xff\xfe", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", [1, 2], 400, None),
    ("/v1/chat/completions", "just a string", 400, None),
    ("/v1/chat/completions", {"messages": MSG}, 400, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": 7, "messages": MSG}, 400, "model"),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": MSG}, 404, "model"),
    ("/v1/chat/completions", chat(messages=[]), 400, "messages"),
    ("/v1/chat/completions", chat(messages="hi"), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user"}]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "video"}]}]), 400, "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "tool", "content": "x", "tool_call_id": "nope"}]), 400,
     "messages"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400, "messages"),
    ("/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_tokens="many"), 400, "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=-3), 400, "max_completion_tokens"),
    ("/v1/chat/completions", chat(max_tokens=10 ** 7), 400, "messages"),
    ("/v1/chat/completions", chat(temperature="hot"), 400, "temperature"),
    ("/v1/chat/completions", chat(temperature=-0.5), 400, "temperature"),
    ("/v1/chat/completions", chat(top_p=0), 400, "top_p"),
    ("/v1/chat/completions", chat(top_p=1.5), 400, "top_p"),
    ("/v1/chat/completions", chat(top_k=-7), 400, "top_k"),
    ("/v1/chat/completions", chat(min_p=2), 400, "min_p"),
    ("/v1/chat/completions", chat(presence_penalty=5), 400, "presence_penalty"),
    ("/v1/chat/completions", chat(frequency_penalty=-9), 400, "frequency_penalty"),
    ("/v1/chat/completions", chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("/v1/chat/completions", chat(n=0), 400, "n"),
    ("/v1/chat/completions", chat(n=1000), 400, "n"),
    ("/v1/chat/completions", chat(seed="x"), 400, "seed"),
    ("/v1/chat/completions", chat(seed=2 ** 70), 400, "seed"),
    ("/v1/chat/completions", chat(stop=[""]), 400, "stop"),
    ("/v1/chat/completions", chat(stop=5), 400, "stop"),
    ("/v1/chat/completions", chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("/v1/chat/completions", chat(stop_token_ids=[10 ** 8]), 400, None),
    ("/v1/chat/completions", chat(stream="yes please"), 400, "stream"),
    ("/v1/chat/completions", chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(top_logprobs=3), 400, "top_logprobs"),
    ("/v1/chat/completions", chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    ("/v1/chat/completions", chat(priority="high"), 400, "priority"),
    ("/v1/chat/completions", chat(user=["x"]), 400, "user"),
    ("/v1/chat/completions", chat(chat_template_kwargs="thinking"), 400, "chat_template_kwargs"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"thinking": "maybe"}), 400, "chat_template_kwargs"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"thinking_effort": "extreme"}), 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"unknown": 1}), 400, "chat_template_kwargs"),
    ("/v1/chat/completions", chat(tools="f"), 400, "tools"),
    ("/v1/chat/completions", chat(tools=[{"type": "retrieval"}]), 400, "tools"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "tools"),
    ("/v1/chat/completions", chat(tools=[TOOL, TOOL]), 400, "tools"),
    ("/v1/chat/completions", chat(tool_choice="required"), 400, "tool_choice"),
    ("/v1/chat/completions", chat(tools=[TOOL], tool_choice="sometimes"), 400, "tool_choice"),
    ("/v1/chat/completions", chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     "tool_choice"),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}}}}],
        tool_choice="required"), 400, None),
    ("/v1/chat/completions", chat(response_format={"type": "yaml"}), 400, "response_format"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema"}), 400, "response_format"),
    ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {"schema": "x"}}), 400,
     "response_format"),
    ("/v1/chat/completions", chat(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"99999999": 1}), 400, None),  # beyond the vocabulary: the workers' 400
    ("/v1/chat/completions", chat(continue_final_message=True), 400, "continue_final_message"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny-k3", "prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("/v1/chat/completions", b'{"model": "tiny-k3", "messages": [{"role": "user", "content": "x"}], '
                             b'"top_p": NaN}', 400, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10 ** 7}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": MSG}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "x"}]}, 400, "messages"),
    ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [10 ** 9]}, 400, "tokens"),
    ("/v1/nothing-here", {}, 404, None),
]


tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def test_malformed_requests_get_4xx_in_the_openai_envelope(tiny_k3):
    assert len(CASES) >= 30

    async def main():
        async with Mesh(tiny_k3, engine={"max_model_len": 512}) as mesh:
            config = GatewayConfig(model=str(tiny_k3), decode_addresses=(mesh.decode_address,),
                                   prefill_addresses=(mesh.prefill_address,), pd_min_uncached_tokens=0,
                                   tool_call_parser="kimi_k3", reasoning_parser="kimi_k3",
                                   enable_auto_tool_choice=True)
            core = GatewayCore(config)
            await core.start()
            # raise_app_exceptions: a bug that escapes as a 500 fails the test loudly
            transport = httpx.ASGITransport(app=create_app(config, core=core))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as http:
                failures = []
                for path, body, status, param in CASES:
                    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
                    reply = await http.post(path, headers={"content-type": "application/json"}, **kwargs)
                    error = reply.json().get("error") if reply.headers["content-type"].startswith(
                        "application/json") else None
                    if reply.status_code != status or not isinstance(error, dict) or \
                            set(error) != {"message", "type", "param", "code"} or not error["message"] or \
                            (param is not None and error["param"] != param):
                        failures.append((path, body, reply.status_code, reply.text[:300]))
                assert not failures, "\n".join(map(str, failures))
                # One request past the worker's own context limit (512 < the model's): 400 from the mesh.
                reply = await http.post("/v1/chat/completions", json=chat(max_tokens=500))
                assert reply.status_code == 400 and reply.json()["error"]["code"] == "context_length_exceeded"
                # And a good request still works afterwards.
                assert (await http.post("/v1/chat/completions", json=chat(max_tokens=2))).status_code == 200
            await core.close()

    asyncio.run(main())


def test_auto_tool_choice_needs_the_flag(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, with_prefill=False) as mesh:
            config = GatewayConfig(model=str(tiny_k3), decode_addresses=(mesh.decode_address,), mode="colocated")
            core = GatewayCore(config)
            await core.start()
            transport = httpx.ASGITransport(app=create_app(config, core=core))
            async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=30) as http:
                reply = await http.post("/v1/chat/completions", json=chat(tools=[TOOL], max_tokens=2))
                assert reply.status_code == 400 and "--enable-auto-tool-choice" in reply.json()["error"]["message"]
                # Without parsers the text is the content, special tokens skipped.
                plain = (await http.post("/v1/chat/completions", json=chat(max_tokens=4))).json()
                assert "<|" not in plain["choices"][0]["message"]["content"]
                assert "reasoning_content" not in plain["choices"][0]["message"]
                # A forced call still works (the model family's parser reads it back).
                forced = await http.post("/v1/chat/completions", json=chat(
                    tools=[TOOL], tool_choice="required", max_tokens=120))
                assert forced.status_code == 200
                assert forced.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
            await core.close()

    asyncio.run(main())
