"""kernels/attention/mla_prefill.py: the non-absorbed MLA prefill equals the absorbed form (the naive oracle) on
random inputs — mixed batches, chunked keys and queries, an FP8 cache — and the whole model's greedy tokens and
logits are the same with it on or off (both families)."""

import pytest
import torch

from engine.model.checkpoint import make_checkpoint
from engine.model.loader import load_model
from kernels.attention import mla_prefill, torch_paged
from kernels.attention.mla_prefill import mla_prefill_attention, non_absorbed_min_queries
from kernels.attention.naive import mla_paged_attention_naive
from tests.model_driver import SequenceDriver

H, NOPE, ROPE, V, LORA = 3, 8, 4, 8, 16
SCALE = (NOPE + ROPE) ** -0.5


def _case(seq_lens, q_lens, block_size, fp8=False):
    """Random non-absorbed queries, kv_b weights and a paged latent cache; also the absorbed oracle's output."""
    w_uk, w_uv = torch.randn(H, NOPE, LORA) * 0.3, torch.randn(H, V, LORA) * 0.3
    needed = [-(-s // block_size) for s in seq_lens]
    width = LORA + ROPE + (4 if fp8 else 0)
    cache = torch.full((sum(needed) + 3, block_size, width), 255 if fp8 else float("nan"),
                       dtype=torch.uint8 if fp8 else torch.float32)
    tables = torch.full((len(seq_lens), max(needed) + 1), -1, dtype=torch.int32)
    free = torch.randperm(cache.shape[0]).tolist()
    for n, s in enumerate(seq_lens):
        blocks = [free.pop() for _ in range(needed[n])]
        tables[n, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(s)
        torch_paged.write_kv_cache(cache, torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size,
                                   torch.randn(s, LORA + ROPE))
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q = torch.randn(cu[-1], H, NOPE + ROPE)
    q_abs = torch.cat([torch.einsum("thn,hnl->thl", q[..., :NOPE], w_uk), q[..., NOPE:]], dim=-1)
    lens = torch.tensor(seq_lens)
    o_latent = mla_paged_attention_naive(q_abs, cache, tables, torch.tensor(cu), lens, SCALE, LORA)
    oracle = torch.einsum("thl,hvl->thv", o_latent, w_uv)
    return q, cache, w_uk, w_uv, tables, (cu, seq_lens), oracle


@pytest.mark.parametrize("min_queries", [1, 6, 1 << 30], ids=["all-non-absorbed", "split", "all-absorbed"])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_equals_the_absorbed_oracle(min_queries, fp8, monkeypatch):
    monkeypatch.setattr(mla_prefill, "KEY_CHUNK", 8)  # several key chunks merged by the online softmax
    monkeypatch.setattr(mla_prefill, "SCORE_TILE_ELEMS", H * 8 * 3)  # 3-query chunks
    torch.manual_seed(0)
    q, cache, w_uk, w_uv, tables, host, oracle = _case([37, 9, 20, 1], [37, 1, 12, 1], block_size=4, fp8=fp8)
    out = mla_prefill_attention(q, cache, w_uk, w_uv, tables, host, SCALE, min_queries)
    assert not out.isnan().any(), "poisoned cache entries leaked"
    torch.testing.assert_close(out, oracle, atol=1e-5, rtol=1e-5)


def test_negative_control_a_wrong_value_projection_is_caught():
    torch.manual_seed(1)
    q, cache, w_uk, w_uv, tables, host, oracle = _case([30], [30], block_size=8)
    out = mla_prefill_attention(q, cache, w_uk, w_uv * 1.01, tables, host, SCALE, 1)
    assert not torch.allclose(out, oracle, atol=1e-5, rtol=1e-5)


def test_break_even_from_the_dims():
    assert non_absorbed_min_queries(512, 128, 64, 128) == 171  # K3 / Kimi Linear: prompts of 171+ tokens a step
    assert non_absorbed_min_queries(32, 16, 8, 16) == 32


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-linear"])
def test_whole_model_greedy_and_logits_equal_with_and_without(preset, tmp_path):
    model = load_model(make_checkpoint(preset, tmp_path / preset, seed=3))
    mixers = [layer.self_attn for layer in model.model.layers if layer.spec.mixer == "mla"]
    prompt = [(37 * i + 11) % 7900 for i in range(70)]

    def run(min_queries: int):
        for m in mixers:
            m.min_prefill_queries = min_queries
        driver = SequenceDriver(model, max_seqs=1, max_len=128)
        logits = driver.prefill(0, prompt[:40])  # a first chunk, then a continued one over the cached context
        logits = torch.cat([logits, driver.prefill(0, prompt[40:])])  # [70, V]
        tokens = SequenceDriver(model, max_seqs=1, max_len=128).greedy(0, prompt, 8)
        return logits, tokens

    absorbed, absorbed_tokens = run(1 << 30)
    non_absorbed, tokens = run(2)
    torch.testing.assert_close(non_absorbed, absorbed, atol=2e-4, rtol=2e-4)
    assert tokens == absorbed_tokens
    assert not torch.equal(non_absorbed, absorbed), "the non-absorbed path did not run"
