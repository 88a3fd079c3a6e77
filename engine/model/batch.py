"""What one model step reads and writes: the packed token batch and the cache tensors.

Contract:
- `ForwardBatch` packs N sequences' new tokens back to back (no padding). Sequence n has `query_lens[n]` new tokens,
  which are its last positions: `seq_lens[n] - query_lens[n] … seq_lens[n] - 1`. Before the step, the MLA cache
  already holds that sequence's earlier tokens in the blocks of `block_tables[n]`, and state slot `state_indices[n]`
  holds its KDA conv window and recurrent state after `seq_lens[n] - query_lens[n]` tokens (zeros for a fresh one).
- After `KimiModel.forward`, the MLA latents of the new tokens are written at `slot_mapping` and the state slot holds
  the state after all `seq_lens[n]` tokens. Nothing else in the cache is touched.
- With `mm_embeds` / `mm_positions` set, row `mm_positions[i]` of the step enters the model as `mm_embeds[i]`
  instead of its token's embedding (K3 image features at `<|media_pad|>` tokens); nothing else changes.
- With `state_out_slots` set (speculative verification, engine/spec/), sequence n still starts from slot
  `state_indices[n]`, but the KDA state (conv window and recurrent state) after each new token t goes to slot
  `state_out_slots[t]` when that is >= 0 and nowhere when it is -1; the in-slot changes only where it is named.
- `host` (`HostMeta`, optional): what the runner knows of the index tensors on the host (cu_seqlens, seq_lens,
  consecutive state slots, verification out-slots), so ops never read them back from the device. `traced=True`
  marks a batch run by a compiled or captured decode step (engine/decode_graphs.py): the model then reaches the
  caches through `kernels.graph_ops`' custom ops and uses no host metadata, so the traced graph holds no Python
  value that changes between steps. With `inline_cache_ops` as well (a CPU step compiled by inductor) the KDA
  conv and recurrent updates are traced as plain torch ops on the state pools, which inductor fuses with the math
  around them and writes in place (`kernels.graph_ops.conv_decode_step` / `kda_decode_step`).
- `CacheTensors` holds per-layer tensors only; which blocks and slots belong to whom is the engine's business.
  Under tensor parallelism a rank's state slots hold its `kda_heads` = H/N heads (conv channels `3*(H/N)*D`);
  the MLA latent cache is replicated (every rank writes the same latents), except under decode-context
  parallelism, where a rank's blocks hold `block_size / N` rows: its share of the tokens (engine/parallel/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig
from engine.plan import kv_bytes_per_token, state_bytes_per_request
from kernels.attention.fp8_latent import allocate_latent_cache


@dataclass(frozen=True)
class HostMeta:
    """Host copies of a batch's index tensors (the runner built them from these ints)."""

    cu_seqlens: tuple[int, ...]  # [N+1]
    seq_lens: tuple[int, ...]  # [N]
    state_slots: slice | None = None  # `state_indices` as a slice when they are consecutive (kernels/indexing.py)
    out_slots: tuple[int, ...] | None = None  # [T] `state_out_slots` (verification)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64, the new tokens of all sequences, packed
    cu_seqlens: torch.Tensor  # [N+1] int64, offsets of each sequence's new tokens in input_ids
    seq_lens: torch.Tensor  # [N] int64, tokens in the context after this step (cached + new)
    block_tables: torch.Tensor  # [N, max_blocks] int32, MLA cache blocks per sequence
    slot_mapping: torch.Tensor  # [T] int64, block * block_size + offset of each new token
    state_indices: torch.Tensor  # [N] int64, KDA state slot per sequence
    logits_indices: torch.Tensor | None = None  # [L] int64 rows of input_ids to score; None: last of each sequence
    mm_embeds: torch.Tensor | None = None  # [M, hidden] input embeddings (image features) used instead of tokens'
    mm_positions: torch.Tensor | None = None  # [M] int64 rows of input_ids whose embedding mm_embeds replaces
    state_out_slots: torch.Tensor | None = None  # [T] int64 KDA slot receiving the state after each token (-1: none)
    host: HostMeta | None = None  # host copies of the index tensors (None: ops read the tensors)
    traced: bool = False  # run by a compiled or captured decode step: cache ops as kernels.graph_ops custom ops
    inline_cache_ops: bool = False  # traced by inductor on CPU: the KDA cache ops inline (kernels/graph_ops.py)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_lens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]  # [N]

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence adds exactly one token: the single-step kernels apply."""
        return self.num_tokens == self.num_seqs

    def last_token_indices(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - 1  # [N]

    def to(self, device: torch.device) -> "ForwardBatch":
        moved = {name: (t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in vars(self).items()}
        return ForwardBatch(**moved)


@dataclass
class CacheTensors:
    """Per-layer cache storage, indexed by the model's layer index."""

    block_size: int
    kv: dict[int, torch.Tensor]  # MLA layer -> [num_blocks, block_size, kv_lora + rope] (FP8: uint8, + 4 scale bytes)
    conv: dict[int, torch.Tensor]  # KDA layer -> [num_slots, 3*H*D, conv_kernel - 1]
    recurrent: dict[int, torch.Tensor]  # KDA layer -> [num_slots, H, D, D] fp32
    graph_key: int = 0  # kernels.graph_ops.register_cache's key, set by the decode graphs that trace these caches

    @classmethod
    def allocate(cls, config: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kda_heads: int | None = None,
                 kv_cache_dtype: str = "auto", layers: range | None = None) -> "CacheTensors":
        """`kda_heads`: the KDA heads of this rank's slots (None: all of the model's). `kv_cache_dtype` 'fp8' /
        'fp8_e4m3': the MLA latents as FP8 rows (kernels/attention/fp8_latent.py); 'auto': `dtype`. `layers`: the
        decoder layers this rank's pipeline stage owns (None: all); other layers get no cache."""
        fp8 = kv_cache_dtype in ("fp8", "fp8_e4m3")
        owned = range(config.num_hidden_layers) if layers is None else layers
        kv = {i: allocate_latent_cache(num_blocks, block_size, config.mla.cache_dim, fp8, dtype, device)
              for i in config.mla_layer_ids if i in owned}
        conv, recurrent = {}, {}
        if config.kda is not None:
            k = config.kda
            heads = k.num_heads if kda_heads is None else kda_heads
            width = 3 * heads * k.head_dim
            for i in (i for i in config.kda_layer_ids if i in owned):
                conv[i] = torch.zeros(num_slots, width, k.conv_kernel_size - 1, dtype=dtype, device=device)
                recurrent[i] = torch.zeros(num_slots, heads, k.head_dim, k.head_dim,
                                           dtype=torch.float32, device=device)
        return cls(block_size=block_size, kv=kv, conv=conv, recurrent=recurrent)

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Resets KDA state slots for fresh sequences."""
        for t in list(self.conv.values()) + list(self.recurrent.values()):
            t[slots] = 0

    def copy_slot(self, src: int, dst: int) -> None:
        for t in list(self.conv.values()) + list(self.recurrent.values()):
            t[dst].copy_(t[src])


def bytes_per_token(config: ModelConfig, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """MLA cache bytes one token of context costs across all layers."""
    return kv_bytes_per_token(config, dtype_bytes, kv_cache_dtype)


def bytes_per_state(config: ModelConfig, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """KDA bytes one request's state slot costs across all layers (conv window in model dtype, state in fp32), on
    one rank of `tensor_parallel_size` (its H/N heads)."""
    return state_bytes_per_request(config, dtype_bytes, tensor_parallel_size)
