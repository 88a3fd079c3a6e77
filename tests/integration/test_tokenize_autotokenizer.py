"""The tokenizer files every generated checkpoint ships load with `transformers.AutoTokenizer`, and give exactly the
ids the served gateway's `/tokenize` returns, on 200 mixed strings (CJK, emoji, code, control-token look-alikes)
for both families. `split_special_tokens=True` is the gateway's rule: user text never becomes a special token."""

from __future__ import annotations


from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh
from tests.unit.engine.test_hf_tokenizer import mixed_strings

import transformers  # noqa: E402  (the dev extra pins it: a missing one fails, never skips)

tiny_k3 = checkpoint_fixture("tiny-k3", "tiny-k3", seed=5)
tiny_linear = checkpoint_fixture("tiny-linear", "tiny-linear", seed=5)


def _compare(model_dir, model_name: str) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(str(model_dir), split_special_tokens=True)
    strings = mixed_strings()

    async def main():
        async with Mesh(model_dir) as mesh, running_gateway(mesh, model_dir) as gw:
            mismatches = []
            for text in strings:
                served = (await gw.http.post("/tokenize", json={"model": model_name, "prompt": text})).json()
                if served["tokens"] != hf.encode(text, add_special_tokens=False):
                    mismatches.append(text)
            assert not mismatches, f"{len(mismatches)} of {len(strings)} differ, e.g. {mismatches[:3]!r}"
            # the comparison can fail: without the gateway's rule, a look-alike becomes a special id
            plain = transformers.AutoTokenizer.from_pretrained(str(model_dir))
            look_alike = "<|open|>" if model_name == "tiny-k3" else "<|im_end|>"
            served = (await gw.http.post("/tokenize", json={"model": model_name, "prompt": look_alike})).json()
            assert served["tokens"] != plain.encode(look_alike, add_special_tokens=False)

    run(main(), timeout_s=240)


def test_autotokenizer_equals_tokenize_k3(tiny_k3):
    _compare(tiny_k3, "tiny-k3")


def test_autotokenizer_equals_tokenize_kimi_linear(tiny_linear):
    _compare(tiny_linear, "tiny-linear")
