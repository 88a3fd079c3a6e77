"""gateway/output_blocks.py: parser deltas → blocks (what the Responses and Messages APIs stream), with the real K3
output parser feeding it; and the Responses store's bound and tenancy (gateway/responses/store.py)."""

from __future__ import annotations

import pytest

from gateway.output_blocks import REASONING, TEXT, TOOL_CALL, BlockSplitter
from gateway.parsers import DeltaMessage, ToolCallDelta, build_output_parser, fold
from gateway.responses.store import ResponseStore
from tests.unit.gateway.test_parsers import Plan, k3_output


def _run(deltas):
    splitter = BlockSplitter()
    events = [e for d in deltas for e in splitter.feed(d)] + splitter.close()
    return splitter, [(e.type, e.block.index, e.delta) for e in events]


def test_kinds_open_and_close_blocks_in_order():
    splitter, events = _run([
        DeltaMessage(reasoning="let me "), DeltaMessage(reasoning="think"), DeltaMessage(content=""),
        DeltaMessage(content="Hello"),
        DeltaMessage(tool_calls=(ToolCallDelta(0, id="call_a", name="f", arguments=""),)),
        DeltaMessage(tool_calls=(ToolCallDelta(0, arguments='{"x": 1}'),)),
        DeltaMessage(tool_calls=(ToolCallDelta(1, id="call_b", name="g", arguments=""),)),
        DeltaMessage(tool_calls=(ToolCallDelta(1, arguments="{}"),))])
    assert events == [("start", 0, ""), ("delta", 0, "let me "), ("delta", 0, "think"), ("stop", 0, ""),
                      ("start", 1, ""), ("delta", 1, "Hello"), ("stop", 1, ""),
                      ("start", 2, ""), ("delta", 2, '{"x": 1}'), ("stop", 2, ""),
                      ("start", 3, ""), ("delta", 3, "{}"), ("stop", 3, "")]
    kinds = [(b.kind, b.text, b.call_id, b.name) for b in splitter.blocks]
    assert kinds == [(REASONING, "let me think", None, None), (TEXT, "Hello", None, None),
                     (TOOL_CALL, '{"x": 1}', "call_a", "f"), (TOOL_CALL, "{}", "call_b", "g")]


def test_blocks_hold_what_the_parser_folds_however_the_text_is_split():
    text = k3_output(Plan("weighing it", "Sunny.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "C"})]),
                     reopen=True)
    parser = build_output_parser("kimi_k3", "kimi_k3")
    whole = parser.parse(text)
    assert whole.reasoning and whole.content and whole.tool_calls  # the text exercises all three kinds
    for size in (1, 3, 7, len(text)):
        stream = parser.stream()
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i:i + size])] + stream.finish()
        splitter, _ = _run(deltas)
        folded = fold(deltas)
        assert "".join(b.text for b in splitter.blocks if b.kind == REASONING) == folded.reasoning
        assert "".join(b.text for b in splitter.blocks if b.kind == TEXT) == folded.content
        calls = [(b.name, b.text) for b in splitter.blocks if b.kind == TOOL_CALL]
        assert calls == [(c.name, c.arguments) for c in folded.tool_calls] == [
            (c.name, c.arguments) for c in whole.tool_calls]


def test_the_store_is_bounded_and_per_tenant():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put("alpha", {"id": name}, [{"role": "user", "content": name}])
    assert store.get("alpha", "a").conversation == [{"role": "user", "content": "a"}]  # "a" is now the newest
    store.put("alpha", {"id": "c"}, [])
    assert len(store) == 2 and store.get("alpha", "b") is None  # the least recently used went
    assert store.get("beta", "a") is None and not store.delete("beta", "a")  # another tenant sees nothing
    kept = store.get("alpha", "a")
    kept.body["id"] = "changed"  # a copy: the stored response does not change
    assert store.get("alpha", "a").body == {"id": "a"}
    assert store.delete("alpha", "a") and store.get("alpha", "a") is None
    off = ResponseStore(0)
    off.put("alpha", {"id": "x"}, [])
    assert not off.enabled and off.get("alpha", "x") is None
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_the_store_is_bounded_in_bytes():
    image = "data:image/png;base64," + "A" * 1000  # conversations may hold images
    store = ResponseStore(100, max_bytes=2500)
    assert store.put("t", {"id": "a"}, [{"role": "user", "content": image}])
    assert store.put("t", {"id": "b"}, [{"role": "user", "content": image}])
    assert store.put("t", {"id": "c"}, [{"role": "user", "content": image}])  # "a" goes to make room
    assert store.get("t", "a") is None and store.get("t", "b") and store.bytes <= 2500
    assert not store.put("t", {"id": "huge"}, [{"role": "user", "content": image * 3}])  # alone over the budget
    assert store.get("t", "huge") is None
    store.put("t", {"id": "b"}, [])  # replacing an entry frees its bytes
    assert store.delete("t", "b") and store.delete("t", "c") and store.bytes == 0 and len(store) == 0
