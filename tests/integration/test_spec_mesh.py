"""Speculative decoding through the mesh: with `--speculative-config` (n-gram, and K3's MTP layer, and a DSpark
drafter) on both workers, disaggregated
(prefill -> handoff -> decode, which speculates after the handoff) equals colocated, and both equal the plain
engine without speculation, token for token; the decode worker did verify drafts, and its pools end intact."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling import SamplingParams
from engine.model.checkpoint import make_checkpoint
from tests.integration.mesh_harness import (CHECKPOINT_SEED, Mesh, assert_all_free, engine_args, greedy, run_bounded,
                                            tiny_k3_checkpoint)

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_k3(tmp_path_factory):
    return tiny_k3_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    return make_checkpoint("tiny-k3-dspark", tmp_path_factory.mktemp("tiny-k3-dspark"), seed=CHECKPOINT_SEED)


@pytest.fixture(params=["ngram", "mtp", "dspark"])
def spec_config(request, dspark):
    if request.param == "ngram":
        return NGRAM
    extra = {"model": str(dspark)} if request.param == "dspark" else {}
    return {"method": request.param, "num_speculative_tokens": 3, **extra}


def test_disaggregated_speculation_equals_colocated_and_plain(tiny_k3, spec_config):
    base = [101, 202, 303, 404, 505, 606, 707, 808, 909, 111, 222, 333]
    plain = LLM(tiny_k3, **{k: v for k, v in vars(engine_args(tiny_k3)).items() if k != "model"})
    first = plain.generate([base], SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))[0]
    prompts = [base, base + first.outputs[0].token_ids + base, base[:5] * 4]  # the lookup finds earlier turns
    want = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))]

    async def main():
        async with Mesh(tiny_k3, engine={"speculative_config": spec_config}) as mesh:
            for prompt, expected in zip(prompts, want):
                remote = await mesh.run(prompt, greedy(MAX_TOKENS), "remote")
                local = await mesh.run(prompt, greedy(MAX_TOKENS), "local")
                assert remote.route == "remote" and local.route == "local"
                assert remote.ids == local.ids == expected
            stats = await mesh.decode_server.engine.stats()
            assert stats.spec_num_drafts > 0
            await assert_all_free(mesh.decode_server.engine)
    run_bounded(main(), 90.0)
