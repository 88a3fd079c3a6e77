"""Prefix-cache hits on a handoff's prompt (issue 30): a decode worker whose prefix cache already holds the prompt's
first full blocks (an earlier turn of the conversation, a shared system prompt) reads only the other blocks from the
cache service and imports the state lean; the held blocks come from its own prefix cache.

Claims, each with its control:
- holding the first `HELD` full blocks, the decode worker asks the cache service for none of them and for every
  other one, counts them in `handoff_local_blocks`, and continues exactly like colocated without recomputing —
  for a whole handoff (one object, one block group: made whole before, imported lean now) and a streamed one;
  with the engine's presence answer forced empty it reads every block, more bytes, and still equals colocated;
- held blocks evicted between the presence answer and the import make the engine compute the request from its
  tokens (`Scheduler.num_import_recomputes`), with the same output.
"""

from __future__ import annotations

import pytest

from engine.memory.manager import PrefixPresence
from tests.integration.mesh_harness import Mesh, greedy, run_bounded, tiny_k3_checkpoint
from tests.integration.test_streamed_handoff import STREAMING, TOKENS, Tap, colocated, long_prompt, reset_decode_cache

HELD = 5  # full blocks of the prompt the decode worker holds before the handoff
BLOCK = 16


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


async def earlier_turn(mesh: Mesh, prompt: list[int]) -> None:
    """Leaves the prompt's first `HELD` full blocks (and no more) in the decode worker's prefix cache."""
    await mesh.run(prompt[:HELD * BLOCK + 3], greedy(1), "local")


def record_block_reads(tap: Tap) -> set[int]:
    """The prompt's full blocks the decode worker asks the cache service for, from now on."""
    asked: set[int] = set()
    tap.edit = lambda keys, got: asked.update(b for b in range(len(tap.hashes)) if tap.blocks(keys, b))
    return asked


@pytest.mark.parametrize("options", [{}, STREAMING], ids=["whole", "streamed"])
def test_a_decode_worker_holding_the_first_blocks_reads_only_the_others(tiny_k3, options):
    async def main():
        async with Mesh(tiny_k3, **options) as mesh:
            engine, counters = mesh.decode_server.engine, mesh.decode_worker.counters
            prompt = long_prompt(200, 40)  # 12 full blocks and an 8-token tail
            reference = await colocated(mesh, prompt)
            real_presence, read = engine.prefix_presence, {}
            for forced_empty in (False, True):  # control: the engine says it holds nothing
                await earlier_turn(mesh, prompt)
                asked = record_block_reads(Tap(mesh, prompt))
                if forced_empty:
                    async def nothing_held(hashes):
                        return PrefixPresence([False] * len(hashes), [False] * len(hashes))
                    engine.prefix_presence = nothing_held
                before = (counters.handoff_local_blocks, counters.handoff_bytes, counters.handoff_loaded,
                          engine.core.scheduler.num_import_recomputes)
                remote = await mesh.run(prompt, greedy(TOKENS), "remote")
                assert remote.ids == reference
                full = len(prompt) // BLOCK
                assert asked == set(range(0 if forced_empty else HELD, full))
                assert counters.handoff_local_blocks - before[0] == (0 if forced_empty else HELD)
                assert counters.handoff_loaded == before[2] + 1
                assert engine.core.scheduler.num_import_recomputes == before[3]  # the carried state was used
                read[forced_empty] = counters.handoff_bytes - before[1]
                engine.prefix_presence = real_presence
                await reset_decode_cache(mesh)
            assert read[False] < read[True]
    run_bounded(main(), 120)


def test_held_blocks_evicted_before_the_import_make_the_engine_recompute(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh:
            engine, counters = mesh.decode_server.engine, mesh.decode_worker.counters
            prompt = long_prompt(200, 41)
            reference = await colocated(mesh, prompt)
            await earlier_turn(mesh, prompt)
            real_presence = engine.prefix_presence

            async def answer_then_evict(hashes):
                answer = await real_presence(hashes)
                await reset_decode_cache(mesh)  # the held blocks leave after the answer, before the import
                return answer
            engine.prefix_presence = answer_then_evict
            recomputes, local = engine.core.scheduler.num_import_recomputes, counters.handoff_local_blocks
            remote = await mesh.run(prompt, greedy(TOKENS), "remote")
            assert remote.ids == reference
            assert counters.handoff_local_blocks - local == HELD  # read as held, then gone
            assert engine.core.scheduler.num_import_recomputes == recomputes + 1
    run_bounded(main(), 120)
