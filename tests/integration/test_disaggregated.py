"""Disaggregated serving: prefill -> cache service -> decode equals colocated serving token for token, and the mesh
survives a lost, corrupt, expired or unreachable cache.

Every test runs an in-process mesh (tests/integration/mesh_harness.py) on the tiny-k3 checkpoint: cache, prefill and
decode gRPC servers on free ports, requests sent by the gateway's `MeshClient`. The colocated reference is the same
decode worker prefilling locally.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis

from cache_service.client import PutObject
from cache_service.config import CacheServiceConfig
from cache_service.objects import Status
from cache_service.server import serve as serve_cache
from engine.transfer import RequestState
from protos import common_pb2, decode_pb2, prefill_pb2
from tests.integration.mesh_harness import (Mesh, assert_all_free, greedy, prompt_suite, run_bounded,
                                            tiny_k3_checkpoint, wait_idle, zero_kda_state)
from tests.fake_clock import FakeClock


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


def run(coro, timeout_s: float = 50.0):
    return run_bounded(coro, timeout_s)


async def _reset_prefill_cache(mesh: Mesh) -> None:
    engine = mesh.prefill_server.engine
    await engine.run_in_engine(engine.core.reset_prefix_cache)


async def _equal_on_suite(mesh: Mesh, max_tokens: int = 8) -> tuple[list[int], list[int]]:
    """Remote and local outputs of every suite prompt are equal; returns the remote and local cached tokens."""
    remote_cached, local_cached = [], []
    for i, prompt in enumerate(prompt_suite()):
        remote = await mesh.run(prompt, greedy(max_tokens), "remote")
        local = await mesh.run(prompt, greedy(max_tokens), "local")
        assert remote.route == "remote" and local.route == "local"
        assert remote.ids == local.ids, f"prompt {i} (length {len(prompt)}): disaggregated != colocated"
        assert len(remote.ids) == max_tokens and remote.finish == {0: "length"}
        assert remote.usage.prompt_tokens == len(prompt) and remote.usage.completion_tokens == max_tokens
        # The first event already says how much was cached (a client may stop reading before the usage).
        assert remote.events[0].cached_tokens == remote.usage.cached_tokens
        assert local.events[0].cached_tokens == local.usage.cached_tokens
        remote_cached.append(remote.usage.cached_tokens)
        local_cached.append(local.usage.cached_tokens)
    return remote_cached, local_cached


async def _suite_with_remote_reuse(mesh: Mesh) -> None:
    remote_cached, _ = await _equal_on_suite(mesh)
    assert sum(remote_cached) > 0, "prefill never reused a cached prefix"
    assert mesh.decode_worker.counters.handoff_loaded == len(prompt_suite())
    assert mesh.decode_worker.counters.handoff_failures == 0
    # A prefill worker with an empty prefix cache loads blocks and snapshots from the cache service.
    await mesh.drain()
    assert mesh.prefill_worker.counters.published_snapshots > 0
    await _reset_prefill_cache(mesh)
    loads_before = mesh.prefill_worker.counters.remote_loads
    remote_cached, _ = await _equal_on_suite(mesh)
    assert mesh.prefill_worker.counters.remote_loads > loads_before
    assert mesh.prefill_worker.counters.remote_load_failures == 0
    assert sum(remote_cached) > 0
    # Seeded random sampling continues the exact random stream: the sampler state crosses too.
    sampled = common_pb2.SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    for prompt in prompt_suite()[::4]:
        remote = await mesh.run(prompt, sampled, "remote")
        local = await mesh.run(prompt, sampled, "local")
        assert remote.ids == local.ids
    await mesh.decode_server.engine.check_integrity()
    await mesh.prefill_server.engine.check_integrity()


def test_disaggregated_equals_colocated_memory_backend(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            await _suite_with_remote_reuse(mesh)
    run(main())


def test_disaggregated_equals_colocated_redis_backend(tiny_k3, private_redis):
    async def main():
        async with Mesh(tiny_k3, backend=private_redis.url) as mesh:
            await _suite_with_remote_reuse(mesh)
            stats = await mesh.cache.stats()
            assert stats.backend == "redis" and stats.objects > 0 and stats.corrupt_reads == 0
    run(main())


def test_disaggregated_equals_colocated_redis_cluster_backend(tiny_k3, redis_cluster):
    """The same suite over a 3-master Redis Cluster (hash-tagged keys, one pipeline per master): handoffs, blocks
    and snapshots through the workers' direct Redis plane; then every object corrupted on its node is detected,
    counted and recomputed, output unchanged."""
    async def main():
        async with Mesh(tiny_k3, backend=redis_cluster.url) as mesh:
            await _suite_with_remote_reuse(mesh)
            stats = await mesh.cache.stats()
            assert stats.backend == "redis" and stats.objects > 0 and stats.corrupt_reads == 0
            assert {port for port, _ in redis_cluster.names(b"kdamesh:o:*")} == set(redis_cluster.ports)
            prompt, sampling = prompt_suite()[9], greedy(8)
            reference = (await mesh.run(prompt, sampling, "local")).ids
            response = await _prefill(mesh, prompt, sampling, "cluster-corrupt")
            await mesh.drain()
            flipped = sum(_flip_last_byte_of_every_object(redis_cluster.node(port), b"kdamesh:")
                          for port in redis_cluster.ports)
            assert flipped >= 3
            tokens, last = await _decode(mesh, prompt, sampling, response, "cluster-corrupt")
            assert tokens == reference and not last.used_handoff
            assert mesh.decode_worker.counters.failure_reasons.get("corrupt") == 1
            assert (await mesh.cache.stats()).corrupt_reads >= 1
    run(main(), timeout_s=120)


def test_handoff_with_every_block_equals_colocated(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, handoff_full_kv=True) as mesh:
            for prompt in prompt_suite()[::3]:
                remote = await mesh.run(prompt, greedy(6), "remote")
                local = await mesh.run(prompt, greedy(6), "local")
                assert remote.ids == local.ids
            assert mesh.decode_worker.counters.handoff_failures == 0
    run(main())


# -- the state crosses the wire --------------------------------------------------------------------------------


async def _prefill(mesh: Mesh, prompt: list[int], sampling, request_id: str,
                   ttl_ms: int = 0) -> prefill_pb2.PrefillResponse:
    return await mesh.prefill_stub.Prefill(prefill_pb2.PrefillRequest(
        generation=_generation(prompt, sampling, request_id), handoff_ttl_ms=ttl_ms), timeout=20)


def _generation(prompt: list[int], sampling, request_id: str) -> common_pb2.GenerationRequest:
    return common_pb2.GenerationRequest(request_id=request_id, prompt=common_pb2.TokenIds(ids=prompt),
                                        sampling=sampling)


async def _decode(mesh: Mesh, prompt: list[int], sampling, response: prefill_pb2.PrefillResponse,
                  request_id: str) -> tuple[list[int], decode_pb2.DecodeChunk]:
    call = mesh.decode_stub.Decode(decode_pb2.DecodeRequest(
        generation=_generation(prompt, sampling, request_id),
        handoff=decode_pb2.HandoffSource(handoff_key=response.handoff_key, first_token_id=response.first_token_id,
                                         cached_tokens=response.cached_tokens)), timeout=20)
    tokens, last = [], None
    async for chunk in call:
        tokens.extend(chunk.token_ids)
        last = chunk
    return tokens, last


async def _rewrite_handoff(mesh: Mesh, key, edit) -> None:
    [got] = await mesh.cache.get_objects([key])
    assert got.status == Status.FOUND
    state = RequestState.from_bytes(got.data)
    edit(state)
    [put] = await mesh.cache.put_objects([PutObject(key, state.to_bytes())])
    assert put.status == Status.STORED


def test_zeroed_kda_state_changes_the_output(tiny_k3):
    """Negative control: the same handoff with its KDA state zeroed decodes differently (so the state is used)."""
    async def main():
        async with Mesh(tiny_k3) as mesh:
            prompt = prompt_suite()[11]  # 100 tokens
            sampling = greedy(12)
            reference = (await mesh.run(prompt, sampling, "local")).ids

            first = await _prefill(mesh, prompt, sampling, "untouched")
            await _rewrite_handoff(mesh, first.handoff_key, lambda s: None)  # re-serialised, unchanged
            kept, last = await _decode(mesh, prompt, sampling, first, "untouched")
            assert last.used_handoff and kept == reference

            second = await _prefill(mesh, prompt, sampling, "zeroed")
            await _rewrite_handoff(mesh, second.handoff_key, zero_kda_state)
            zeroed, last = await _decode(mesh, prompt, sampling, second, "zeroed")
            assert last.used_handoff, "the zeroed state must be loaded, not recomputed"
            assert zeroed[0] == reference[0]  # the first token was sampled by prefill
            assert zeroed != reference
    run(main())


# -- failures: corrupt, lost, expired, unreachable -------------------------------------------------------------


def _flip_last_byte_of_every_object(client: redis.Redis, prefix: bytes) -> int:
    """Flips the last payload byte of every object: in its manifest when inline (num_chunks, the u32 at bytes 16..20
    of the manifest header, is 0: payloads up to 16 KiB), else in each of its chunks. -> number of objects."""
    flipped = 0
    for key in client.scan_iter(match=prefix + b"o:*"):
        if int.from_bytes(client.getrange(key, 16, 19), "big") == 0:
            _flip_last_byte(client, key)
        flipped += 1
    for key in client.scan_iter(match=prefix + b"c:*"):
        _flip_last_byte(client, key)
    return flipped


def _flip_last_byte(client: redis.Redis, key: bytes) -> None:
    value = bytearray(client.get(key))
    value[-1] ^= 0xFF
    client.set(key, bytes(value), keepttl=True)


def test_corrupt_objects_in_redis_are_detected_counted_and_recomputed(tiny_k3, private_redis):
    async def main():
        async with Mesh(tiny_k3, backend=private_redis.url) as mesh:
            prompt = prompt_suite()[9]  # 64 tokens
            sampling = greedy(8)
            reference = (await mesh.run(prompt, sampling, "local")).ids
            response = await _prefill(mesh, prompt, sampling, "corrupt")
            await mesh.drain()
            client = redis.Redis.from_url(private_redis.url)
            assert _flip_last_byte_of_every_object(client, b"kdamesh:") >= 3  # handoff, blocks, snapshots
            # A prefill with an empty local cache finds the corrupt blocks and snapshot: counted, computed instead.
            await _reset_prefill_cache(mesh)
            again = await mesh.run(prompt, sampling, "remote")
            assert again.ids == reference
            assert mesh.prefill_worker.counters.remote_load_failures == 1
            assert mesh.prefill_worker.counters.remote_loads == 0
            # The first handoff fails its checksum: decode recomputes, output unchanged. (The run above may have
            # met a corrupt block the prefill's load did not read, hence counted from here.)
            reasons = mesh.decode_worker.counters.failure_reasons
            before = reasons.get("corrupt", 0)
            tokens, last = await _decode(mesh, prompt, sampling, response, "corrupt")
            assert tokens == reference and not last.used_handoff
            assert reasons.get("corrupt") == before + 1
            stats = await mesh.cache.stats()
            assert stats.corrupt_reads >= 2
            client.close()
    run(main())


def test_flushed_redis_between_prefill_and_decode_recomputes(tiny_k3, private_redis):
    async def main():
        async with Mesh(tiny_k3, backend=private_redis.url) as mesh:
            client = redis.Redis.from_url(private_redis.url)
            for i, prompt in enumerate(prompt_suite()[6:12]):
                sampling = greedy(6)
                reference = (await mesh.run(prompt, sampling, "local")).ids
                response = await _prefill(mesh, prompt, sampling, f"flush-{i}")
                client.flushdb()
                tokens, last = await _decode(mesh, prompt, sampling, response, f"flush-{i}")
                assert tokens == reference and not last.used_handoff
            assert mesh.decode_worker.counters.failure_reasons == {"missing": 6}
            client.close()
    run(main())


def test_cache_service_killed_mid_run(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            prompts = prompt_suite()
            sampling = greedy(6)
            references = [(await mesh.run(p, sampling, "local")).ids for p in prompts]
            for p, ref in zip(prompts[:4], references):
                assert (await mesh.run(p, sampling, "remote")).ids == ref
            in_flight = [await _prefill(mesh, p, sampling, f"mid-{i}") for i, p in enumerate(prompts[4:8])]
            await mesh.cache_server.stop(0)  # the cache service is gone between prefill and decode
            mesh.cache_server = None
            for i, (p, response) in enumerate(zip(prompts[4:8], in_flight)):
                tokens, last = await _decode(mesh, p, sampling, response, f"mid-{i}")
                assert tokens == references[4 + i] and not last.used_handoff
            # New requests: prefill cannot publish a handoff (UNAVAILABLE); the gateway colocates them.
            t0 = time.monotonic()
            for p, ref in zip(prompts[8:], references[8:]):
                assert (await mesh.run(p, sampling, "remote")).ids == ref
            assert time.monotonic() - t0 < 20
            assert mesh.client.stats.prefill_fallbacks == len(prompts) - 8
            assert mesh.decode_worker.counters.recomputed == 4
    run(main())


def test_redis_unreachable_errors_per_key_and_nothing_hangs(tiny_k3, closed_port):
    async def main():
        async with Mesh(tiny_k3, backend=f"redis://127.0.0.1:{closed_port}/0") as mesh:
            from cache_service.objects import object_key

            keys = [object_key(b"f" * 32, b"", common_pb2.OBJECT_KIND_KV_BLOCK, bytes([i]) * 32) for i in range(3)]
            got = await mesh.cache.get_objects(keys)
            assert [r.status for r in got] == [Status.ERROR] * 3 and all(r.message for r in got)
            t0 = time.monotonic()
            for prompt in prompt_suite()[::4]:
                remote = await mesh.run(prompt, greedy(5), "remote")
                local = await mesh.run(prompt, greedy(5), "local")
                assert remote.ids == local.ids
            assert time.monotonic() - t0 < 30
            assert mesh.client.stats.prefill_fallbacks == len(prompt_suite()[::4])
    run(main())


def test_redis_stopped_mid_run(tiny_k3, private_redis):
    """Redis dies under a running cache service: per-key errors, every request still completes, nothing hangs."""
    async def main():
        async with Mesh(tiny_k3, backend=private_redis.url) as mesh:
            prompts = prompt_suite()[::3]
            sampling = greedy(5)
            references = [(await mesh.run(p, sampling, "local")).ids for p in prompts]
            in_flight = await _prefill(mesh, prompts[0], sampling, "redis-gone")
            private_redis.stop()
            [lost] = await mesh.cache.get_objects([in_flight.handoff_key])
            assert lost.status == Status.ERROR and lost.message
            tokens, last = await _decode(mesh, prompts[0], sampling, in_flight, "redis-gone")
            assert tokens == references[0] and not last.used_handoff
            t0 = time.monotonic()
            for p, ref in zip(prompts, references):
                assert (await mesh.run(p, sampling, "remote")).ids == ref
            assert time.monotonic() - t0 < 30
            assert mesh.client.stats.prefill_fallbacks == len(prompts)
    run(main())


def test_unclaimed_handoff_expires_and_decode_recomputes(tiny_k3):
    clock = FakeClock()  # the cache service's: the handoff's TTL passes without sleeping

    async def main():
        cache, port = await serve_cache(CacheServiceConfig(address="127.0.0.1:0"), clock=clock)
        async with Mesh(tiny_k3, cache_address=f"127.0.0.1:{port}") as mesh:
            prompt = prompt_suite()[8]
            sampling = greedy(6)
            response = await _prefill(mesh, prompt, sampling, "ttl", ttl_ms=300)
            [found] = await mesh.cache.get_objects([response.handoff_key])
            assert found.status == Status.FOUND
            clock.advance(0.6)
            [gone] = await mesh.cache.get_objects([response.handoff_key])
            assert gone.status == Status.MISSING
            tokens, last = await _decode(mesh, prompt, sampling, response, "ttl")
            assert tokens == (await mesh.run(prompt, sampling, "local")).ids and not last.used_handoff
            assert mesh.decode_worker.counters.failure_reasons == {"missing": 1}
        await cache.stop(1.0)
    run(main())


def test_claimed_handoff_is_removed(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            prompt = prompt_suite()[10]
            response = await _prefill(mesh, prompt, greedy(4), "claim")
            await _decode(mesh, prompt, greedy(4), response, "claim")
            await mesh.drain()
            [gone] = await mesh.cache.get_objects([response.handoff_key])
            assert gone.status == Status.MISSING
    run(main())


def test_fail_policy_reports_unavailable(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, kv_load_failure_policy="fail") as mesh:
            prompt = prompt_suite()[8]
            response = await _prefill(mesh, prompt, greedy(4), "fail")
            await mesh.cache.remove([response.handoff_key])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _decode(mesh, prompt, greedy(4), response, "fail")
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "handoff" in info.value.details()
    run(main())


# -- cancellation, first-token finishes, concurrency -----------------------------------------------------------


def test_cancelled_decode_frees_its_blocks(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            engine = mesh.decode_server.engine
            prompt = prompt_suite()[11]
            sampling = greedy(2000)
            for source in ("handoff", "local"):
                if source == "handoff":
                    response = await _prefill(mesh, prompt, sampling, f"cancel-{source}")
                    request = decode_pb2.DecodeRequest(generation=_generation(prompt, sampling, f"cancel-{source}"),
                                                       handoff=decode_pb2.HandoffSource(
                                                           handoff_key=response.handoff_key,
                                                           first_token_id=response.first_token_id))
                else:
                    request = decode_pb2.DecodeRequest(generation=_generation(prompt, sampling, f"cancel-{source}"),
                                                       local=decode_pb2.LocalPrefill())
                call = mesh.decode_stub.Decode(request, timeout=30)
                received = 0
                async for chunk in call:
                    received += len(chunk.token_ids)
                    if received >= 5:
                        break
                call.cancel()
                await assert_all_free(engine)
                assert engine.core.manager.state_pool.num_free_groups == engine.core.manager.state_pool.num_groups
    run(main())


def test_first_token_can_finish_at_prefill(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            prompt = prompt_suite()[7]
            one = await mesh.run(prompt, greedy(1), "remote")
            assert len(one.ids) == 1 and one.finish == {0: "length"} and one.usage.completion_tokens == 1
            first = one.ids[0]
            stop = common_pb2.SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[first])
            stopped = await mesh.run(prompt, stop, "remote")
            assert stopped.ids == [first] and stopped.finish == {0: "stop"}
            assert mesh.client.stats.prefill_finished == 2
            assert mesh.decode_worker.counters.handoff_requests == 0
    run(main())


def test_32_concurrent_streams_through_prefill_and_decode(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            prompts = (prompt_suite() * 2)[:32]
            budgets = [3 + (i * 7) % 17 for i in range(32)]
            runs = await asyncio.gather(*(mesh.run(p, greedy(b), "remote", request_id=f"c{i}")
                                          for i, (p, b) in enumerate(zip(prompts, budgets))))
            for r, budget in zip(runs, budgets):
                assert r.route == "remote" and len(r.ids) == budget and r.finish == {0: "length"}
                assert r.usage.completion_tokens == budget
                assert sum(len(e.token_ids) for e in r.events) == budget
            # Same outputs as one at a time, colocated.
            for p, b, r in list(zip(prompts, budgets, runs))[::5]:
                assert (await mesh.run(p, greedy(b), "local")).ids == r.ids
            assert mesh.decode_worker.counters.handoff_loaded == 32
            await wait_idle(mesh.decode_server.engine)
            await mesh.decode_server.engine.check_integrity()
    run(main())

