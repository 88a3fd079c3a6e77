"""lm-eval's `local-completions` model against the launched mesh (`kdamesh up`): a loglikelihood task and a
generate_until task from tests/e2e/lm_eval_tasks (local JSONL, nothing downloaded; the tokenizer is the server's own
through `tokenizer_backend=remote`: /tokenizer_info, /tokenize, /detokenize). The loglikelihoods lm-eval reports
equal the engine's prompt logprobs of the same tokens (offline, same checkpoint), and the greedy answers equal the
engine's greedy completions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.launched import MODEL, launch, stop

lm_eval = pytest.importorskip("lm_eval")

TASKS = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    launched = launch(tmp_path_factory.mktemp("e2e-lm-eval"), "gateway_grpc ")
    yield launched
    stop(launched.proc)


def _evaluate(port: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_args = {"base_url": f"http://127.0.0.1:{port}/v1/completions", "model": MODEL,
                  "tokenizer_backend": "remote", "num_concurrent": 1, "max_retries": 1, "timeout": 120}
    return simple_evaluate(model="local-completions", model_args=model_args,
                           tasks=["kdamesh_choice", "kdamesh_answer"],
                           task_manager=TaskManager(include_path=str(TASKS)), log_samples=True, batch_size=1)


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) request into token ids (trailing context spaces move on)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids):]


def test_lm_eval_loglikelihoods_equal_the_engine(mesh, monkeypatch):
    from engine import LLM, SamplingParams

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    results = _evaluate(mesh.port)
    llm = LLM(str(mesh.model), kv_cache_memory=8 << 20, enable_prefix_caching=False)
    checked = 0
    for sample in results["samples"]["kdamesh_choice"]:
        for (context, continuation), (loglikelihood, _greedy) in zip(sample["arguments"],
                                                                      [r[0] for r in sample["resps"]]):
            context_ids, continuation_ids = _encode_pair(llm.tokenizer, context, continuation)
            ids = context_ids + continuation_ids
            params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
            lps = llm.generate([{"prompt_token_ids": ids}], params)[0].prompt_logprobs
            expected = sum(lps[p][ids[p]].logprob for p in range(len(context_ids), len(ids)))
            assert abs(loglikelihood - expected) < 1e-4 * len(ids), (context, continuation)
            checked += 1
    assert checked == 8  # every choice of every document
    assert 0 <= results["results"]["kdamesh_choice"]["acc,none"] <= 1

    greedy = SamplingParams(max_tokens=6, temperature=0, stop=["\n"])
    for sample in results["samples"]["kdamesh_answer"]:
        [(context, _kwargs)] = sample["arguments"]
        expected = llm.generate([context], greedy)[0].outputs[0].text
        assert sample["resps"][0][0] == expected
    assert os.environ["HF_HUB_OFFLINE"] == "1"
