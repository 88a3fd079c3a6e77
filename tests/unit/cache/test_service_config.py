"""Service configuration, its command line's byte sizes, and how the client spreads a batch over streams."""

import argparse

import pytest

from cache_service.client import _split_by_bytes
from cache_service.cli import build_parser, config_from_args
from cache_service.config import CacheServiceConfig
from cache_service.store_factory import make_store
from telemetry.units import byte_size


@pytest.mark.parametrize("text, value", [("1024", 1024), ("1KiB", 1024), ("512MiB", 512 << 20), ("1GiB", 1 << 30),
                                         ("2GB", 2 * 10**9), ("1.5 KiB", 1536)])
def test_byte_size_flags(text, value):
    assert byte_size(text) == value
    assert build_parser().parse_args(["--byte-budget", text]).byte_budget == value


def test_byte_size_flags_reject_junk(capsys):
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size("lots")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--byte-budget", "lots"])
    assert "--byte-budget: 'lots' is not a byte size" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs", [{"backend": "memcached://x"}, {"chunk_bytes": 4 << 20},
                                    {"low_watermark": 0.95}, {"handoff_ttl_s": 0}, {"memory_arena": "disk"},
                                    {"max_hold_s": 0}])
def test_bad_configs_raise(kwargs):
    with pytest.raises(ValueError):
        CacheServiceConfig(**kwargs)


def test_command_line_to_config():
    args = build_parser().parse_args(["--address", "0.0.0.0:7000", "--cache-backend", "redis://h:1/2",
                                      "--byte-budget", "2GiB", "--handoff-ttl-s", "10", "--metrics-port", "0"])
    config = config_from_args(args)
    assert (config.address, config.backend, config.byte_budget) == ("0.0.0.0:7000", "redis://h:1/2", 2 << 30)
    assert (config.handoff_ttl_s, config.metrics_port) == (10.0, 0)
    assert (config.memory_arena, config.data_plane, config.redis_inline_bytes) == ("shm", True, 16 << 10)


def test_data_plane_flags():
    args = build_parser().parse_args(["--memory-arena", "heap", "--no-data-plane", "--redis-inline-bytes", "4KiB",
                                      "--shm-dir", "/tmp"])
    config = config_from_args(args)
    assert (config.memory_arena, config.data_plane, config.redis_inline_bytes, config.shm_dir) == \
        ("heap", False, 4096, "/tmp")


def test_a_memory_store_without_room_for_its_arena_keeps_payloads_in_the_heap(tmp_path):
    store = make_store(CacheServiceConfig(byte_budget=1 << 20, shm_dir=str(tmp_path / "missing")))
    assert store.backend == "memory" and store.arena is None
    arena_store = make_store(CacheServiceConfig(byte_budget=1 << 20, shm_dir=str(tmp_path)))
    try:
        assert arena_store.arena is not None and arena_store.arena.path.parent == tmp_path
    finally:
        arena_store.close()
    assert not list(tmp_path.iterdir())


def test_batches_split_into_contiguous_groups_of_similar_size():
    mib = 1 << 20
    assert _split_by_bytes([mib] * 64, 2, mib) == [(0, 32), (32, 64)]
    assert _split_by_bytes([10 * mib, mib, mib, mib], 2, mib) == [(0, 1), (1, 4)]
    assert _split_by_bytes([100, 100], 2, mib) == [(0, 2)]  # small batches stay on one stream
    assert _split_by_bytes([], 2, mib) == [(0, 0)]
