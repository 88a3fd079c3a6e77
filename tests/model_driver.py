"""Test helper: drives `KimiForCausalLM` for whole sequences without the engine's scheduler.

`SequenceDriver` owns a `CacheTensors` with one contiguous block table per sequence slot and turns
"prefill these tokens" / "decode this token" (and greedy generation) into `ForwardBatch` steps. Tests use it to
compare our logits with reference implementations; it is not part of the engine. `rel_err` is the parity tests'
error measure, `torch_threads` the thread count they run under.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.model import KimiForCausalLM


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|."""
    return float((ours - ref).abs().max() / ref.abs().max())


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Torch's intra-op thread count set to `n` for the body, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SequenceDriver:
    def __init__(self, model: KimiForCausalLM, max_seqs: int = 4, max_len: int = 512, block_size: int = 16,
                 kv_cache_dtype: str = "auto"):
        self.model = model
        self.block_size = block_size
        self.blocks_per_seq = -(-max_len // block_size)
        self.cache = CacheTensors.allocate(model.config, num_blocks=max_seqs * self.blocks_per_seq,
                                           block_size=block_size, num_slots=max_seqs, dtype=model.dtype,
                                           device=model.device, kv_cache_dtype=kv_cache_dtype)
        self.lengths = [0] * max_seqs

    def block_table(self, seq: int) -> torch.Tensor:
        start = seq * self.blocks_per_seq
        return torch.arange(start, start + self.blocks_per_seq, dtype=torch.int32)

    def step(self, chunks: dict[int, list[int]], all_logits: bool = False,
             mm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Feeds `chunks[seq]` new tokens to each listed sequence in one packed batch; returns logits.
        `mm` = (positions in the packed batch [M], embeddings [M, D]) for image features."""
        seqs = sorted(chunks)
        ids, cu, seq_lens, slots = [], [0], [], []
        for s in seqs:
            start = self.lengths[s]
            if start == 0:
                self.cache.zero_slots(torch.tensor([s]))
            table = self.block_table(s)
            for p in range(start, start + len(chunks[s])):
                slots.append(int(table[p // self.block_size]) * self.block_size + p % self.block_size)
            ids.extend(chunks[s])
            cu.append(cu[-1] + len(chunks[s]))
            self.lengths[s] = start + len(chunks[s])
            seq_lens.append(self.lengths[s])
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long),
            cu_seqlens=torch.tensor(cu, dtype=torch.long),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            block_tables=torch.stack([self.block_table(s) for s in seqs]),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            state_indices=torch.tensor(seqs, dtype=torch.long),
            logits_indices=torch.arange(len(ids)) if all_logits else None,
            mm_positions=None if mm is None else mm[0], mm_embeds=None if mm is None else mm[1],
        )
        return self.model(batch.to(self.model.device), self.cache)

    def prefill(self, seq: int, tokens: list[int], all_logits: bool = True,
                mm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self.step({seq: tokens}, all_logits=all_logits, mm=mm)

    def decode(self, seq: int, token: int) -> torch.Tensor:
        return self.step({seq: [token]})[0]

    def greedy(self, seq: int, prompt: list[int], steps: int,
               mm: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
        """`steps` argmax tokens after `prompt` (one prefill, then a decode per token)."""
        logits = self.prefill(seq, prompt, all_logits=False, mm=mm)[0]
        tokens = []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = self.decode(seq, tokens[-1])
        return tokens
