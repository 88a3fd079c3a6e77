"""The engine's outbox: snapshots leaving the prefix cache come out with their blocks, and imported elsewhere they
resume exactly (hit == miss); a corrupted one is refused; a handoff's turn end comes out with its output blocks only.

This is the engine half of offloading (the worker half, through a real cache service, is
tests/integration/test_prefix_reuse.py).
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.transfer import CorruptObjectError, encode_block, encode_state
from tests.unit.engine.conftest import random_prompts
from tests.unit.engine.test_prefix_reuse import GREEDY, cold, one_by_one, run, warm  # noqa: F401 (fixture)

BS = 16


def exported_objects(llm: LLM, export) -> tuple[list[bytes], bytes]:
    fp = llm.engine.layout.fingerprint
    return ([encode_block(kv, h, fp) for h, kv in export.blocks],
            encode_state(export.state, export.block_hash, fp))


def test_an_evicted_hint_snapshot_comes_out_whole_and_resumes_elsewhere(tiny_k3_dir, cold):  # noqa: F811
    systems = random_prompts(3, 200, 201, seed=60)
    prompts = [s + u for s, u in zip(systems, random_prompts(3, 20, 21, seed=61))]
    llm = warm(tiny_k3_dir, num_snapshot_slots=2)
    llm.engine.exchange.exporting = True
    one_by_one(llm, prompts, [[200]] * 3)  # three hinted systems in two slots: the first hint is evicted
    exports = llm.engine.exchange.take_outbox()
    assert "evicted" in {e.reason for e in exports}  # (and turn ends whose prompt blocks went out before)
    sent = [h for e in exports for h, _ in e.blocks]
    assert len(sent) == len(set(sent))  # every block goes out once, with the first export that needs it
    [export] = [e for e in exports if e.reason == "evicted" and e.block_hash == _hashes(llm, systems[0])[11]]
    fp = llm.engine.layout.fingerprint
    blocks = [encode_block(kv, h, fp) for e in exports for h, kv in e.blocks]
    state = encode_state(export.state, export.block_hash, fp)
    fresh = warm(tiny_k3_dir)
    assert fresh.engine.exchange.import_prefix(blocks, state)
    again = systems[0] + random_prompts(1, 25, 26, seed=62)[0]
    ids, cached = run(fresh, [again])
    assert cached == [192] and ids == run(cold, [again])[0]
    assert llm.engine.stats().num_snapshot_exports >= 1


def test_a_corrupted_exported_snapshot_is_refused(tiny_k3_dir):
    llm = warm(tiny_k3_dir, num_snapshot_slots=1)
    llm.engine.exchange.exporting = True
    one_by_one(llm, random_prompts(3, 40, 41, seed=63))
    [export, *_] = llm.engine.exchange.take_outbox()
    blocks, state = exported_objects(llm, export)
    poisoned = bytearray(state)
    poisoned[-5] ^= 0x40  # one bit of the recurrent state's payload
    fresh = warm(tiny_k3_dir)
    fresh.engine.exchange.import_cached_blocks(blocks)
    with pytest.raises(CorruptObjectError):
        fresh.engine.exchange.import_snapshot(bytes(poisoned))
    assert fresh.engine.stats().num_snapshots == 0


def test_a_handoff_turn_end_comes_out_with_its_output_blocks_only(tiny_k3_dir, cold):  # noqa: F811
    prompt = random_prompts(1, 100, 101, seed=64)[0]
    prefill, decode = warm(tiny_k3_dir), warm(tiny_k3_dir)
    [first] = prefill.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0,
                                                                           ignore_eos=True), export=True)
    decode.engine.exchange.exporting = True
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    [out] = decode.resume(first.exported, params, check_integrity=True)
    [turn_end] = [e for e in decode.engine.exchange.take_outbox() if e.reason == "turn_end"]
    assert turn_end.num_tokens == (100 + 30 - 1) // BS * BS == 128
    # the handoff's 6 full blocks are in the cache service already: blocks 6 (prompt tail + output) and 7 go out
    assert [h for h, _ in turn_end.blocks] == _hashes(decode, prompt + out.outputs[0].token_ids)[6:8]
    nxt = prompt + out.outputs[0].token_ids + [3] * 10
    fresh = warm(tiny_k3_dir)
    fresh.engine.exchange.import_cached_blocks(list(prefill.engine.exchange.export_cached_blocks(
        first.exported.block_hashes).values()))
    assert fresh.engine.exchange.import_prefix(*exported_objects(decode, turn_end))
    ids, cached = run(fresh, [nxt], params=GREEDY)
    assert cached == [128] and ids == run(cold, [nxt])[0]


def _hashes(llm: LLM, ids: list[int]) -> list[bytes]:
    from engine.memory.hashing import BlockHasher, root_hash

    hashes: list[bytes] = []
    BlockHasher(BS, root_hash(llm.engine.layout.fingerprint, None)).extend(hashes, ids)
    return hashes
