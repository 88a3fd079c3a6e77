"""The committed request-flow diagram is what its source script draws (so the picture cannot drift from it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

IMG = Path(__file__).resolve().parents[3] / "docs" / "img"


def test_regenerating_the_diagram_gives_the_committed_svg():
    spec = importlib.util.spec_from_file_location("request_flow", IMG / "request_flow.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.render() == (IMG / "request_flow.svg").read_text()
    for box in ("gateway", "prefill worker", "cache service", "decode worker", "snapshot path", "handoff"):
        assert box in module.render()


def test_the_docs_show_it():
    root = IMG.parents[1]
    assert "img/request_flow.svg" in (root / "docs" / "architecture.md").read_text()
    assert "docs/img/request_flow.svg" in (root / "README.md").read_text()
