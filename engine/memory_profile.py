"""Pool memory from a fraction of the device (`--gpu-memory-utilization`, vLLM's meaning), by a profile run.

Contract:
- `profiled_kv_budget(args, model) -> ProfileResult | None`: None when `args.gpu_memory_utilization` is unset (the
  pools then take `--kv-cache-memory`, engine/config.py). Else the bytes the KV block and KDA state pools get:
  `total * fraction - in_use - activation_peak`, where
  - CUDA: `total` is the device's memory (`torch.cuda.mem_get_info`), `in_use` what is used on it after loading
    (total - free: the weights, the CUDA/NCCL context, anything else on the device), `activation_peak` the most
    bytes the profile steps allocated above what was allocated before them (`max_memory_allocated`).
  - CPU: `total` is `args.cpu_memory` (`--cpu-memory`), else the machine's physical memory; `in_use` this process's
    resident memory after loading (weights, libraries, allocator); `activation_peak` the resident high-water mark
    during the profile steps above the resident memory before them (free heap pages are first returned with
    glibc's `malloc_trim`, so activations cannot hide in them; `/proc/self/clear_refs` resets the mark;
    where it cannot, the mark since start-up counts, with a warning: larger, never smaller).
  A budget of zero or less raises `EngineConfigError` naming gpu_memory_utilization, with every term.
- The profile steps are the largest forwards the engine runs (`profile_batches`): one prefill piece of
  `min(max_num_batched_tokens, the runner's forward limit)` tokens from position 0, and with speculative decoding a
  verification of `max_num_seqs` sequences of `1 + k` positions (each position's KDA state kept, as the runner
  does), both in a throw-away cache of just the blocks and slots they touch (allocated before the peak is reset,
  freed after); then, with a vision encoder (`media`, rank 0's `engine.vision.feed.MediaSetup`), the encoder on
  the largest image the processor admits (`largest_image_grid`: `in_patch_limit` patches, square, whole merge
  kernels, within `patch_limit_on_one_side`). What is not profiled stays in the `1 - fraction` headroom:
  compiled / captured decode steps, several images in one step, drafter weights loaded after the pools.
- Under tensor parallelism every rank runs it together (the forward is a collective; the engine's executor starts
  it on every rank, engine/parallel/executor.py `profile`): each rank measures its own device (on CPU its own
  process against `--cpu-memory`, per rank), and every rank returns the tightest rank's result (the smallest
  budget), so all ranks size the same pools.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
from dataclasses import dataclass

import torch

from engine.config import EngineArgs, parse_bytes
from engine.errors import EngineConfigError
from engine.model.batch import CacheTensors, ForwardBatch
from engine.model.model import KimiForCausalLM
from engine.runner import CPU_FORWARD_TOKENS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileResult:
    total: int  # bytes the fraction applies to
    fraction: float
    in_use: int  # after loading, before the pools
    activation_peak: int  # the profile steps' peak above what they started from
    profiled_tokens: int  # tokens of the largest profile step

    @property
    def kv_budget(self) -> int:
        return int(self.total * self.fraction) - self.in_use - self.activation_peak


def profile_batches(args: EngineArgs, block_size: int, device_type: str, vocab: int) -> list[ForwardBatch]:
    """The largest prefill piece and (speculating) the largest verification, on blocks / slots from 0."""
    limit = args.max_forward_tokens or (CPU_FORWARD_TOKENS if device_type == "cpu" else 1 << 62)
    tokens = min(args.max_num_batched_tokens, limit)
    batches = [_batch([tokens], block_size, vocab, keep_states=False)]
    k = args.num_speculative_tokens
    if k:
        seqs = max(1, min(args.max_num_seqs, tokens // (1 + k)))
        batches.append(_batch([1 + k] * seqs, block_size, vocab, keep_states=True))
    return batches


def _batch(lengths: list[int], block_size: int, vocab: int, keep_states: bool) -> ForwardBatch:
    """Sequences of `lengths` new tokens from position 0, each on its own blocks; verification: out-slots."""
    ids, cu, slots, out_slots, tables = [], [0], [], [], []
    next_block, next_slot = 0, len(lengths)
    blocks_each = max(-(-n // block_size) for n in lengths)
    for n in lengths:
        blocks = list(range(next_block, next_block + blocks_each))
        next_block += blocks_each
        ids.extend((7 * i + 3) % vocab for i in range(n))
        cu.append(cu[-1] + n)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(n))
        tables.append(blocks)
        if keep_states:
            out_slots.extend(range(next_slot, next_slot + n))
            next_slot += n
    last = torch.tensor(cu[1:]) - 1
    return ForwardBatch(torch.tensor(ids), torch.tensor(cu), torch.tensor(lengths), torch.tensor(tables,
                        dtype=torch.int32), torch.tensor(slots), torch.arange(len(lengths)),
                        logits_indices=torch.arange(cu[-1]) if keep_states else last,
                        state_out_slots=torch.tensor(out_slots) if keep_states else None)


def _cache_for(model: KimiForCausalLM, batches: list[ForwardBatch], block_size: int,
               kv_cache_dtype: str) -> CacheTensors:
    blocks = max(int(b.block_tables.numel()) for b in batches) + 1
    slots = max(b.num_seqs + (int(b.num_tokens) if b.state_out_slots is not None else 0) for b in batches) + 1
    return CacheTensors.allocate(model.config, num_blocks=blocks, block_size=block_size, num_slots=slots,
                                 dtype=model.dtype, device=model.device, kda_heads=model.num_local_kda_heads,
                                 kv_cache_dtype=kv_cache_dtype)


def largest_image_grid(processor) -> tuple[int, int]:
    """(h, w) patches of the largest image `processor` (a `ProcessorConfig`) lets through: square, in whole merge
    kernels, at most `in_patch_limit` patches and `patch_limit_on_one_side` per side."""
    k = processor.merge_kernel_size
    side = min(math.isqrt(processor.in_patch_limit), processor.patch_limit_on_one_side) // k * k
    return side, side


def _encode_largest_image(media) -> None:
    encoder, (h, w) = media.feeder.encoder, largest_image_grid(media.processor)
    p = media.processor.patch_size
    pixels = torch.zeros(h * w, 3, p, p, device=encoder.device)  # [L, 3, p, p]
    encoder(pixels, torch.tensor([[1, h, w]]))


def profiled_kv_budget(args: EngineArgs, model: KimiForCausalLM, media=None) -> ProfileResult | None:
    if args.gpu_memory_utilization is None:
        return None
    device = model.device
    batches = profile_batches(args, args.block_size, device.type, model.config.vocab_size)
    meter = CudaMeter(device) if device.type == "cuda" else HostMeter(args)
    in_use = meter.in_use()
    rows = args.block_size // args.decode_context_parallel_size  # a rank's rows of a block (DCP: 1/N)
    cache = _cache_for(model, batches, rows, args.kv_cache_dtype)
    meter.start()
    with torch.no_grad():
        for batch in batches:
            model(batch.to(device), cache)
        if media is not None and media.feeder is not None:
            _encode_largest_image(media)
    peak = meter.peak()
    del cache
    result = _tightest(model, ProfileResult(meter.total(), args.gpu_memory_utilization, in_use, peak,
                                            max(b.num_tokens for b in batches)))
    logger.info("memory profile on %s: %.2f GiB x %.2f - %.2f GiB in use - %.2f GiB activations (%d-token step) "
                "= %.2f GiB for the KV and state pools", device.type, result.total / 2**30, result.fraction,
                result.in_use / 2**30, result.activation_peak / 2**30, result.profiled_tokens,
                result.kv_budget / 2**30)
    if result.kv_budget <= 0:
        raise EngineConfigError(
            f"--gpu-memory-utilization {result.fraction}: {result.total} B x {result.fraction} leaves nothing for the "
            f"KV and state pools after {result.in_use} B in use (weights, runtime) and {result.activation_peak} B "
            f"of activations at {result.profiled_tokens} tokens; raise it, lower --max-num-batched-tokens, or size "
            f"the pools with --kv-cache-memory")
    return result


def _tightest(model: KimiForCausalLM, mine: ProfileResult) -> ProfileResult:
    """Every rank's result -> the one with the smallest budget, on every rank (one all-gather)."""
    ctx = model.ctx
    if ctx.size == 1:
        return mine
    terms = torch.tensor([[mine.total, mine.in_use, mine.activation_peak]], dtype=torch.float64)
    every = ctx.all_gather(terms.to(model.device), dim=0).cpu()  # [ranks, 3]
    budgets = (every[:, 0] * mine.fraction).floor() - every[:, 1] - every[:, 2]
    total, in_use, peak = (int(v) for v in every[int(budgets.argmin())].tolist())
    return ProfileResult(total, mine.fraction, in_use, peak, mine.profiled_tokens)


class CudaMeter:
    def __init__(self, device: torch.device):
        self.device = device
        self._base = 0

    def total(self) -> int:
        return torch.cuda.mem_get_info(self.device)[1]

    def in_use(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def start(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self._base


class HostMeter:
    """This process's resident memory (/proc/self/status), for the CPU meaning of the fraction."""

    def __init__(self, args: EngineArgs):
        self.budget = parse_bytes(args.cpu_memory, "cpu_memory") if args.cpu_memory is not None else None
        self._base = 0

    def total(self) -> int:
        return self.budget if self.budget is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def in_use(self) -> int:
        return _status_bytes("VmRSS")

    def start(self) -> None:
        _return_free_heap()  # freed memory still resident would hold the steps' activations unseen
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the resident high-water mark restarts at the current resident size
        except OSError as exc:  # a kernel or sandbox without it: the mark since start-up (larger, still safe)
            logger.warning("cannot reset the resident high-water mark (%s): the profile counts the process's "
                           "peak since start-up", exc)
        self._base = _status_bytes("VmRSS")

    def peak(self) -> int:
        return max(0, _status_bytes("VmHWM") - self._base)


def _return_free_heap() -> None:
    """glibc's `malloc_trim(0)`: free heap pages go back to the system, so activations allocated next raise the
    resident size (in a long-lived process they would otherwise reuse freed, still-resident pages). A no-op off
    glibc."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")
