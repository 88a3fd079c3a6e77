"""malloc tuning: applied through mallopt on glibc (checked in a child process, so this one keeps its settings), a
no-op elsewhere, never an exception."""

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from cache_service import malloc_tuning
from cache_service.malloc_tuning import MallocTuning, tune_malloc

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_gets_the_thresholds():
    code = ("from cache_service.malloc_tuning import tune_malloc; r = tune_malloc(); "
            "print(r.applied, r.mmap_threshold_bytes, r.trim_threshold_bytes)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    applied, mmap_bytes, trim_bytes = out.split()
    assert applied == "True" and int(mmap_bytes) in (256 << 20, 32 << 20) and int(trim_bytes) == 1 << 30


def test_off_glibc_it_changes_nothing(monkeypatch):
    monkeypatch.setattr(malloc_tuning, "_glibc_mallopt", lambda: None)
    result = tune_malloc(MallocTuning())
    assert not result.applied and result.mmap_threshold_bytes == 0 and "not glibc" in result.note


def test_a_refused_mmap_threshold_falls_back_to_the_32_mib_cap(monkeypatch):
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 0 if param == malloc_tuning.M_MMAP_THRESHOLD and value > malloc_tuning.GLIBC_MMAP_THRESHOLD_CAP else 1

    monkeypatch.setattr(malloc_tuning, "_glibc_mallopt", lambda: mallopt)
    result = tune_malloc(MallocTuning(mmap_threshold_bytes=256 << 20, trim_threshold_bytes=1 << 30))
    assert result.applied and result.mmap_threshold_bytes == 32 << 20 and result.trim_threshold_bytes == 1 << 30
    assert calls == [(-3, 256 << 20), (-3, 32 << 20), (-1, 1 << 30)]
