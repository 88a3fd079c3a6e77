"""The `dspark` drafter (engine/spec/drafter.py contract) and its checkpoint folder I/O.

Contract (beyond the drafter contract; the model and folder format are engine/spec/dspark_model.py's):
- `taps` = the drafter config's `target_layer_ids`: the layer-output streams of those target layers
  (engine/model/model.py states the capture rule).
- Per request the drafter keeps each DSpark layer's latent context cache, one row per observed position; a row is
  a function of that position's tapped target rows alone, so `rollback(n)` truncates to positions < n and equals
  a run that observed only those (rollback to or before the first observed position forgets the request).
- `propose`: the anchor is the query's last token at p = `len(token_ids) - 1`; the block of
  `num_speculative_tokens` tokens `[anchor, mask, …]` runs in one non-causal pass over the context observed
  before p (positions the drafter never observed are simply absent), then drafts are picked left to right with
  the Markov bias of the previous pick (`draft_sample_method`); the first `num_tokens` are proposed. A request
  whose observed positions reach p or beyond (inconsistent with its tokens) gets no drafts.
- `load_dspark(folder, target)` checks the folder against the target (hidden sizes, layer ids, vocabulary) and
  loads it in the target's dtype/device: one `ConfigError`/`CheckpointError` names each problem.
  `write_dspark_checkpoint(raw, out_dir, seed)` writes a folder with seeded weights (per tensor name).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model.config import ConfigError
from engine.model.init import sample_tensor
from engine.model.loader import CheckpointError, checkpoint_files
from engine.spec.draft_sample import DraftSampler
from engine.spec.drafter import Draft, Drafter, DraftQuery
from engine.spec.dspark_model import IGNORED_PREFIXES, DSparkConfig, DSparkModel, load_dspark_config

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    base: int  # position of row 0
    keys: list[torch.Tensor]  # per layer [n, C], positions base .. base + n - 1

    @property
    def end(self) -> int:
        return self.base + self.keys[0].shape[0]


class DSparkDrafter(Drafter):
    def __init__(self, model: DSparkModel, num_speculative_tokens: int, sample_method: str = "greedy"):
        self.model, self.k = model, int(num_speculative_tokens)
        self.taps = tuple(model.config.target_layer_ids)
        self.sampler = DraftSampler(sample_method)
        self.requests: dict[str, _Request] = {}

    @torch.inference_mode()
    def observe(self, req_id: str, start: int, token_ids: Sequence[int], hidden: torch.Tensor | None) -> None:
        state = self.requests.get(req_id)
        if state is not None and start < state.end:
            self.rollback(req_id, start)
            state = self.requests.get(req_id)
        if state is None or start != state.end:  # fresh, or after a gap: start over from here
            width = self.model.config.mla.cache_dim
            weight = self.model.context_proj.weight
            state = self.requests[req_id] = _Request(start, [weight.new_zeros(0, width) for _ in self.model.layers])
        if len(token_ids) == 0:
            return
        positions = torch.arange(start, start + len(token_ids), device=self.model.context_proj.weight.device)
        rows = self.model.context_keys(hidden, positions)
        state.keys = [torch.cat([old, new]) for old, new in zip(state.keys, rows)]

    @torch.inference_mode()
    def propose(self, queries: Sequence[DraftQuery]) -> list[Draft]:
        return [self._propose_one(q) for q in queries]

    def _propose_one(self, query: DraftQuery) -> Draft:
        p, num = len(query.token_ids) - 1, min(query.num_tokens, self.k)
        state = self.requests.get(query.req_id)
        if num <= 0 or p < 0 or (state is not None and state.end > p):
            return Draft(tokens=())
        device = self.model.context_proj.weight.device
        if state is None:
            keys = [self.model.context_proj.weight.new_zeros(0, self.model.config.mla.cache_dim)
                    for _ in self.model.layers]
            ctx_positions = torch.zeros(0, dtype=torch.int64, device=device)
        else:
            keys, ctx_positions = state.keys, torch.arange(state.base, state.end, device=device)
        block = torch.full((1, self.k), self.model.config.mask_token_id, dtype=torch.int64, device=device)
        block[0, 0] = int(query.token_ids[-1])
        base = self.model.block_logits(torch.tensor([p], device=device), block, keys, ctx_positions)[0]  # [N, V]
        prev, tokens, probs = block[0, :1], [], []
        for i in range(num):
            token, prob = self.sampler.pick(base[i] + self.model.markov_head(prev)[0], query.req_id, p + 1 + i)
            tokens.append(token)
            probs.append(prob)
            prev = torch.tensor([token], device=device)
        return Draft(tokens=tuple(tokens), probs=None if self.sampler.deterministic else torch.stack(probs))

    def rollback(self, req_id: str, num_tokens: int) -> None:
        state = self.requests.get(req_id)
        if state is None or num_tokens >= state.end:
            return
        if num_tokens <= state.base:
            self.requests.pop(req_id)
            return
        state.keys = [k[: num_tokens - state.base] for k in state.keys]

    def release(self, req_id: str) -> None:
        self.requests.pop(req_id, None)


def check_against_target(config: DSparkConfig, target_config) -> None:
    """The drafter must read streams the target has and share its embedding / LM head."""
    problems = []
    if config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != the target's {target_config.hidden_size} "
                        "(the embedding and LM head are shared)")
    if config.target_hidden_size != target_config.hidden_size:
        problems.append(f"target_hidden_size {config.target_hidden_size} != {target_config.hidden_size}")
    if config.vocab_size != target_config.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != the target's {target_config.vocab_size}")
    bad = [i for i in config.target_layer_ids if not 0 <= i < target_config.num_hidden_layers]
    if bad:
        problems.append(f"target_layer_ids {bad} are not layers of the target (0..{target_config.num_hidden_layers - 1})")
    if problems:
        raise ConfigError("DSpark drafter does not match the target: " + "; ".join(problems))


def load_dspark(folder: str | Path, target) -> DSparkModel:
    config = load_dspark_config(folder)
    check_against_target(config, target.config)
    model = DSparkModel(config, target.model.embed_tokens, target.lm_head)
    params = dict(model.named_parameters())
    header: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in checkpoint_files(Path(folder)):
        with safe_open(str(path), framework="pt") as f:
            header.update({n: (path, tuple(f.get_slice(n).get_shape())) for n in f.keys()})
    used = {n: v for n, v in header.items() if not n.startswith(IGNORED_PREFIXES)}
    missing = sorted(set(params) - set(used))
    unexpected = sorted(set(used) - set(params))
    misshaped = sorted(f"{n}: checkpoint {list(s)}, model expects {list(params[n].shape)}"
                       for n, (_, s) in used.items() if n in params and tuple(params[n].shape) != s)
    if missing or unexpected or misshaped:
        raise CheckpointError(f"{folder}: DSpark checkpoint does not match its config: missing {missing}, "
                              f"unexpected {unexpected}, mis-shaped {misshaped}")
    with torch.no_grad():
        for name, (path, _) in used.items():
            with safe_open(str(path), framework="pt") as f:
                params[name].copy_(f.get_tensor(name))
    logger.info("loaded DSpark drafter from %s (%d layers, taps %s)", folder, config.num_layers, config.target_layer_ids)
    return model.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)


def write_dspark_checkpoint(raw: dict, out_dir: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A `k3_dspark` folder with seeded weights (each drawn by its name alone)."""
    config = DSparkConfig.from_dict(raw)
    shapes = {n: tuple(p.shape) for n, p in DSparkModel(config, torch.nn.Identity(), torch.nn.Identity())
              .named_parameters()}
    tensors = {n: sample_tensor(f"dspark:{n}", s, seed).to(dtype).contiguous() for n, s in shapes.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_dspark_drafter(target_model, drafter_dir: Path, spec_config) -> DSparkDrafter:
    """The `dspark` drafter for a loaded target from its own folder (`speculative_config.model`)."""
    return DSparkDrafter(load_dspark(drafter_dir, target_model), spec_config.num_speculative_tokens,
                         spec_config.draft_sample_method)


def build(config, target) -> Drafter:
    """The speculative core's factory form (`DRAFTER_FACTORIES`): `config` a `SpeculativeConfig`, `target` a
    `DraftTarget` (its `model` and `model_dir`)."""
    return build_dspark_drafter(target.model, Path(config.model), config)
