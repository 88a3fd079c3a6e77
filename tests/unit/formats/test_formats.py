"""engine.formats: the chat-format markers are special tokens of their family's vocabulary (but `<think>`), the
stop-string rule (earliest match, cut or kept, found across step boundaries, never emitted while streaming), and
the package stays free of torch (the gateway imports it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine import tokenizer_build as tb
from engine.formats import markers
from engine.formats.stop import StopMatcher
from engine.tokenizer import KimiTokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("family, names", [
    ("kimi_k3", markers.K3_STRUCTURAL_MARKERS),
    ("kimi_linear", tuple(m for m in markers.K2_OUTPUT_MARKERS if m not in (markers.K2_THINK_OPEN,
                                                                            markers.K2_THINK_CLOSE))
     + (markers.K2_IM_SYSTEM, markers.K2_IM_USER, markers.K2_IM_ASSISTANT, markers.K2_IM_MIDDLE)),
])
def test_markers_are_special_tokens_of_their_family(tmp_path, family, names):
    tokenizer = KimiTokenizer.from_pretrained(tb.write_tokenizer(tmp_path, family))
    missing = [m for m in names if m not in tokenizer.special_tokens]
    assert not missing
    assert markers.K3_END_OF_MSG in tokenizer.special_tokens if family == "kimi_k3" else \
        markers.K2_IM_END in tokenizer.special_tokens


def test_k2_think_tags_are_plain_text():
    assert markers.K2_THINK_OPEN == "<think>" and markers.K2_THINK_CLOSE == "</think>"
    assert set(markers.OUTPUT_MARKERS) == set(markers.K3_CONTROL_MARKERS) | set(markers.K2_OUTPUT_MARKERS)


def test_cut_takes_the_earliest_stop_string():
    stops = StopMatcher(["world", "lo"])
    assert stops.cut("hello world", 0) == ("hel", "lo")
    assert StopMatcher(["world", "lo"], include_stop=True).cut("hello world", 0) == ("hello", "lo")
    assert stops.cut("nothing here", 0) == ("nothing here", None)
    assert StopMatcher(["ab", "abc"]).cut("xabc", 0) == ("x", "ab")  # same place: the shorter one


def test_cut_finds_a_stop_string_that_spans_steps():
    stops = StopMatcher(["STOP"])
    assert stops.holdback == 3
    # "ST" came in an earlier step (searched then, no match), "OP" now: the search starts holdback chars back
    assert stops.cut("go STOP", old_len=5) == ("go ", "STOP")
    # text before old_len - holdback was searched before and is not searched again
    assert stops.cut("STOP and more", old_len=len("STOP and mor")) == ("STOP and more", None)


def test_streaming_never_emits_part_of_a_stop_string():
    stops = StopMatcher(["</end>"])
    text, emitted, out = "", 0, ""
    for ch in "partial </e then </end> tail":
        old = len(text)
        text, stop = stops.cut(text + ch, old)
        end = stops.visible_end(len(text), emitted, finished=stop is not None)
        out, emitted = out + text[emitted:end], max(emitted, end)
        assert "</end>" not in out
        if stop is not None:
            break
    assert out == "partial </e then " and stop == "</end>"


def test_visible_end():
    stops = StopMatcher(["abc"])
    assert stops.visible_end(10, 0, finished=False) == 8
    assert stops.visible_end(10, 9, finished=False) == 9  # never behind what was emitted
    assert stops.visible_end(10, 0, finished=True) == 10
    assert not StopMatcher([]) and StopMatcher([]).visible_end(4, 0, finished=False) == 4


def test_formats_import_no_torch():
    code = ("import sys, engine.formats, engine.formats.markers, engine.formats.stop; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
