"""Subprocess body of tests/unit/model/test_bounded_loading.py: loads a checkpoint and reports the peak resident
memory the load added (VmHWM after the load minus VmRSS before it, the high-water mark reset first).

Usage: python -m tests.unit.model.load_memory MODEL_DIR LOAD_FORMAT FILES_PER_RANK; prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import torch

from engine.model.loader import LoadConfig, load_model


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def main(model_dir: str, load_format: str, files_per_rank: int) -> dict:
    torch.ones(4).sum()  # torch's own first-use allocations happen before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = status_kib("VmRSS")
    model = load_model(model_dir, LoadConfig(load_format=load_format, dtype="bfloat16", files_per_rank=files_per_rank))
    peak = status_kib("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    return {"peak_added": (peak - before) * 1024, "weights": weights, "largest_parameter": largest}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
