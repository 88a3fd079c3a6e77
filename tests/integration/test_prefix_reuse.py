"""Hybrid prefix reuse across the mesh: structure hints, turn ends and offloaded snapshots, disaggregated and colocated.

Every mesh here runs with a snapshot interval beyond the prompts (periodic snapshots never help), so each hit comes
from the kind of snapshot a test is about, and `cached_tokens` must equal exactly what was reused. Outputs are
compared token for token with a cold in-process engine (no prefix cache) on the same checkpoint. Controls: a poisoned
offloaded snapshot is refused by its checksum and recomputed; another tenant never reads an offloaded object.
"""

from __future__ import annotations

import pytest

from cache_service.client import PutObject
from cache_service.objects import Status, object_key
from engine import LLM, SamplingParams
from protos import common_pb2
from tests.integration.mesh_harness import Mesh, greedy, run_bounded, tiny_k3_checkpoint
from tests.unit.engine.conftest import random_prompts
from worker.tenancy import prompt_block_hashes

BS = 16
NO_PERIODIC = dict(snapshot_interval=4096)


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(tiny_k3):
    cold = LLM(tiny_k3, kv_cache_memory=8 << 20, max_num_seqs=4, enable_prefix_caching=False)

    def outputs(prompt: list[int], max_tokens: int = 8) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return cold.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    return outputs


def with_system(system_len: int, n: int, seed: int) -> list[list[int]]:
    system = random_prompts(1, system_len, system_len + 1, seed=seed)[0]
    return [system + user for user in random_prompts(n, 20, 40, seed=seed + 1)]


def test_structure_hint_disaggregated_then_colocated(tiny_k3, reference):
    prompts = with_system(600, 3, seed=70)  # a 600-token system block: the hint rounds down to 592

    async def main():
        async with Mesh(tiny_k3, engine=NO_PERIODIC) as mesh:
            first = await mesh.run_direct(prompts[0], greedy(8), "remote", hints=(600,))
            second = await mesh.run_direct(prompts[1], greedy(8), "remote", hints=(600,))
            await mesh.drain()  # prefill published the hinted snapshot (and the blocks) to the cache service
            third = await mesh.run_direct(prompts[2], greedy(8), "local", hints=(600,))
            assert [r.usage.cached_tokens for r in (first, second, third)] == [0, 592, 592]
            assert mesh.decode_worker.counters.remote_loads == 1  # the colocated decode read it back
            return [r.ids for r in (first, second, third)]
    assert run_bounded(main()) == [reference(p) for p in prompts]


def test_turn_end_next_turn_hits_the_whole_previous_turn_through_prefill(tiny_k3, reference):
    async def main():
        async with Mesh(tiny_k3, engine=NO_PERIODIC) as mesh:
            turn, expected, seen = random_prompts(1, 100, 101, seed=72)[0], None, []
            for message in random_prompts(3, 20, 30, seed=73):
                got = await mesh.run_direct(turn, greedy(30), "remote")
                seen.append((turn, got.ids))
                if expected is not None:
                    assert got.usage.cached_tokens == expected
                await mesh.drain()  # decode offloads the turn end: the state after the last full block
                expected = (len(turn) + len(got.ids) - 1) // BS * BS
                turn = turn + got.ids + message
            assert mesh.decode_worker.counters.offloaded_snapshots >= 3
            return seen
    for prompt, ids in run_bounded(main()):
        assert ids == reference(prompt, 30)


def test_remote_junction_where_the_cache_service_has_the_blocks_but_no_snapshot(tiny_k3, reference):
    """Prefill's local cache is emptied before each request, so only the cache service's blocks show where the
    prompts branch: the second request is snapshotted (and published) there, the third loads it."""
    shared = random_prompts(1, 300, 301, seed=90)[0]  # 18 full blocks (288 tokens) shared
    prompts = [shared + tail for tail in random_prompts(3, 40, 41, seed=91)]

    async def main():
        async with Mesh(tiny_k3, engine=NO_PERIODIC) as mesh:
            engine, got = mesh.prefill_server.engine, []
            for p in prompts:
                await engine.run_in_engine(engine.core.reset_prefix_cache)
                got.append(await mesh.run_direct(p, greedy(8), "remote"))
                await mesh.drain()
            assert [r.usage.cached_tokens for r in got] == [0, 0, 288]
            assert mesh.prefill_worker.counters.remote_loads == 1
            return [r.ids for r in got]
    assert run_bounded(main()) == [reference(p) for p in prompts]


async def _evict_locally(mesh: Mesh, prompts: list[list[int]], hint: int, salt: bytes = b"") -> None:
    """Colocated requests whose hinted snapshots outnumber the decode engine's two slots: the first ones are
    evicted there, and offloaded."""
    for p in prompts:
        await mesh.run_direct(p, greedy(8), "local", hints=(hint,), tenant_salt=salt)
    await mesh.drain()
    assert mesh.decode_worker.counters.offloaded_snapshots >= 2


def _meshes(tiny_k3, backend: str) -> Mesh:
    return Mesh(tiny_k3, backend=backend, engine=NO_PERIODIC, decode_engine=dict(NO_PERIODIC, num_snapshot_slots=2))


@pytest.mark.parametrize("tier", ["memory", "redis"])
def test_offloaded_snapshot_is_read_back_after_local_eviction(tiny_k3, reference, tier, request):
    backend = "memory" if tier == "memory" else request.getfixturevalue("private_redis").url
    systems = [with_system(200, 3, seed=74 + 2 * i) for i in range(3)]

    async def main():
        async with _meshes(tiny_k3, backend) as mesh:
            await _evict_locally(mesh, [s[0] for s in systems], 200)
            local = await mesh.run_direct(systems[0][1], greedy(8), "local", hints=(200,))
            remote = await mesh.run_direct(systems[0][2], greedy(8), "remote", hints=(200,))
            assert (local.usage.cached_tokens, remote.usage.cached_tokens) == (192, 192)
            assert mesh.decode_worker.counters.remote_loads == 1  # the colocated decode, after its eviction
            assert mesh.prefill_worker.counters.remote_loads == 1  # prefill never saw this system prompt
            stats = await mesh.cache.stats()
            assert stats.corrupt_reads == 0
            return local.ids, remote.ids
    local_ids, remote_ids = run_bounded(main())
    assert (local_ids, remote_ids) == (reference(systems[0][1]), reference(systems[0][2]))


def test_a_poisoned_offloaded_snapshot_is_refused_and_recomputed(tiny_k3, reference):
    systems = [with_system(200, 2, seed=80 + 2 * i) for i in range(3)]

    async def main():
        async with _meshes(tiny_k3, "memory") as mesh:
            await _evict_locally(mesh, [s[0] for s in systems], 200)
            layout = mesh.decode_server.engine.layout
            h = prompt_block_hashes(layout, systems[0][0], b"")[200 // BS - 1]
            key = object_key(layout.fingerprint, b"", common_pb2.OBJECT_KIND_STATE_SNAPSHOT, h)
            [got] = await mesh.cache.get_objects([key])
            assert got.status == Status.FOUND
            poisoned = bytearray(got.data)
            poisoned[-3] ^= 0x10  # one bit of the recurrent state; the cache service stores it as given
            [put] = await mesh.cache.put_objects([PutObject(key, bytes(poisoned))])
            assert put.status == Status.STORED
            again = await mesh.run_direct(systems[0][1], greedy(8), "local", hints=(200,))
            counters = mesh.decode_worker.counters
            assert again.usage.cached_tokens == 0 and counters.remote_load_failures == 1 and counters.remote_loads == 0
            return again.ids
    assert run_bounded(main()) == reference(systems[0][1])


def test_another_tenant_never_reads_an_offloaded_snapshot(tiny_k3, reference):
    systems = [with_system(200, 2, seed=86 + 2 * i) for i in range(3)]

    async def main():
        async with _meshes(tiny_k3, "memory") as mesh:
            await _evict_locally(mesh, [s[0] for s in systems], 200, salt=b"tenant-x")
            other = await mesh.run_direct(systems[0][1], greedy(8), "local", hints=(200,), tenant_salt=b"tenant-y")
            assert other.usage.cached_tokens == 0 and mesh.decode_worker.counters.remote_loads == 0
            owner = await mesh.run_direct(systems[0][1], greedy(8), "remote", hints=(200,), tenant_salt=b"tenant-x")
            assert owner.usage.cached_tokens == 192 and mesh.prefill_worker.counters.remote_loads == 1
            return other.ids, owner.ids
    other_ids, owner_ids = run_bounded(main())
    assert other_ids == owner_ids == reference(systems[0][1])
