"""bench/gpu_validate.py without a GPU: its CPU-skipping path writes the summaries, and its check code runs on CPU at
tiny sizes (torch backends pass against the references; backends that cannot run here are reported as skipped)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import gpu_validate as gv
from engine.model.checkpoint import make_checkpoint
from engine.model.loader import load_model


def test_cpu_skipping_path_writes_both_summaries(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real run is the check")
    gv.main(["--out", str(tmp_path / "gpu.json")])
    summary = json.loads((tmp_path / "gpu.json").read_text())
    assert {c["status"] for c in summary["checks"]} == {"skipped"}
    assert "Could not run: 7 check(s)" in (tmp_path / "gpu.md").read_text()


def test_checks_run_on_cpu_at_tiny_sizes():
    report = gv.Report("cpu")
    gv.kda_checks(report, 2, 16, [5, 9], 3, dev="cpu")
    gv.conv_checks(report, 24, [5, 3], dev="cpu")
    gv.mla_checks(report, 2, [3, 2], [7, 20], dev="cpu")
    gv.moe_checks(report, (9, 4, 2, 32, 64), (7, 8, 4, 2, 32, 64), dev="cpu")
    torch_checks = [c for c in report.checks if c.backend == "torch"]
    assert len(torch_checks) == 7 and all(c.status == "pass" for c in torch_checks), report.checks
    assert all(c.status == "skipped" for c in report.checks if c.backend != "torch")


def test_model_steps_on_cpu(tmp_path):
    model = load_model(make_checkpoint("tiny-k3", tmp_path / "tiny-k3", seed=0))
    out = gv.model_steps(model, [[5, 6, 7, 8], [9, 10]], decode_steps=2)
    assert out["logits"].shape == (2, model.config.vocab_size) and out["decode_ms"] > 0


def test_the_report_is_written_after_every_section(tmp_path, monkeypatch):
    """`run_all` calls `after_section` once a section ends, an erroring one included (main writes the report there,
    so a run stopped at its time limit keeps the sections that finished)."""
    report = gv.Report("fake")
    for name in ("kda_checks", "conv_checks", "mla_checks", "moe_checks", "model_checks", "engine_checks"):
        monkeypatch.setattr(gv, name, lambda *a, _n=name, **k: report.add(gv.Check(_n, "-", "pass")))
    monkeypatch.setattr(gv, "k3_shaped_config", lambda *a: {})
    monkeypatch.setattr(gv, "sync_checks", lambda *a: 1 / 0)
    written = []
    gv.run_all(report, quick=True, after_section=lambda: (gv.write_report(report, tmp_path / "r.json", 0.0),
                                                          written.append(len(report.checks))))
    assert written == [1, 2, 4, 5, 6, 7, 8]  # mla runs two shapes; the sync section's error is a check too
    summary = json.loads((tmp_path / "r.json").read_text())
    assert [c["status"] for c in summary["checks"]].count("error") == 1 and len(summary["checks"]) == 8
