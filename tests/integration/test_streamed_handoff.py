"""Streamed handoffs (issue 30, item 5): a handoff larger than the prefill's part size (4 KiB here, under a 16 KiB
object cap) goes as a manifest, head pieces and KV blocks published group by group; the decode worker imports each
block group into its engine while the next is fetched (2 blocks per group here).

Claims, each with its negative control:
- a long prompt's streamed handoff continues exactly like colocated (blocks zeroed on their way into the engine
  change the output: the streamed blocks are what the engine uses);
- the import begins before the last part is available: a cache client that holds the last block back until the
  decode engine holds the first one serves it (in two groups: the second is asked for, and held back, while the
  first is imported; a wait-for-all import — one group — never gets it: it waits out `handoff_part_wait_s` and
  recomputes);
- a corrupt or late middle block, and a missing or corrupt head piece (each head piece hashed on its own), make
  the decode worker recompute, with the same output;
- a TP=2 decode worker streams the groups into both ranks and equals colocated (zeroed blocks differ).
Every colocated reference runs on a decode engine whose prefix cache is then emptied, so the streamed blocks
land in an empty cache.
"""

from __future__ import annotations

import random

import pytest

from cache_service.client import GetResult
from cache_service.objects import Status, object_key
from protos import common_pb2
from tests.integration.mesh_harness import VOCAB, Mesh, greedy, run_bounded, tiny_k3_checkpoint
from worker.tenancy import prompt_block_hashes

KV_BLOCK, HANDOFF = common_pb2.OBJECT_KIND_KV_BLOCK, common_pb2.OBJECT_KIND_HANDOFF
STREAMING = dict(max_object_bytes=16 << 10, handoff_part_bytes=4 << 10,
                 decode_options=dict(handoff_fetch_bytes=5 << 10, handoff_part_wait_s=1.0))
TOKENS = 24  # tiny-k3's one MLA layer moves greedy tokens late: zeroed blocks first change token 20 of prompt 4


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


def long_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


async def reset_decode_cache(mesh: Mesh) -> None:
    engine = mesh.decode_server.engine
    await engine.run_in_engine(engine.core.reset_prefix_cache)


async def colocated(mesh: Mesh, prompt: list[int]) -> list[int]:
    ids = (await mesh.run(prompt, greedy(TOKENS), "local")).ids
    await reset_decode_cache(mesh)
    return ids


class Tap:
    """Wraps the decode worker's cache client: `edit(keys, results)` may change what a BatchGet returns;
    `asked_after_first`: whether the decode engine held the prompt's first block when that BatchGet was sent."""

    def __init__(self, mesh: Mesh, prompt: list[int]):
        self.mesh = mesh
        engine = mesh.decode_server.engine
        self.hashes = prompt_block_hashes(engine.layout, prompt, b"")
        self.pool = engine.core.manager.block_pool
        fp = engine.layout.fingerprint
        self.block_keys = [object_key(fp, b"", KV_BLOCK, h).SerializeToString() for h in self.hashes]
        self.real = mesh.decode_worker.cache.get_objects
        self.edit = lambda keys, got: None
        self.asked_after_first = False
        mesh.decode_worker.cache.get_objects = self.get_objects

    async def get_objects(self, keys, *args, **kwargs):
        asked_after_first = self.imported(0)
        got = await self.real(keys, *args, **kwargs)
        self.asked_after_first = asked_after_first
        self.edit(keys, got)
        return got

    def imported(self, block: int) -> bool:
        return self.pool.get_cached(self.hashes[block]) is not None

    def blocks(self, keys, block: int) -> list[int]:
        """Where block `block`'s key is in a BatchGet's keys."""
        return [i for i, k in enumerate(keys) if k.SerializeToString() == self.block_keys[block]]


def corrupt(result: GetResult) -> GetResult:
    """A found object with one byte flipped; one not stored yet (a late part, which the fetcher asks for again) as
    it is, so the copy found on a later ask is the one corrupted."""
    if result.data is None:
        return result
    data = bytearray(result.data)
    data[len(data) // 2] ^= 0xFF
    return GetResult(result.key, result.status, bytes(data), result.message)


def test_a_long_handoff_streams_block_groups_into_decode_and_equals_colocated(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, **STREAMING) as mesh:
            decode, prefill = mesh.decode_worker.counters, mesh.prefill_worker.counters
            for n, seed in ((200, 1), (176, 2), (143, 3)):  # 12 full blocks + a tail, 11 exactly, 8 + a tail
                prompt = long_prompt(n, seed)
                reference = await colocated(mesh, prompt)
                groups = decode.handoff_groups
                remote = await mesh.run(prompt, greedy(TOKENS), "remote")
                assert remote.ids == reference
                assert decode.handoff_groups - groups == -(-(n // 16) // 2)  # every group streamed in
                await reset_decode_cache(mesh)
            assert decode.handoff_loaded == 3 and decode.handoff_failures == 0
            assert prefill.handoff_parts >= 3 * 9 and decode.handoff_parts == prefill.handoff_parts  # head pieces
            # negative control: blocks zeroed on their way into the engine change the output
            prompt = long_prompt(200, 4)
            reference = await colocated(mesh, prompt)
            engine = mesh.decode_server.engine
            real_import = engine.import_blocks
            engine.import_blocks = lambda hashes, kv: real_import(hashes, kv * 0)
            assert (await mesh.run(prompt, greedy(TOKENS), "remote")).ids != reference
            engine.import_blocks = real_import
    run_bounded(main(), 120)


def test_import_begins_before_the_last_part_is_available(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, **STREAMING) as mesh:
            for one_group in (False, True):
                prompt = long_prompt(200, 10 + one_group)
                reference = await colocated(mesh, prompt)
                tap, seen = Tap(mesh, prompt), {"held": 0, "served_after_first": False}
                last = len(tap.hashes) - 1

                def hold_last(keys, got):
                    for i in tap.blocks(keys, last):
                        if tap.asked_after_first:
                            seen["served_after_first"] = True
                        else:
                            got[i] = GetResult(keys[i], Status.MISSING, None, "held back by the test")
                            seen["held"] += 1
                tap.edit = hold_last
                fetcher = mesh.decode_worker.fetcher
                # two groups: the second (with the last block) is fetched while the first is checked and imported;
                # negative control: one group, a wait-for-all import
                fetcher.group_blocks = len(tap.hashes) if one_group else len(tap.hashes) // 2
                reasons = mesh.decode_worker.counters.failure_reasons
                late = reasons.get("late_part", 0)
                remote = await mesh.run(prompt, greedy(TOKENS), "remote")
                assert remote.ids == reference and seen["held"] >= 1
                if one_group:
                    assert not seen["served_after_first"] and reasons.get("late_part") == late + 1
                else:
                    assert seen["served_after_first"] and reasons.get("late_part", 0) == late
                await reset_decode_cache(mesh)
    run_bounded(main(), 120)


def test_a_corrupt_late_or_missing_part_recomputes_with_the_same_output(tiny_k3):
    async def main():
        async with Mesh(tiny_k3, **STREAMING) as mesh:
            reasons = mesh.decode_worker.counters.failure_reasons
            prompt = long_prompt(200, 20)
            reference = await colocated(mesh, prompt)
            tap = Tap(mesh, prompt)
            middle = len(tap.hashes) // 2

            def corrupt_middle(keys, got):
                for i in tap.blocks(keys, middle):
                    got[i] = corrupt(got[i])

            def never_middle(keys, got):
                for i in tap.blocks(keys, middle):
                    got[i] = GetResult(keys[i], Status.MISSING, None, "never published")

            def head_pieces(edit):
                def apply(keys, got):
                    if len(keys) > 2 and all(k.kind == HANDOFF for k in keys):  # the head pieces' BatchGet
                        got[1] = edit(got[1])
                return apply

            cases = [(corrupt_middle, "corrupt"), (never_middle, "late_part"),
                     (head_pieces(lambda r: GetResult(r.key, Status.MISSING, None, "dropped")), "missing_part"),
                     (head_pieces(corrupt), "corrupt")]
            for edit, reason in cases:
                tap.edit = edit
                before, groups = reasons.get(reason, 0), mesh.decode_worker.counters.handoff_groups
                remote = await mesh.run(prompt, greedy(TOKENS), "remote")
                assert remote.ids == reference, reason
                assert reasons.get(reason) == before + 1, (reason, reasons)
                if edit in (corrupt_middle, never_middle):  # the groups before the middle one were imported
                    assert mesh.decode_worker.counters.handoff_groups - groups == middle // 2
                await reset_decode_cache(mesh)
            tap.edit = lambda keys, got: None  # control: untouched, the same handoff path succeeds
            loaded = mesh.decode_worker.counters.handoff_loaded
            assert (await mesh.run(prompt, greedy(TOKENS), "remote")).ids == reference
            assert mesh.decode_worker.counters.handoff_loaded == loaded + 1
    run_bounded(main(), 120)


def test_a_streamed_handoff_into_a_tp2_decode_equals_colocated(tiny_k3):
    """The groups reach both ranks of a TP=2 decode worker (`write_blocks` is a rank-group command, in the
    TP/DCP-independent layout); negative control: zeroed blocks change the output there too."""
    async def main():
        async with Mesh(tiny_k3, decode_tp=2, **STREAMING) as mesh:
            assert len(mesh.decode_server.engine.core.executor.rank_pids) == 1
            prompt = long_prompt(200, 4)
            reference = await colocated(mesh, prompt)
            groups = mesh.decode_worker.counters.handoff_groups
            assert (await mesh.run(prompt, greedy(TOKENS), "remote")).ids == reference
            assert mesh.decode_worker.counters.handoff_groups - groups == 6
            await reset_decode_cache(mesh)
            engine = mesh.decode_server.engine
            real_import = engine.import_blocks
            engine.import_blocks = lambda hashes, kv: real_import(hashes, kv * 0)
            assert (await mesh.run(prompt, greedy(TOKENS), "remote")).ids != reference
    run_bounded(main(), 180)
