"""Scratch buffers (kernels/workspace.py): reused per name and thread, grown on demand, never shared by threads."""

from __future__ import annotations

import threading

import torch

from kernels.workspace import scratch


def test_same_name_reuses_memory_and_grows_on_demand():
    a = scratch("test.a", (4, 8), torch.float32, torch.device("cpu"))
    b = scratch("test.a", (2, 8), torch.float32, torch.device("cpu"))
    assert a.shape == (4, 8) and b.shape == (2, 8) and a.data_ptr() == b.data_ptr()
    other = scratch("test.b", (4, 8), torch.float32, torch.device("cpu"))
    assert other.data_ptr() != a.data_ptr()
    bigger = scratch("test.a", (64, 8), torch.float32, torch.device("cpu"))
    assert bigger.shape == (64, 8) and bigger.is_contiguous()
    assert scratch("test.a", (3, 8), torch.float64, torch.device("cpu")).dtype == torch.float64


def test_threads_get_their_own_buffers():
    mine = scratch("test.thread", (16,), torch.float32, torch.device("cpu")).data_ptr()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(scratch("test.thread", (16,), torch.float32,
                                                                 torch.device("cpu")).data_ptr()))
    worker.start()
    worker.join(timeout=10)
    assert seen and seen[0] != mine
