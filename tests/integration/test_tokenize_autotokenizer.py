"""The tokenizer files every generated checkpoint ships load with `transformers.AutoTokenizer`, and give exactly the
ids the served gateway's `/tokenize` returns for a completions prompt, on 200 mixed strings (CJK, emoji, code,
control-token text) for both families: by default as `AutoTokenizer.encode(text)` (control-token text becomes the
control token, as on vLLM), with the request's `split_special_tokens: true` as transformers' `split_special_tokens`
(plain text)."""

from __future__ import annotations


from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh
from tests.unit.engine.test_hf_tokenizer import mixed_strings

import transformers  # noqa: E402  (the dev extra pins it: a missing one fails, never skips)

tiny_k3 = checkpoint_fixture("tiny-k3", "tiny-k3", seed=5)
tiny_linear = checkpoint_fixture("tiny-linear", "tiny-linear", seed=5)


def _compare(model_dir, model_name: str) -> None:
    hf = {split: transformers.AutoTokenizer.from_pretrained(str(model_dir), split_special_tokens=split)
          for split in (False, True)}
    strings = mixed_strings()
    control = "<|open|>" if model_name == "tiny-k3" else "<|im_end|>"
    assert any(control in text for text in strings)

    async def main():
        async with Mesh(model_dir) as mesh, running_gateway(mesh, model_dir) as gw:
            for split in (False, True):
                mismatches = []
                for text in strings:
                    body = {"model": model_name, "prompt": text, "split_special_tokens": split}
                    served = (await gw.http.post("/tokenize", json=body)).json()
                    if served["tokens"] != hf[split].encode(text, add_special_tokens=False):
                        mismatches.append(text)
                assert not mismatches, f"split={split}: {len(mismatches)} of {len(strings)} differ: {mismatches[:3]!r}"
            # the comparison can fail: the two readings of control-token text differ, and the default is vLLM's
            served = (await gw.http.post("/tokenize", json={"model": model_name, "prompt": control})).json()
            assert served["tokens"] == hf[False].encode(control, add_special_tokens=False)
            assert served["tokens"] != hf[True].encode(control, add_special_tokens=False)
            assert len(served["tokens"]) == 1

    run(main(), timeout_s=240)


def test_autotokenizer_equals_tokenize_k3(tiny_k3):
    _compare(tiny_k3, "tiny-k3")


def test_autotokenizer_equals_tokenize_kimi_linear(tiny_linear):
    _compare(tiny_linear, "tiny-linear")
