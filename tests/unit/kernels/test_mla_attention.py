"""MLA attention over a paged latent cache: torch and Triton (interpreter) paths against the naive oracle and a
dense, non-absorbed multi-head reference."""

import pytest
import torch

from kernels.attention import torch_paged
from kernels.attention.flashinfer_mla import paged_kv_indices
from kernels.attention.naive import mla_paged_attention_naive
from tests import triton_child

KV_LORA, ROPE = 32, 16
DK = KV_LORA + ROPE
SCALE = DK**-0.5


def _paged_cache(latents, block_size, spare_blocks=7):
    """Scatters per-sequence latents [S_n, DK] into a NaN-poisoned cache through shuffled block tables."""
    needed = [-(-lat.shape[0] // block_size) for lat in latents]
    num_blocks = sum(needed) + spare_blocks
    cache = torch.full((num_blocks, block_size, DK), float("nan"), dtype=latents[0].dtype)
    tables = torch.full((len(latents), max(needed) + 2), -1, dtype=torch.int32)
    free = torch.randperm(num_blocks).tolist()
    for n, lat in enumerate(latents):
        blocks = [free.pop() for _ in range(needed[n])]
        tables[n, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(lat.shape[0])
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        torch_paged.write_kv_cache(cache, slots, lat)
    return cache, tables


def _batch(seq_lens, q_lens, H, block_size, dtype=torch.float32):
    latents = [torch.randn(s, DK).to(dtype) for s in seq_lens]
    cache, tables = _paged_cache(latents, block_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), H, DK).to(dtype)
    return q, cache, tables, cu, torch.tensor(seq_lens, dtype=torch.int32), latents


MIXED = dict(seq_lens=[19, 7, 33, 1, 16], q_lens=[19, 1, 6, 1, 16])  # prefill, decode, continued prefill, ...


@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_matches_naive_mixed_batch(block_size):
    q, cache, tables, cu, lens, _ = _batch(**MIXED, H=4, block_size=block_size)
    ref = mla_paged_attention_naive(q, cache, tables, cu, lens, SCALE, KV_LORA)
    out = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    assert out.shape == (q.shape[0], 4, KV_LORA)
    assert not ref.isnan().any(), "poisoned cache entries leaked into the reference"
    assert not out.isnan().any(), "poisoned cache entries leaked into the output"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
def test_torch_query_and_key_chunking_matches_naive(monkeypatch, block_size):
    monkeypatch.setattr(torch_paged, "SCORE_TILE_ELEMS", 3 * 4 * 16)  # 3-query chunks (key chunk 8 or 16)
    monkeypatch.setattr(torch_paged, "KEY_CHUNK", 8)  # online softmax across several key chunks
    q, cache, tables, cu, lens, _ = _batch(seq_lens=[40, 25, 9], q_lens=[40, 11, 1], H=4, block_size=block_size)
    ref = mla_paged_attention_naive(q, cache, tables, cu, lens, SCALE, KV_LORA)
    out = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("key_elems", [1 << 24, 40 * DK, 8 * DK])  # one group; groups of 1-2; too long: split-KV
def test_torch_decode_batch_matches_naive(monkeypatch, block_size, key_elems):
    monkeypatch.setattr(torch_paged, "DECODE_KEY_ELEMS", key_elems)
    seq_lens = [19, 1, 33, 4, 16, 5]
    q, cache, tables, cu, lens, _ = _batch(seq_lens, [1] * len(seq_lens), H=4, block_size=block_size)
    ref = mla_paged_attention_naive(q, cache, tables, cu, lens, SCALE, KV_LORA)
    out = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    assert not out.isnan().any(), "poisoned cache entries leaked into the output"
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bf16_output_dtype_and_accuracy():
    q, cache, tables, cu, lens, _ = _batch(**MIXED, H=2, block_size=16, dtype=torch.bfloat16)
    out = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    ref = mla_paged_attention_naive(q, cache, tables, cu, lens, SCALE, KV_LORA)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


def _single(latent, q, q_len, block_size, fn):
    cache, tables = _paged_cache([latent], block_size)
    cu = torch.tensor([0, q_len], dtype=torch.int32)
    return fn(q, cache, tables, cu, torch.tensor([latent.shape[0]], dtype=torch.int32), SCALE, KV_LORA)


@pytest.mark.parametrize("block_size", [4, 16])
def test_continued_prefill_and_decode_equal_full_prefill_rows(block_size):
    S, H = 29, 3
    latent, q = torch.randn(S, DK), torch.randn(S, H, DK)
    attend = torch_paged.mla_paged_attention
    full = _single(latent, q, S, block_size, attend)  # [S, H, V]
    tail = _single(latent, q[-9:], 9, block_size, attend)  # continue after 20 cached positions
    last = _single(latent, q[-1:], 1, block_size, attend)  # decode
    torch.testing.assert_close(tail, full[-9:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=1e-5)


def test_absorbed_equals_dense_multi_head_attention():
    """Attention over [c, k_rope] with the absorbed query equals standard MLA with per-head k_nope/v."""
    S, H, NOPE, V = 21, 4, 12, 10
    c, k_rope = torch.randn(S, KV_LORA, dtype=torch.float64), torch.randn(S, ROPE, dtype=torch.float64)
    w_uk = torch.randn(H, NOPE, KV_LORA, dtype=torch.float64) / KV_LORA**0.5  # kv_b_proj, key half
    w_uv = torch.randn(H, V, KV_LORA, dtype=torch.float64) / KV_LORA**0.5  # kv_b_proj, value half
    q_nope, q_rope = torch.randn(S, H, NOPE, dtype=torch.float64), torch.randn(S, H, ROPE, dtype=torch.float64)
    scale = (NOPE + ROPE) ** -0.5

    # Dense reference: per-head keys [k_nope_h, k_rope] and values v_h, causal softmax.
    k_nope = torch.einsum("hnc,sc->hsn", w_uk, c)  # [H, S, NOPE]
    v = torch.einsum("hvc,sc->hsv", w_uv, c)  # [H, S, V]
    scores = (torch.einsum("thn,hsn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_rope, k_rope)) * scale
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    dense = torch.einsum("hts,hsv->thv", scores.softmax(-1), v)  # [S, H, V]

    # Absorbed: q_c = q_nope_h @ W_UK_h, attend over the latent cache, then project with W_UV_h.
    q_abs = torch.cat([torch.einsum("thn,hnc->thc", q_nope, w_uk), q_rope], dim=-1).float()  # [S, H, DK]
    latent = torch.cat([c, k_rope], dim=-1).float()
    o_latent = _single(latent, q_abs, S, 4, lambda *a: torch_paged.mla_paged_attention(*a[:5], scale, KV_LORA))
    absorbed = torch.einsum("thc,hvc->thv", o_latent.double(), w_uv)
    torch.testing.assert_close(absorbed, dense, atol=1e-4, rtol=1e-4)


def test_write_kv_cache_writes_only_its_slots():
    cache = torch.zeros(3, 4, DK)
    latent = torch.randn(3, DK)
    torch_paged.write_kv_cache(cache, torch.tensor([5, 0, 11]), latent)
    flat = cache.view(-1, DK)
    torch.testing.assert_close(flat[[5, 0, 11]], latent)
    assert flat.abs().sum(-1).nonzero().flatten().tolist() == [0, 5, 11]


def test_decode_attention_width_comes_from_the_table():
    """A decode batch reads nothing back: a table trimmed to the longest sequence's blocks gives the same result as
    one padded with spare (-1) entries (they are masked by seq_lens), and a sequence longer than its table's width
    would not be (negative control: trimming one block too many changes the output)."""
    torch.manual_seed(3)
    cache = torch.randn(8, 4, DK)
    q = torch.randn(2, 2, DK)
    lens = torch.tensor([6, 9])
    tables = torch.tensor([[1, 2, -1, -1], [3, 4, 5, -1]], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2])
    full = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    trimmed = torch_paged.mla_paged_attention(q, cache, tables[:, :3], cu, lens, SCALE, KV_LORA)
    torch.testing.assert_close(trimmed, full)
    short = torch_paged.mla_paged_attention(q, cache, tables[:, :2], cu, lens, SCALE, KV_LORA)
    assert not torch.allclose(short[1], full[1])


def test_flashinfer_page_layout():
    tables = torch.tensor([[7, 2, 9, -1], [4, -1, -1, -1], [1, 3, 5, 6]], dtype=torch.int32)
    indptr, indices = paged_kv_indices(tables, torch.tensor([9, 4, 13]), 4)
    assert indptr.tolist() == [0, 3, 4, 8]
    assert indices.tolist() == [7, 2, 9, 4, 1, 3, 5, 6]


# --- Triton checks: run in one TRITON_INTERPRET=1 child per module, reported by `test_triton_interpreted` ----------
# (tests/triton_child.py says why).

TRITON_CHECKS = triton_child.ChildChecks(__name__)
triton_check = TRITON_CHECKS.check


def _triton_mla():
    """kernels.attention.triton_paged, checked to be built for the Triton interpreter."""
    return triton_child.import_interpreted("kernels.attention.triton_paged", "_mla_paged_kernel")


def _triton_matches_torch(seq_lens, q_lens, H, block_size, dtype=torch.float32, tol=1e-5):
    q, cache, tables, cu, lens, _ = _batch(seq_lens, q_lens, H=H, block_size=block_size, dtype=dtype)
    ref = torch_paged.mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    out = _triton_mla().mla_paged_attention(q, cache, tables, cu, lens, SCALE, KV_LORA)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@triton_check
def triton_mixed_batch_block4():
    _triton_matches_torch(**MIXED, H=3, block_size=4)


@triton_check
def triton_mixed_batch_block16():
    _triton_matches_torch(**MIXED, H=3, block_size=16)


@triton_check
def triton_decode_batch():
    _triton_matches_torch(seq_lens=[5, 40, 17], q_lens=[1, 1, 1], H=5, block_size=4)


@triton_check
def triton_long_prefill_many_heads():
    _triton_matches_torch(seq_lens=[70], q_lens=[70], H=20, block_size=16)  # several tiles and head blocks


@triton_check
def triton_bf16():
    _triton_matches_torch(**MIXED, H=2, block_size=16, dtype=torch.bfloat16, tol=2e-2)


test_triton_interpreted = TRITON_CHECKS.pytest_test()


def test_flashinfer_wrapper_is_planned_once_per_step(monkeypatch):
    """One wrapper per device, planned once per step's metadata: every MLA layer of a step passes the same tensors;
    a new step (new tensors) or an in-place change plans again. FlashInfer itself is CUDA-only: a recording stand-in
    takes its place here, so this checks the planning rule, not the kernel (bench/gpu_validate.py runs that)."""
    import sys
    import types

    from kernels.attention import flashinfer_mla

    plans = []

    class Wrapper:
        def __init__(self, workspace):
            pass

        def plan(self, *args):
            plans.append(args)

        def run(self, q_nope, q_pe, ckv, kpe, return_lse=False):
            return torch.zeros(q_nope.shape)

    fake = types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=Wrapper))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    monkeypatch.setattr(flashinfer_mla, "_workspace", lambda device: None)
    flashinfer_mla.planner.cache_clear()
    cache = torch.zeros(6, 4, DK)
    q = torch.zeros(2, 2, DK)
    step = (torch.tensor([[1, 2], [3, -1]], dtype=torch.int32), torch.tensor([0, 1, 2]), torch.tensor([6, 3]))
    for _layer in range(3):
        flashinfer_mla.mla_paged_attention(q, cache, step[0], step[1], step[2], SCALE, KV_LORA)
    assert len(plans) == 1
    step[2][1] = 4  # the same tensor changed in place: planned again
    flashinfer_mla.mla_paged_attention(q, cache, step[0], step[1], step[2], SCALE, KV_LORA)
    following = (step[0].clone(), step[1].clone(), step[2].clone())  # the next step's tensors
    flashinfer_mla.mla_paged_attention(q, cache, following[0], following[1], following[2], SCALE, KV_LORA)
    assert len(plans) == 3
    flashinfer_mla.planner.cache_clear()
