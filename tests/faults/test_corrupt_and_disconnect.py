"""A corrupt object and a client that disconnects (issue 16 item 7), on an in-process mesh (cache service on a
private Redis, prefill and decode workers, the gateway's client):

- every stored byte flipped between prefill and decode: the handoff reads CORRUPT (counted, removed), decode
  recomputes the prompt and streams the same tokens as the colocated path;
- a client that leaves mid-stream: decode aborts the request and its engine gets every block back.
Both end with nothing leaked: no request in either engine, every KV block free, no handoff left in the cache."""

from __future__ import annotations

from contextlib import aclosing

import pytest

from gateway.mesh_client import MeshRequest
from protos import common_pb2, decode_pb2, prefill_pb2
from tests.integration.mesh_harness import Mesh, assert_all_free, greedy, run_bounded, tiny_k3_checkpoint

PROMPT = list(range(5, 70))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


def _corrupt_everything(own_redis) -> int:
    """Flips the last byte of every stored string (manifests, inline payloads, chunks) -> how many."""
    admin = own_redis.admin()
    flipped = 0
    for name in admin.scan_iter(match=b"kdamesh:*"):
        if admin.type(name) == b"string":
            size = admin.strlen(name)
            last = admin.getrange(name, size - 1, size - 1)
            admin.setrange(name, size - 1, bytes([last[0] ^ 0xFF]))
            flipped += 1
    return flipped


def test_a_corrupt_handoff_is_recomputed(model_dir, own_redis):
    async def body():
        async with Mesh(model_dir, backend=own_redis.url) as mesh:
            local = await mesh.run(PROMPT, greedy(8), "local")
            engine = mesh.decode_worker.engine  # emptied, or it would hold the prompt's blocks and not read them
            await engine.run_in_engine(engine.core.reset_prefix_cache)
            generation = common_pb2.GenerationRequest(request_id="corrupt", prompt=common_pb2.TokenIds(ids=PROMPT),
                                                      sampling=greedy(8))
            response = await mesh.prefill_stub.Prefill(prefill_pb2.PrefillRequest(generation=generation), timeout=20)
            assert _corrupt_everything(own_redis) >= 1
            call = mesh.decode_stub.Decode(decode_pb2.DecodeRequest(
                generation=generation,
                handoff=decode_pb2.HandoffSource(handoff_key=response.handoff_key,
                                                 first_token_id=response.first_token_id,
                                                 cached_tokens=response.cached_tokens)), timeout=20)
            tokens = [t async for chunk in call for t in chunk.token_ids]
            assert tokens == local.ids
            counters = mesh.decode_worker.counters
            assert counters.handoff_failures == 1 and counters.recomputed == 1
            await mesh.drain()
            stats = await mesh.cache.stats()
            assert stats.corrupt_reads >= 1 and stats.leased_objects == 0 and stats.active_leases == 0
            assert not await _handoff_present(mesh, response.handoff_key)  # removed: it stops answering
            await assert_all_free(mesh.decode_worker.engine)
            await assert_all_free(mesh.prefill_worker.engine)

    run_bounded(body(), 120)


async def _handoff_present(mesh: Mesh, key: common_pb2.ObjectKey) -> bool:
    (result,) = await mesh.cache.get_objects([key])
    return result.data is not None and len(result.data) > 0


def test_a_client_that_leaves_mid_stream_frees_everything(model_dir, own_redis):
    async def body():
        async with Mesh(model_dir, backend=own_redis.url) as mesh:
            for route in ("remote", "local"):
                request = MeshRequest(request_id=f"leaves-{route}", prompt_token_ids=tuple(PROMPT),
                                      sampling=greedy(5000), timeout_s=60)
                client = mesh.client
                received = 0
                async with aclosing(client.generate(request)) as events:
                    async for event in events:
                        received += len(event.token_ids)
                        if received >= 3:
                            break  # the client goes away: the stream is cancelled
                await assert_all_free(mesh.decode_worker.engine)
            await mesh.drain()
            await assert_all_free(mesh.prefill_worker.engine)

    run_bounded(body(), 120)
