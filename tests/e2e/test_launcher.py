"""End to end: `kdamesh up` as a subprocess on the tiny-k3 checkpoint, driven by the official `openai` client;
SIGTERM then stops every process it started (no orphans)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.launched import launch, stop

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who told stories every night."


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    launched = launch(tmp_path_factory.mktemp("e2e"), "endpoints ")
    proc = launched.proc
    info = {"proc": proc, "port": launched.port, "model": launched.model, "endpoints": json.loads(launched.line),
            "log": launched.log, "children": _children(proc.pid)}
    yield info
    stop(proc)
    for child in info["children"]:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_openai_client_against_the_launched_mesh(mesh):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{mesh['port']}/v1", api_key="unused", max_retries=0,
                           timeout=60)
    assert set(mesh["endpoints"]) == {"cache", "prefill", "decode", "gateway"}
    assert len(mesh["children"]) == 4, "cache, prefill, decode and gateway run as separate processes"

    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-k3"]

    first = client.completions.create(model="tiny-k3", prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    text = first.choices[0].text
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 10
    assert text

    stream = client.completions.create(model="tiny-k3", prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # The repeated prompt hit the prefix cache (in the stream's usage and in a third, non-streamed call).
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    third = client.completions.create(model="tiny-k3", prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert third.choices[0].text == text
    assert third.usage.prompt_tokens_details.cached_tokens > 0

    by_ids = client.completions.create(model="tiny-k3", prompt=[5, 6, 7, 8], max_tokens=3, temperature=0)
    assert by_ids.usage.prompt_tokens == 4

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-k3", prompt=PROMPT, max_tokens=10, temperature=-3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=3)


def test_sigterm_stops_every_process(mesh):
    proc, children = mesh["proc"], mesh["children"]
    assert children and all(_alive(c) for c in children)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(_alive(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [c for c in children if _alive(c)], "kdamesh up left processes behind"
    assert "stopping the mesh" in mesh["log"].read_text()
