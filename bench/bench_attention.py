"""Benchmark: one MLA layer's paged decode attention vs context length, and grouped vs naive MoE experts (CPU).

Run: `python -m bench.bench_attention [--threads N]` (default: torch's thread count; on a shared machine `--threads 1`
gives steadier numbers). Prints two markdown tables:
1. decode step time (one query token, H=32 heads, Dk=576, v_dim=512, bf16 paged cache, block_size 16, shuffled block
   table) for the registry's CPU backend (torch) beside the naive oracle, at 1K/4K/16K/64K tokens of context, with
   the cost per 1K tokens of context — roughly constant when the step time grows linearly;
2. routed-expert time for T=256 and T=4096 tokens, E=32 experts, top-4 (Kimi Linear widths: D=2304, I=1024, bf16),
   grouped beside naive;
3. split-KV decode on the torch path at 32K and 128K context (same shapes as 1.): process CPU time of the split
   path (`torch_paged.decode_attention`, splits of `DECODE_KEY_ELEMS` gathered values) beside one gather of the
   whole context (unsplit) and the per-sequence chunked path that such contexts took before split-KV (it reads
   `seq_lens` back to the host), repetitions interleaved. `--split-only` runs just this table.
Timings are the best of a few repetitions after a warm-up (the minimum is the least disturbed by other processes
sharing the cores); the whole run takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kernels.attention import torch_paged
from kernels.attention.naive import mla_paged_attention_naive
from kernels.moe.activation import GatedActivation
from kernels.moe.grouped import moe_experts_grouped
from kernels.moe.naive import moe_experts_naive
from kernels.moe.router import route
from kernels.registry import chosen_backend, get_kernel

CONTEXTS = (1024, 4096, 16384, 65536)
MOE_TOKENS = (256, 4096)
SPLIT_CONTEXTS = (32768, 131072)


def _best_ms(fn: Callable[[], object], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _decode_inputs(context: int, heads: int, v_dim: int, rope: int, block_size: int, dtype: torch.dtype):
    num_blocks = -(-context // block_size)
    kv_cache = torch.randn(num_blocks, block_size, v_dim + rope).to(dtype)  # [blocks, block_size, Dk]
    block_tables = torch.randperm(num_blocks, dtype=torch.int32)[None, :]  # [1, blocks], non-contiguous order
    q = torch.randn(1, heads, v_dim + rope).to(dtype)  # one decode token
    cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32)
    seq_lens = torch.tensor([context], dtype=torch.int32)
    return q, kv_cache, block_tables, cu_seqlens_q, seq_lens


def bench_decode(heads: int = 32, v_dim: int = 512, rope: int = 64, block_size: int = 16,
                 dtype: torch.dtype = torch.bfloat16) -> list[tuple[int, float, float]]:
    """[(context, backend ms, naive ms)] for one decode step of one sequence."""
    attention = get_kernel("mla_attention", "cpu")
    scale = (128 + rope) ** -0.5
    rows = []
    for context in CONTEXTS:
        args = _decode_inputs(context, heads, v_dim, rope, block_size, dtype)
        reps = 20 if context <= 4096 else 6
        fast = _best_ms(lambda: attention(*args, scale, v_dim), reps)
        naive = _best_ms(lambda: mla_paged_attention_naive(*args, scale, v_dim), reps)
        rows.append((context, fast, naive))
    return rows


def _cpu_ms(fn: Callable[[], object]) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def bench_split_kv(heads: int = 32, v_dim: int = 512, rope: int = 64, block_size: int = 16,
                   dtype: torch.dtype = torch.bfloat16, reps: int = 3) -> list[tuple[int, int, float, float, float]]:
    """[(context, splits, split ms, unsplit ms, chunked ms)]: best process CPU time of one decode step each."""
    scale = (128 + rope) ** -0.5
    rows = []
    for context in SPLIT_CONTEXTS:
        q, kv_cache, tables, _, seq_lens = _decode_inputs(context, heads, v_dim, rope, block_size, dtype)
        whole = tables.shape[1] * block_size * kv_cache.shape[2]  # gathered values of the whole table
        variants = {
            "split": lambda: torch_paged.decode_attention(q, kv_cache, tables, seq_lens, scale, v_dim),
            "unsplit": lambda: torch_paged.decode_attention(q, kv_cache, tables, seq_lens, scale, v_dim, whole),
            "chunked": lambda: torch_paged._attend_sequence(  # the pre-split-KV fallback for wide tables
                q, kv_cache, tables[0], context, scale, v_dim, torch.empty(1, heads, v_dim, dtype=dtype)),
        }
        best = {name: float("inf") for name in variants}
        for fn in variants.values():  # warm-up
            fn()
        for _ in range(reps):  # interleaved: every variant sees the same machine load
            for name, fn in variants.items():
                best[name] = min(best[name], _cpu_ms(fn))
        splits = -(-tables.shape[1] // max(1, torch_paged.DECODE_KEY_ELEMS // (block_size * kv_cache.shape[2])))
        rows.append((context, splits, best["split"], best["unsplit"], best["chunked"]))
    return rows


def split_table(rows: list[tuple[int, int, float, float, float]]) -> str:
    lines = ["| context (tokens) | splits | split-KV CPU (ms) | unsplit CPU (ms) | chunked CPU (ms) | unsplit / split "
             "| chunked / split |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for context, splits, split, unsplit, chunked in rows:
        lines.append(f"| {context:,} | {splits} | {split:.1f} | {unsplit:.1f} | {chunked:.1f} | "
                     f"{unsplit / split:.2f}x | {chunked / split:.2f}x |")
    return "\n".join(lines)


def bench_moe(experts: int = 32, top_k: int = 4, hidden: int = 2304, inter: int = 1024,
              dtype: torch.dtype = torch.bfloat16) -> list[tuple[int, float, float]]:
    """[(tokens, grouped ms, naive ms)] for the routed experts of one MoE layer."""
    w1 = (torch.randn(experts, inter, hidden) / hidden**0.5).to(dtype)
    w3 = (torch.randn(experts, inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    act = GatedActivation("silu")
    rows = []
    for tokens in MOE_TOKENS:
        x = torch.randn(tokens, hidden).to(dtype)
        weights, ids = route(torch.randn(tokens, experts), torch.zeros(experts), top_k, 1, 1, True, 1.0)
        reps = 10 if tokens <= 256 else 3
        grouped = _best_ms(lambda: moe_experts_grouped(x, w1, w3, w2, weights, ids, act), reps)
        naive = _best_ms(lambda: moe_experts_naive(x, w1, w3, w2, weights, ids, act), reps)
        rows.append((tokens, grouped, naive))
    return rows


def decode_table(rows: list[tuple[int, float, float]], backend: str) -> str:
    base_ctx, base_ms, _ = rows[0]
    lines = [
        f"| context (tokens) | {backend} step (ms) | {backend} ms per 1K ctx | x vs {base_ctx // 1024}K "
        f"(linear = ctx ratio) | naive step (ms) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for context, fast, naive in rows:
        lines.append(f"| {context:,} | {fast:.2f} | {fast / (context / 1024):.3f} | {fast / base_ms:.1f} "
                     f"({context // base_ctx}) | {naive:.2f} |")
    return "\n".join(lines)


def moe_table(rows: list[tuple[int, float, float]]) -> str:
    lines = ["| tokens | grouped (ms) | naive (ms) | speed-up |", "| ---: | ---: | ---: | ---: |"]
    for tokens, grouped, naive in rows:
        lines.append(f"| {tokens:,} | {grouped:.1f} | {naive:.1f} | {naive / grouped:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--split-only", action="store_true", help="only the split-KV table (3.)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    backend = chosen_backend("mla_attention", "cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("## Split-KV torch decode (1 sequence, H=32, Dk=576, v_dim=512, bf16 cache, block 16; process CPU time)\n")
    print(split_table(bench_split_kv()))
    if args.split_only:
        return
    print("\n## MLA paged decode attention (1 sequence, H=32, Dk=576, v_dim=512, bf16 cache, block 16)\n")
    print(decode_table(bench_decode(), backend))
    print("\n## MoE routed experts (E=32, top-4, D=2304, I=1024, bf16)\n")
    print(moe_table(bench_moe()))


if __name__ == "__main__":
    main()
