"""The Redis Cluster URL and the hash-tagged layout, without a server: seeds parsed or refused, an object's tagged
names in one slot, the single-Redis names unchanged, prefixes with braces refused."""

import struct

import pytest
from redis.crc import key_slot

from cache_service.config import CacheServiceConfig
from cache_service.objects import Checksum
from cache_service.redis_cluster import parse_cluster_url
from cache_service.redis_layout import RedisKeys, hash_tag


def test_cluster_urls_name_seed_nodes():
    assert parse_cluster_url("redis+cluster://a:7000,b:7001") == (("a", 7000), ("b", 7001))
    assert parse_cluster_url("redis+cluster://a,[::1]:7002/0") == (("a", 6379), ("::1", 7002))
    for bad in ("redis+cluster://", "redis+cluster://a:7000/3", "redis+cluster://a:x", "redis://a:7000",
                "redis+cluster://a:70000"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def test_the_service_config_takes_a_cluster_backend_and_refuses_braces_in_its_prefix():
    assert CacheServiceConfig(backend="redis+cluster://h:7000,h:7001").backend.startswith("redis+cluster")
    with pytest.raises(ValueError, match="may not contain"):
        CacheServiceConfig(backend="redis+cluster://h:7000", redis_key_prefix="kd{x}:")
    with pytest.raises(ValueError, match="database 0"):
        CacheServiceConfig(backend="redis+cluster://h:7000/2")
    assert CacheServiceConfig(backend="redis://h:6379/0", redis_key_prefix="kd{x}:")  # a single Redis: any prefix


@pytest.mark.parametrize("key", [b"plain", b"with}brace{s", b"}", bytes(range(256))])
def test_an_objects_tagged_names_share_a_slot_and_pins_map_back(key):
    keys, checksum = RedisKeys(b"kdamesh:", tagged=True), Checksum.of(b"data")
    names = [keys.manifest(key), keys.pins(key), *(keys.chunk(key, checksum, i) for i in range(5))]
    assert len({key_slot(n) for n in names}) == 1
    assert keys.store_key_of_pins(keys.pins(key)) == key
    assert hash_tag(key).count(b"{") == hash_tag(key).count(b"}") == 1 and len(hash_tag(key)) == 18


def test_single_redis_names_are_the_untagged_layout():
    keys, checksum = RedisKeys(b"kdamesh:"), Checksum.of(b"data")
    assert keys.manifest(b"K") == b"kdamesh:o:K" and keys.pins(b"K") == b"kdamesh:p:K"
    assert keys.chunk(b"K", checksum, 2) == (b"kdamesh:c:" + bytes([checksum.algorithm]) + checksum.value
                                             + struct.pack(">I", 2) + b"K")
    assert keys.store_key_of_pins(b"kdamesh:p:K") == b"K"
