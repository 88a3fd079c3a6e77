"""The official Kimi K3 renderer (`encoding_k3`) and tokenizer (`tokenization_kimi`), loaded by path from the
installed `llmcompressor` wheel for the tests that compare against them."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from types import ModuleType

from tests.reference.k3_reference import official_dir, stubbed_modules


OFFICIAL_TEXT_MODULES = ("encoding_k3", "tokenization_kimi")  # tokenization_kimi falls back to `import encoding_k3`


@contextlib.contextmanager
def official_text_modules() -> Iterator[dict[str, ModuleType]]:
    """The official renderer and tokenizer modules, loaded by path; `sys.modules` restored afterwards."""
    folder = official_dir()
    with stubbed_modules(dict.fromkeys(OFFICIAL_TEXT_MODULES)):
        for name in OFFICIAL_TEXT_MODULES:
            spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
            sys.modules[name] = module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        yield {name: sys.modules[name] for name in OFFICIAL_TEXT_MODULES}
