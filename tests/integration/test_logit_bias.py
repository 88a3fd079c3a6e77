"""`logit_bias` end to end: the REST body -> the mesh's `SamplingParams` -> `GenerationRequest` -> both workers' engine
-> the sampler, on the disaggregated path (prefill samples the first token, decode the rest) and the colocated one,
with n-gram speculation on (verification applies the bias too). Negative control: without the bias the same greedy
requests generate other tokens."""

from __future__ import annotations

from engine.tokenizer import KimiTokenizer
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh

MODEL = "tiny-k3"
tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_logit_bias_steers_every_token_on_both_paths(tiny_k3):
    tokenizer = KimiTokenizer.from_pretrained(tiny_k3)
    favoured = tokenizer.encode(" river")[0]
    prompt = tokenizer.encode("the river and the river and the")

    async def completion(gw, **extra) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, **extra}
        reply = await gw.http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["token_ids"]

    async def main():
        async with Mesh(tiny_k3, engine={"speculative_config": NGRAM}) as mesh:
            for colocated in (False, True):
                async with running_gateway(mesh, tiny_k3, parsers=False, colocated=colocated) as gw:
                    assert await completion(gw, logit_bias={str(favoured): 100}) == [favoured] * 8
                    assert await completion(gw) != [favoured] * 8  # negative control: no bias
                    penalised = await completion(gw, logit_bias={str(favoured): -100})
                    assert favoured not in penalised
    run(main(), timeout_s=150)
