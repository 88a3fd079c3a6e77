"""`kdamesh plan --decode-context-parallel-size`: a rank's request holds ceil(context / N) tokens of latents, the
rest of a request is unchanged, and a size that does not divide TP is refused by name (exit 2)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from deploy.plan_cli import main
from engine.model.config import load_model_config
from engine.parallel.config import ParallelError
from engine.plan import PlanArgs, kv_bytes_per_token, plan

K3 = "engine/plan_configs/kimi-k3"
MILLION = 1 << 20


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_dcp8_holds_an_eighth_of_the_latents_per_rank(kv_dtype):
    config = load_model_config(K3)
    base = PlanArgs(tensor_parallel_size=8, enable_expert_parallel=True, gpus=8, gpu_memory=288 * 10**9,
                    context_len=MILLION + 3, kv_cache_dtype=kv_dtype)
    one, eight = plan(config, base), plan(config, replace(base, decode_context_parallel_size=8))
    kv = kv_bytes_per_token(config, 2, kv_dtype)
    assert one.kv_per_token == eight.kv_per_token == kv
    assert one.request_bytes - eight.request_bytes == (MILLION + 3) * kv - (MILLION // 8 + 1) * kv
    assert eight.concurrency > 7 * one.concurrency >= 7


def test_a_size_that_does_not_divide_tp_is_refused(capsys):
    with pytest.raises(ParallelError, match="--decode-context-parallel-size"):
        PlanArgs(tensor_parallel_size=8, decode_context_parallel_size=3)
    assert main([K3, "--tensor-parallel-size", "8", "--decode-context-parallel-size", "16"]) == 2
    assert "--decode-context-parallel-size" in capsys.readouterr().err
