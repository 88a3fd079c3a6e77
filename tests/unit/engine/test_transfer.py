"""Export/import of request state and prefix-cache entries, and the checksummed wire format.

docs/architecture.md's exactly-once handoff: a request exported after its first sampled token and imported
into a fresh engine continues with the same tokens as the colocated run; importing a zeroed KDA state must change
the output (a zeroed recurrent state still produces fluent text, so only an exact comparison catches it).
"""

from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.transfer import (LAYOUT_KV_BLOCK, VERSION_CHUNK_DIGESTS, VERSION_WHOLE_DIGEST, CorruptObjectError,
                             LayoutMismatchError, MissingBlockError, ModelMismatchError, RequestState,
                             ShapeMismatchError, TransferError, VersionMismatchError, lean_handoff, pack,
                             stitch_handoff, unpack)
from tests.unit.engine.conftest import random_prompts

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_k=50, seed=99, ignore_eos=True)


def test_pack_round_trip():
    tensors = {"a": torch.randn(3, 4), "b": torch.randn(2, 5).to(torch.bfloat16),
               "c": torch.arange(7, dtype=torch.uint8), "empty": torch.zeros(0, 3)}
    data = pack(tensors, "test/v1", {"k": [1, 2]})
    assert data[:4] == b"KDAM" and struct.unpack_from("<H", data, 4)[0] == VERSION_WHOLE_DIGEST  # a small object
    out, layout, meta = unpack(data, "test/v1")
    assert layout == "test/v1" and meta == {"k": [1, 2]}
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


@pytest.mark.parametrize("damage", ["payload", "header", "truncate", "extend", "magic"])
def test_corruption_fails_closed(damage):
    data = bytearray(pack({"kv": torch.randn(2, 4, 8)}, LAYOUT_KV_BLOCK, {"hash": "00"}))
    if damage == "payload":
        data[-5] ^= 0x01
    elif damage == "header":
        data[12] ^= 0x01
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\x00"
    else:
        data[0:4] = b"XXXX"
    with pytest.raises(CorruptObjectError):
        unpack(bytes(data))


def test_version_and_layout_mismatch():
    data = bytearray(pack({"x": torch.ones(2)}, LAYOUT_KV_BLOCK))
    with pytest.raises(LayoutMismatchError):
        unpack(bytes(data), "kda_state/v1")
    struct.pack_into("<H", data, 4, VERSION_CHUNK_DIGESTS + 1)
    with pytest.raises(VersionMismatchError):
        unpack(bytes(data))
    assert issubclass(VersionMismatchError, TransferError) and issubclass(TransferError, ValueError)


@pytest.fixture(scope="module")
def engines(tiny_linear_dir):
    args = dict(kv_cache_memory=4 << 20, max_num_seqs=4, snapshot_interval=32, num_snapshot_slots=8)
    return LLM(tiny_linear_dir, **args), LLM(tiny_linear_dir, **args)


@pytest.fixture(scope="module")
def prompt():
    return random_prompts(1, 45, 46, seed=30)[0]


def handoff(llm, prompt, params) -> RequestState:
    first = SamplingParams(**{**vars(params), "max_tokens": 1})
    [out] = llm.generate({"prompt_token_ids": prompt}, first, export=True)
    state = out.exported
    assert state.num_computed_tokens == len(prompt) and state.output_token_ids == out.outputs[0].token_ids
    return RequestState.from_bytes(state.to_bytes())  # through the wire format


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_export_import_continues_exactly(engines, prompt, params):
    a, b = engines
    colocated = a.generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    state = handoff(a, prompt, params)
    assert state.kv.shape[1] == 3 and set(state.state) == {"conv", "recurrent"}
    for llm in (b, a):  # a fresh engine, and the first one
        [out] = llm.resume(state, params, check_integrity=True)
        c = out.outputs[0]
        assert c.token_ids == colocated.token_ids
        assert c.text == colocated.text and c.finish_reason == "length"


def test_zeroed_state_changes_the_output(engines, prompt):
    a, b = engines
    state = handoff(a, prompt, GREEDY)
    expected = b.resume(state, GREEDY)[0].outputs[0].token_ids
    zeroed = RequestState.from_bytes(state.to_bytes())
    zeroed.state = {k: torch.zeros_like(v) for k, v in zeroed.state.items()}
    assert b.resume(zeroed, GREEDY)[0].outputs[0].token_ids != expected


def test_streamed_deltas_of_an_import_hold_only_new_tokens(engines, prompt):
    a, b = engines
    state = handoff(a, prompt, GREEDY)
    engine = b.engine
    engine.import_request("imp", state, GREEDY)
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.extend(out.outputs[0].delta_token_ids)
            final = out
    assert deltas == final.outputs[0].token_ids[1:]  # the carried first token is not streamed again
    assert len(final.outputs[0].token_ids) == MAX_TOKENS


def test_bad_imports_are_refused(engines, prompt, tiny_k3_dir):
    a, b = engines
    state = handoff(a, prompt, GREEDY)
    other = LLM(tiny_k3_dir, kv_cache_memory=4 << 20, max_num_seqs=2)
    with pytest.raises(TransferError, match="fingerprint"):
        other.resume(state, GREEDY)
    broken = RequestState.from_bytes(state.to_bytes())
    broken.kv = broken.kv[:, :1]
    with pytest.raises(CorruptObjectError):
        b.resume(broken, GREEDY)
    done = RequestState.from_bytes(state.to_bytes())
    done.num_computed_tokens = len(done.token_ids)
    with pytest.raises(CorruptObjectError):
        b.resume(done, GREEDY)
    with pytest.raises(InvalidRequestError):
        b.resume(state, SamplingParams(n=2, max_tokens=4))
    assert not b.engine.has_unfinished_requests()


def test_cached_blocks_and_snapshots_move_between_engines(tiny_linear_dir, prompt):
    args = dict(kv_cache_memory=4 << 20, max_num_seqs=4, snapshot_interval=32, num_snapshot_slots=8)
    source, target = LLM(tiny_linear_dir, **args), LLM(tiny_linear_dir, **args)
    [cold] = target.generate({"prompt_token_ids": prompt}, GREEDY)
    target.engine.reset_prefix_cache()
    source.generate({"prompt_token_ids": prompt}, GREEDY)
    src = source.engine
    hashes = list(src.manager.block_pool._cached)
    blocks = src.exchange.export_cached_blocks(hashes)
    snapshots = [src.exchange.export_snapshot(h) for h in src.exchange.snapshot_hashes()]
    assert len(blocks) == len(hashes) >= 2 and snapshots
    dst = target.engine
    assert not dst.exchange.import_snapshot(snapshots[0])  # its blocks are not there yet
    assert dst.exchange.import_cached_blocks(list(blocks.values())) == len(blocks)
    assert all(dst.exchange.import_snapshot(s) for s in snapshots)
    dst.check_integrity()
    [warm] = target.generate({"prompt_token_ids": prompt}, GREEDY, check_integrity=True)
    assert warm.num_cached_tokens == 32
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    corrupt = bytearray(next(iter(blocks.values())))
    corrupt[-1] ^= 0xFF
    with pytest.raises(CorruptObjectError):
        dst.exchange.import_cached_blocks([bytes(corrupt)])


def test_lean_handoff_stitches_back_to_the_whole_state(engines, prompt):
    """Prefill sends the tail block only (`lean_handoff`); decode puts the full blocks back (`stitch_handoff`), and
    the result imports like the whole state. Missing, foreign and mis-shaped pieces are refused by kind."""
    a, b = engines
    state = handoff(a, prompt, GREEDY)
    layout = b.engine.layout
    lean = RequestState.from_bytes(lean_handoff(state).to_bytes())
    assert lean.kv.shape[1] == 1 and len(lean.block_hashes) == 2  # 45 tokens: 2 full blocks of 16 + the tail
    blocks = a.engine.exchange.export_cached_blocks(state.block_hashes)
    whole = stitch_handoff(lean, [blocks[h] for h in lean.block_hashes], layout)
    assert torch.equal(whole.kv, state.kv)
    assert stitch_handoff(state, [None, None], layout) is state  # a full handoff needs no block
    with pytest.raises(MissingBlockError):
        stitch_handoff(lean, [blocks[lean.block_hashes[0]], None], layout)
    with pytest.raises(ModelMismatchError):  # the blocks in the wrong order: each names another block
        stitch_handoff(lean, [blocks[h] for h in reversed(lean.block_hashes)], layout)
    with pytest.raises(ModelMismatchError, match="fingerprint"):
        stitch_handoff(lean, [None, None], dataclasses.replace(layout, fingerprint=b"another model"))
    with pytest.raises(ShapeMismatchError):
        stitch_handoff(dataclasses.replace(state, state={"conv": state.state["conv"]}), [], layout)
    with pytest.raises(CorruptObjectError):
        stitch_handoff(dataclasses.replace(lean, kv=lean.kv[:, :0]), [], layout)
    [out] = b.resume(whole, GREEDY)
    assert out.outputs[0].token_ids == a.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids


def test_an_unseeded_sampled_handoff_carries_its_seed(tiny_linear_dir, engines, prompt):
    """The sampler's state is the sequence's seed (engine/sampling.py): an unseeded request drew one at admission,
    the state carries it, and the importing engine continues exactly as the colocated run."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, ignore_eos=True)
    args = dict(kv_cache_memory=4 << 20, max_num_seqs=4, snapshot_interval=32, num_snapshot_slots=8)
    colocated = LLM(tiny_linear_dir, **args).generate({"prompt_token_ids": prompt}, params)[0].outputs[0]
    state = handoff(LLM(tiny_linear_dir, **args), prompt, params)  # the same engine seed: the same request seed
    assert state.sampling_seed is not None
    b = engines[1]
    assert b.resume(state, params)[0].outputs[0].token_ids == colocated.token_ids
    other = dataclasses.replace(state, sampling_seed=state.sampling_seed + 1)  # negative control: another seed
    assert b.resume(other, params)[0].outputs[0].token_ids != colocated.token_ids
