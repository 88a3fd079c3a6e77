"""Structure hints (gateway/hints.py): the prefix renders of K3 and K2 chats are prefixes of the full render, the
hints are their lengths; the client's `kdamesh_snapshot_hints` are range-checked; the mesh client sends the hints to
both prefill and decode."""

from __future__ import annotations

import asyncio

import pytest

from gateway.chat import ChatRenderer, k2_chat_template
from gateway.config import GatewayConfig
from gateway.hints import structure_hints
from gateway.mesh_client import MeshClient, MeshRequest
from gateway.plan import ChatPlanner
from gateway.protocol import ApiError, parse_chat, parse_completion
from protos import common_pb2, decode_pb2, prefill_pb2

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CHAT = [
    {"role": "system", "content": "You are a helpful assistant. " * 8},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "Let me think about Paris."},
    {"role": "user", "content": "And in Berlin?"},
    {"role": "assistant", "content": "Berlin is cloudy."},
    {"role": "user", "content": "Thanks, and Rome?"},
]


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear"])
def renderer(request, k3_tok, k2_tok) -> ChatRenderer:
    if request.param == "kimi_k3":
        return ChatRenderer("kimi_k3", k3_tok)
    return ChatRenderer("kimi_linear", k2_tok, k2_chat_template())


def _specials(renderer) -> frozenset[int]:
    return frozenset(renderer._impl._tokenizer.special_tokens.values())


def test_hints_are_the_prefix_render_lengths_and_valid_prefixes(renderer):
    full = renderer.render(CHAT, TOOLS, True).token_ids
    expected = []
    for k in range(1, len(CHAT)):  # the system block (k=1) and every message but the last
        prefix = renderer.render(CHAT[:k], TOOLS, False).token_ids
        assert full[:len(prefix)] == prefix, f"{renderer.family}: render(messages[:{k}]) is not a prefix"
        expected.append(len(prefix))
    assert structure_hints(renderer, CHAT, TOOLS, None, full, _specials(renderer)) == tuple(sorted(set(expected)))
    # without the special ids only the two rendered ends are known: the system block and messages[:-1]
    assert structure_hints(renderer, CHAT, TOOLS, None, full) == (expected[0], expected[-1])
    assert len(expected) == 5 and expected == sorted(expected) and expected[-1] < len(full)


def test_system_block_without_system_message_and_long_chats_are_bounded(renderer):
    chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(41)]
    full = renderer.render(chat, None, True).token_ids
    hints = structure_hints(renderer, chat, None, None, full, _specials(renderer))
    assert len(hints) == 16
    expected = [len(renderer.render(chat[:k], None, False).token_ids) for k in range(25, 41)]
    assert list(hints) == expected  # the last 16 message ends


def _render_calls(renderer, chat) -> int:
    calls = 0
    original = renderer.render

    def counting(*args, **kwargs):
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    renderer.render = counting
    try:
        structure_hints(renderer, chat, None, None, original(chat, None, True).token_ids, _specials(renderer))
    finally:
        del renderer.render
    return calls


def test_hints_cost_two_renders_whatever_the_number_of_messages(renderer):
    """Linear in the chat: two prefix renders (the system block, messages[:-1]) for 3 or 300 messages."""
    short = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(3)]
    long = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(301)]
    assert _render_calls(renderer, short) == _render_calls(renderer, long) == 2


def test_a_hint_is_dropped_where_the_prompt_differs(renderer):
    full = renderer.render(CHAT, TOOLS, True).token_ids
    other = list(full)
    other[3] = (other[3] + 1) % 100
    assert structure_hints(renderer, CHAT, TOOLS, None, other, _specials(renderer)) == ()


def _planner(renderer) -> ChatPlanner:
    return ChatPlanner(renderer, GatewayConfig(model="m", decode_addresses=("127.0.0.1:1",), mode="colocated"), max_model_len=lambda: 100_000)


def test_plan_merges_client_hints_and_refuses_bad_ones(renderer):
    planner = _planner(renderer)
    body = {"model": "m", "messages": CHAT}
    plan = planner.plan(parse_chat({**body, "kdamesh_snapshot_hints": [5, 5, 2]}, {"m"}))
    auto = structure_hints(renderer, CHAT, None, None, plan.prompt_ids)
    assert plan.snapshot_hints == tuple(sorted({2, 5, *auto}))
    for bad in ([-1], [len(plan.prompt_ids) + 1]):
        with pytest.raises(ApiError) as err:
            planner.plan(parse_chat({**body, "kdamesh_snapshot_hints": bad}, {"m"}))
        assert (err.value.status, err.value.param, err.value.type) == (400, "kdamesh_snapshot_hints",
                                                                       "invalid_request_error")
    for bad in (["3"], 3, [1.5], [True]):
        with pytest.raises(ApiError) as err:
            parse_chat({**body, "kdamesh_snapshot_hints": bad}, {"m"})
        assert (err.value.status, err.value.param) == (400, "kdamesh_snapshot_hints")


def test_completion_hints_are_checked_against_every_prompt(k3_tok):
    job = parse_completion({"model": "m", "prompt": [[1, 2, 3, 4]], "kdamesh_snapshot_hints": [4, 0, 2]},
                           k3_tok, {"m"})
    assert job.snapshot_hints == (0, 2, 4)
    assert parse_completion({"model": "m", "prompt": "hi"}, k3_tok, {"m"}).snapshot_hints == ()
    cases = [([[1, 2, 3, 4]], [5]), ([[1, 2, 3, 4]], [-1]), ([[1, 2, 3, 4]], ["1"]), ([[1, 2, 3, 4], [1, 2]], [3])]
    for prompt, bad in cases:
        with pytest.raises(ApiError) as err:
            parse_completion({"model": "m", "prompt": prompt, "kdamesh_snapshot_hints": bad}, k3_tok, {"m"})
        assert (err.value.status, err.value.param) == (400, "kdamesh_snapshot_hints")


class _FakePrefill:
    def __init__(self):
        self.requests: list = []

    async def Prefill(self, request, timeout=None):  # noqa: N802 (the gRPC method name)
        self.requests.append(request)
        return prefill_pb2.PrefillResponse(request_id=request.generation.request_id, first_token_id=7,
                                           handoff_key=common_pb2.ObjectKey(), prompt_tokens=4)


class _FakeCall:
    def __init__(self, chunks):
        self._chunks = list(chunks)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)

    def cancel(self):
        pass


class _FakeDecode:
    def __init__(self):
        self.requests: list = []

    def Decode(self, request, timeout=None):  # noqa: N802
        self.requests.append(request)
        return _FakeCall([decode_pb2.DecodeChunk(index=0, token_ids=[7],
                                                 finish_reason=common_pb2.FINISH_REASON_LENGTH)])


@pytest.mark.parametrize("route", ["remote", "local"])
def test_mesh_client_copies_hints_into_prefill_and_decode(route):
    async def run():
        client = MeshClient(["127.0.0.1:1"], ["127.0.0.1:2"])
        prefill, decode = _FakePrefill(), _FakeDecode()
        client.prefillers["127.0.0.1:2"].stub = prefill
        client.decoders["127.0.0.1:1"].stub = decode

        def pick(*_args):
            return route

        client._route = pick
        request = MeshRequest(request_id="r", prompt_token_ids=(1, 2, 3, 4), sampling=common_pb2.SamplingParams(),
                              snapshot_hints=(2, 4))
        events = [e async for e in client.generate(request)]
        await client.close()
        return events, prefill.requests, decode.requests

    events, prefills, decodes = asyncio.run(run())
    assert events and [list(r.generation.snapshot_hints) for r in decodes] == [[2, 4]]
    assert [list(r.generation.snapshot_hints) for r in prefills] == ([[2, 4]] if route == "remote" else [])
    if route == "remote":  # one request, sent alike to both workers
        assert prefills[0].generation == decodes[0].generation


def test_hints_shift_past_expanded_image_pads():
    from types import SimpleNamespace

    from gateway.hints import shift_past_media
    # rendered prompt: pads at 5 and 8; expanded to 4 and 2 rows -> offsets 5 and 8 + 3 = 11 in the mesh's prompt
    media = [SimpleNamespace(token_offset=11, num_tokens=2), SimpleNamespace(token_offset=5, num_tokens=4)]
    assert shift_past_media((3, 5, 6, 8, 9, 12), media) == (3, 5, 9, 11, 13, 16)
    assert shift_past_media((3, 9), []) == (3, 9)
