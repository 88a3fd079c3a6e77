"""bench/spec_decode.py's cost modes run on a tiny checkpoint and report what they claim: `draft_cost` (the drafter
alone: batching cuts its aten calls per request) and `verify_cost` (a verify step against a plain one)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.spec_decode import draft_cost, main, verify_cost
from engine.model.checkpoint import make_checkpoint

MTP = json.dumps({"method": "mtp", "num_speculative_tokens": 2})


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return str(make_checkpoint("tiny-k3", tmp_path_factory.mktemp("tiny-k3"), seed=1))


def test_draft_cost_batches_the_drafter(tiny_k3):
    torch.manual_seed(0)
    one, four = (draft_cost(tiny_k3, MTP, b, steps=2, prompt_len=8) for b in (1, 4))
    assert one["draft_ms_per_step"] > 0 and one["draft_cpu_ms_per_step"] >= 0
    # four requests cost far fewer than four times one request's aten calls: one pass for all of them
    assert four["aten_calls_per_step"] < 1.5 * one["aten_calls_per_step"]
    # negative control: the calls do grow with the draft steps (the counter sees the drafter's work)
    three = draft_cost(tiny_k3, json.dumps({"method": "mtp", "num_speculative_tokens": 3}), 1, steps=2, prompt_len=8)
    assert three["aten_calls_per_step"] > one["aten_calls_per_step"]


def test_verify_cost_reports_both_steps(tiny_k3):
    r = verify_cost(tiny_k3, k=2, steps=3, repeats=1)
    assert r["k"] == 2 and r["plain_ms"] > 0 and r["verify_ms"] > 0
    assert r["ratio"] == pytest.approx(r["verify_ms"] / r["plain_ms"])


def test_batch_one_runs_its_requests_alone_and_times_the_decode_phase(tiny_k3, tmp_path):
    out = tmp_path / "rows.json"
    assert main(["--model", tiny_k3, "--workload", "loop", "--batch", "2", "--output-len", "4", "--repeats", "1",
                 "--solo-requests", "3", "--out", str(out)]) == 0
    solo, batched = json.loads(out.read_text())["rows"]
    assert solo["batch"] == 1 and solo["requests"] == 3 and solo["decode_speedup"] > 0
    assert batched["batch"] == 2 and batched["requests"] == 2 and batched["decode_speedup"] is None
