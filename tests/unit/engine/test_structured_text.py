"""The `text` structured output (OpenAI `tool_choice: "none"` with tools declared): a message of free text in the
family's syntax that can never open a tool block, ends within max_tokens (steered) and holds no control marker in
its reasoning or content — on random-weight tiny checkpoints, sampled at temperature 1."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputParams
from gateway.parsers import build_output_parser

FAMILY = {"k3": "kimi_k3", "linear": "kimi_k2"}
MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "<|tool_calls_section_begin|>",
           "<|tool_call_begin|>", "<|im_end|>", "<think>", "</think>")


@pytest.fixture(scope="module")
def llms(tiny_k3_dir, tiny_linear_dir):
    args = dict(kv_cache_memory=16 << 20, max_num_seqs=8, enable_prefix_caching=False)
    return {"k3": LLM(tiny_k3_dir, **args), "linear": LLM(tiny_linear_dir, **args)}


def _text_params(model: str) -> StructuredOutputParams:
    return StructuredOutputParams("text", output_format=FAMILY[model], starts_in_reasoning=True,
                                  max_reasoning_tokens=None)


@pytest.mark.parametrize("model", ["k3", "linear"])
@pytest.mark.parametrize("max_tokens", [24, 64])
def test_text_message_never_opens_tools_and_ends_within_budget(llms, model, max_tokens):
    llm = llms[model]
    prompts = [{"prompt_token_ids": llm.tokenizer.encode(f"Request {i}: say something.")} for i in range(6)]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=11, structured=_text_params(model),
                            skip_special_tokens=False)
    for out in (o.outputs[0] for o in llm.generate(prompts, params, check_integrity=True)):
        assert len(out.token_ids) <= max_tokens
        parsed = build_output_parser(FAMILY[model], FAMILY[model], start_in_reasoning=True,
                                     skip_special_tokens=False).parse(out.text)
        assert not parsed.tool_calls
        for part in (parsed.reasoning or "", parsed.content or ""):
            assert not any(marker in part for marker in MARKERS), out.text
        if model == "k3":  # the message is closed (steered within the budget) and the stop token ends it
            assert out.finish_reason == "stop" and "<|close|>message<|sep|>" in out.text, out.text
    assert llm.engine.constrained.count == 0


def test_text_mask_forbids_markers_a_free_row_allows(llms):
    """Inside the K3 response only text and `<|close|>` are allowed: `<|open|>` (a tools block) is not — while an
    unconstrained row of the same batch allows it (the negative control)."""
    engine = llms["k3"].engine
    backend = engine.constrained.backend()
    params = StructuredOutputParams("text", output_format="kimi_k3", starts_in_reasoning=False)
    state = backend.new_state(params, engine.eos_token_ids)
    specials = engine.tokenizer.special_tokens
    for token in engine.tokenizer.encode("Hello there"):
        assert state.accept(token)
    mask = backend.fill([state, None], [10_000, 10_000])

    def allows(row: int, token: int) -> bool:
        return bool((int(mask[row, token >> 5]) >> (token & 31)) & 1)

    assert allows(0, specials["<|close|>"]) and not allows(0, specials["<|open|>"])
    assert not allows(0, specials["<|sep|>"]) and not allows(0, specials["<|end_of_msg|>"])
    assert allows(1, specials["<|open|>"])


def test_text_needs_an_output_format():
    with pytest.raises(InvalidRequestError):
        StructuredOutputParams("text")
