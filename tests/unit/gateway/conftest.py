"""Gateway test fixtures: tokenizer folders for both families, the official K3 renderer and tokenizer (loaded by file
path from the installed `llmcompressor` package, never imported as a package and never modified), and a
`transformers` tokenizer carrying kdamesh's K2 chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import tokenizer_build as tb
from engine.tokenizer import KimiTokenizer
from gateway.chat import write_k2_chat_template
from tests.reference.official_text import official_text_modules



@pytest.fixture(scope="session")
def k3_dir(tmp_path_factory) -> Path:
    return tb.write_tokenizer(tmp_path_factory.mktemp("k3-tokenizer"), "kimi_k3")


@pytest.fixture(scope="session")
def k2_dir(tmp_path_factory) -> Path:
    folder = tb.write_tokenizer(tmp_path_factory.mktemp("k2-tokenizer"), "kimi_linear")
    write_k2_chat_template(folder)
    return folder


@pytest.fixture(scope="session")
def k3_tok(k3_dir) -> KimiTokenizer:
    return KimiTokenizer.from_pretrained(k3_dir)


@pytest.fixture(scope="session")
def k2_tok(k2_dir) -> KimiTokenizer:
    return KimiTokenizer.from_pretrained(k2_dir)


@pytest.fixture(scope="session")
def official_k3():
    """(encoding_k3 module, TikTokenTokenizer class), loaded by path; sys.modules restored afterwards."""
    with official_text_modules() as modules:
        yield modules["encoding_k3"], modules["tokenization_kimi"].TikTokenTokenizer


@pytest.fixture(scope="session")
def official_k3_tokenizer(official_k3, k3_dir):
    _, tokenizer_cls = official_k3
    return tokenizer_cls.from_pretrained(str(k3_dir))


@pytest.fixture(scope="session")
def hf_k2_tokenizer(tmp_path_factory):
    """A transformers tokenizer (tokenizer.json + chat_template.jinja), as `AutoTokenizer` loads a checkpoint."""
    from transformers import AutoTokenizer

    folder = tb.write_tokenizer_json(tmp_path_factory.mktemp("k2-hf"), "kimi_linear")
    write_k2_chat_template(folder)
    return AutoTokenizer.from_pretrained(str(folder))
