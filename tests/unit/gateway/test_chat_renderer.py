"""`ChatRenderer`: the format follows the checkpoint's family, and the gateway packages import without torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.chat import ChatFormatError, ChatRenderer, read_family
from gateway.parsers import build_output_parser

REPO = Path(__file__).resolve().parents[3]
CHAT = [{"role": "user", "content": "Hi <|im_end|><|open|>"}]


def _checkpoint(tokenizer_dir: Path, target: Path, model_type: str) -> Path:
    shutil.copytree(tokenizer_dir, target)
    (target / "config.json").write_text(json.dumps({"model_type": model_type}))
    return target


def test_family_selects_the_format(tmp_path, k3_dir, k2_dir, k3_tok, k2_tok):
    k3 = ChatRenderer.from_pretrained(_checkpoint(k3_dir, tmp_path / "k3", "kimi_k3"))
    k2 = ChatRenderer.from_pretrained(_checkpoint(k2_dir, tmp_path / "k2", "kimi_linear"))
    assert (k3.family, k3.output_format) == ("kimi_k3", "kimi_k3")
    assert (k2.family, k2.output_format) == ("kimi_linear", "kimi_k2")
    k3_prompt, k2_prompt = k3.render(CHAT), k2.render(CHAT)
    assert k3_prompt.text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert k2_prompt.text.endswith("<|im_assistant|>assistant<|im_middle|>")
    assert k3_prompt.starts_in_reasoning and not k2_prompt.starts_in_reasoning
    assert k3_tok.decode(k3_prompt.token_ids) == k3_prompt.text == k3.render_text(CHAT)
    assert k2_tok.decode(k2_prompt.token_ids) == k2_prompt.text == k2.render_text(CHAT)
    with pytest.raises(ChatFormatError):
        k2.render([{"role": "user", "content": "x"}], image_sizes=[(1, 1)])


def test_unknown_family_and_missing_template(tmp_path, k2_dir):
    folder = _checkpoint(k2_dir, tmp_path / "other", "llama")
    with pytest.raises(ValueError, match="model_type"):
        read_family(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(FileNotFoundError):
        ChatRenderer.from_pretrained(folder)


def test_parser_registry():
    assert type(build_output_parser("kimi_k3", "kimi_k3")).__name__ == "K3OutputParser"
    assert type(build_output_parser("kimi_k2", None)).__name__ == "K2OutputParser"
    assert build_output_parser(None, None) is None
    with pytest.raises(ValueError, match="not registered"):
        build_output_parser("hermes", None)
    with pytest.raises(ValueError, match="different output formats"):
        build_output_parser("kimi_k3", "kimi_k2")


def test_gateway_imports_without_torch(k3_dir):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import gateway, gateway.chat, gateway.chat.k2, gateway.chat.k3, gateway.parsers\n"
        "from engine.tokenizer import KimiTokenizer\n"
        f"tok = KimiTokenizer.from_pretrained({str(k3_dir)!r})\n"
        "from gateway.chat import ChatRenderer\n"
        "print(len(ChatRenderer('kimi_k3', tok).render([{'role': 'user', 'content': 'hi'}]).token_ids))\n"
        "assert not any(name == 'torch' or name.startswith('torch.') for name, m in sys.modules.items() if m)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.strip()) > 0


# --------------------------------------------------------------------------------------------------------------
# Arbitrary request JSON: a prompt or ChatFormatError, never another exception (the gateway answers 400, not 500)

KEYS = ["role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "reasoning", "tools", "type",
        "function", "id", "arguments", "text", "image_url", "url", "parameters", "description", "json_schema",
        "schema"]
VALUES = ["user", "assistant", "system", "tool", "developer", "function", "text", "image_url", "image", "f", "c1",
          "{}", '{"a": 1}', "[1]", "{oops", "object", "array", "json_schema", "json_object", "<|im_end|>", "<|open|>"]
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(), st.sampled_from(VALUES),
                        st.text(max_size=5))
json_any = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(VALUES[:6])},
                                optional={key: json_any for key in KEYS if key != "role"})
FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=300,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(messages=st.one_of(st.lists(message, max_size=5), json_any), tools=json_any, kwargs=json_any,
       choice=json_any, response_format=json_any, sizes=json_any)
def test_arbitrary_requests_raise_only_chat_format_errors(renderers, messages, tools, kwargs, choice,
                                                          response_format, sizes):
    for renderer in renderers:
        try:
            renderer.render(messages, tools, True, kwargs, tool_choice=choice, response_format=response_format,
                            image_sizes=sizes)
        except ChatFormatError:
            pass


def test_deep_nesting_is_refused(renderers):
    deep: object = "x"
    for _ in range(5000):
        deep = [deep]
    chat = [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": deep}}}]}]
    for renderer in renderers:
        with pytest.raises(ChatFormatError, match="nested"):
            renderer.render(chat)


@pytest.fixture(scope="module")
def renderers(tmp_path_factory, k3_dir, k2_dir):
    root = tmp_path_factory.mktemp("renderers")
    return [ChatRenderer.from_pretrained(_checkpoint(k3_dir, root / "k3", "kimi_k3")),
            ChatRenderer.from_pretrained(_checkpoint(k2_dir, root / "k2", "kimi_linear"))]
