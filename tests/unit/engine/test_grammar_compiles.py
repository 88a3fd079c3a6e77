"""Grammar compiles off the step thread (engine/structured/requests.py `compile_async`, engine/async_engine.py).

- One compile per grammar: concurrent requests for one schema share one future; once compiled, the cache answers
  with a finished future (the same compiled object); another schema is another compile (negative control).
- A grammar slower than `grammar_compile_timeout_s` is an `InvalidRequestError` naming the schema by its title
  (param `response_format`) and the tools by name (param `tools`), while an unconstrained request beside it streams
  to the end; the compile finishes in the background and is cached, so the same schema is then served at once.
(That the others' step time holds while grammars compile is tests/integration/test_worker_heavy_inputs.py's claim.)
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine import AsyncEngine, EngineArgs, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputParams, ToolSpec
from engine.structured.requests import COMPILE_THREADS, ConstrainedRequests
from engine.tokenizer import KimiTokenizer
from tests.unit.engine.conftest import random_prompts

GREEDY = dict(temperature=0, ignore_eos=True)


def many_way(n: int, title: str) -> dict:
    """An n-way anyOf of one-key objects: slow to compile (about 0.5 s at n = 1000 on one core)."""
    return {"title": title, "anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                       "required": [f"k{i}"], "additionalProperties": False} for i in range(n)]}


def small(title: str) -> StructuredOutputParams:
    return StructuredOutputParams("json_schema", json_schema={"title": title, "type": "object",
                                                              "properties": {"a": {"type": "integer"}}})


@pytest.fixture(scope="module")
def slow_schema():
    return StructuredOutputParams("json_schema", json_schema=many_way(1000, "huge"))


def test_one_compile_per_grammar(tiny_k3_dir):
    constrained = ConstrainedRequests(KimiTokenizer.from_pretrained(tiny_k3_dir), 8192)
    gate = threading.Event()
    blockers = [constrained._executor.submit(gate.wait, 30) for _ in range(COMPILE_THREADS)]
    try:  # the compile waits behind the blockers, so it is still in progress when the second request asks
        first, second = constrained.compile_async(small("a")), constrained.compile_async(small("a"))
        assert first is second  # one compile in progress serves both
        gate.set()
        assert all(b.result(timeout=30) for b in blockers)
        compiled = first.result(timeout=60)
        again = constrained.compile_async(small("a"))
        assert again.done() and again.result() is compiled and constrained.backend().is_cached(small("a"))
        other = constrained.compile_async(small("b"))  # negative control: another schema compiles anew
        assert other is not first and other.result(timeout=60) is not compiled
    finally:
        gate.set()
        constrained.close()


async def _collect(engine, request_id, prompt, params):
    return [out async for out in engine.generate(request_id, {"prompt_token_ids": prompt}, params)]


def test_a_slow_grammar_is_a_400_naming_it_and_others_keep_stepping(tiny_k3_dir, slow_schema):
    args = EngineArgs(model=str(tiny_k3_dir), kv_cache_memory=4 << 20, max_num_seqs=8,
                      grammar_compile_timeout_s=0.05)
    prompt = random_prompts(1, 8, 9, seed=5)[0]
    tools = StructuredOutputParams("tool_call", tools=(ToolSpec("lookup", {"type": "object", "properties": {
                                                           "q": many_way(500, "q")}}),
                                                       ToolSpec("pick", {"type": "object", "properties": {
                                                           f"p{i}": {"enum": list(range(200))}
                                                           for i in range(40)}})),
                                   output_format="kimi_k3")

    async def main():
        async with await AsyncEngine.create(args) as engine:
            await engine.warm_up()
            plain = asyncio.create_task(_collect(engine, "plain", prompt, SamplingParams(max_tokens=40, **GREEDY)))
            with pytest.raises(InvalidRequestError) as slow:
                await _collect(engine, "slow", prompt, SamplingParams(max_tokens=4, structured=slow_schema, **GREEDY))
            with pytest.raises(InvalidRequestError) as slow_tools:
                await _collect(engine, "tools", prompt, SamplingParams(max_tokens=4, structured=tools, **GREEDY))
            outs = await plain
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 40
            for _ in range(600):  # the compile goes on in the background and lands in the cache
                if engine.core.constrained.backend().is_cached(slow_schema):
                    break
                await asyncio.sleep(0.1)
            served = await _collect(engine, "again", prompt,
                                    SamplingParams(max_tokens=4, structured=slow_schema, **GREEDY))
            return slow.value, slow_tools.value, served

    slow, slow_tools, served = asyncio.run(main())
    assert "'huge'" in str(slow) and "did not compile within 0.05 s" in str(slow) and slow.param == "response_format"
    assert "'lookup'" in str(slow_tools) and "'pick'" in str(slow_tools) and slow_tools.param == "tools"
    assert served[-1].finished and len(served[-1].outputs[0].token_ids) == 4  # cached: no deadline to miss
