"""The target's own greedy continuations: the stream the drafters learn what they will be asked to draft.

Contract:
- `generated_streams(folder, config, tiny)` continues, with the served target (`engine.llm.LLM`, fp32, greedy,
  stopping where it stops by itself or after `config.generated_tokens`), the first `config.generated_chat`
  conversations of the training seed (`trainer.chat_data`, rendered by the gateway's K3 renderer up to the
  assistant's turn) and the first `CODE_HEAD_TOKENS` tokens of `config.generated_code` training stdlib files (never
  the held-out ones, `trainer.corpus.split_files`). The speculative-decoding benchmark's prompts use another chat seed
  and the held-out files (bench/spec_prompts.py), so nothing it measures was drafted in training.
- Returns the distillation data of `trainer.distill.windows`: per kind ("chat", "code") the pieces (prompt +
  continuation) back to back (`{kind}` [N] int64), where each piece's window starts (`{kind}_starts` [P]: at the
  piece, or late enough to end with its continuation; only those with a full window after them) and which tokens the
  target generated (`{kind}_generated` [N] bool), so the drafters train on the positions they draft at.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from trainer import corpus
from trainer.config import DistillConfig

CODE_HEAD_TOKENS = 64  # a code prompt: the head of a training file


def chat_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """The first `count` conversations of `seed`, rendered up to the assistant's turn."""
    from gateway.chat.k3 import K3Renderer
    from trainer.chat_data import make_example, prompt_messages

    renderer = K3Renderer(tokenizer)
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        example = make_example(rng)
        prompts.append(renderer.render(prompt_messages(example), example.tools,
                                       chat_template_kwargs=example.template_kwargs).token_ids)
    return prompts


def code_prompts(tokenizer, count: int, code_bytes: int) -> list[list[int]]:
    """Heads of the first `count` training stdlib files that have `CODE_HEAD_TOKENS` tokens."""
    heads = []
    for text in corpus.read_sources(corpus.split_files(code_bytes).train):
        ids = tokenizer.encode(text)
        if len(ids) >= CODE_HEAD_TOKENS:
            heads.append(ids[:CODE_HEAD_TOKENS])
        if len(heads) == count:
            break
    return heads


def _continue(llm, prompts: list[list[int]], config: DistillConfig) -> list[list[int]]:
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=config.generated_tokens)
    outputs = []
    for at in range(0, len(prompts), config.generated_batch):
        chunk = [{"prompt_token_ids": p} for p in prompts[at: at + config.generated_batch]]
        outputs += [list(o.outputs[0].token_ids) for o in llm.generate(chunk, params)]
    return outputs


def _stream(prompts: list[list[int]], continuations: list[list[int]], seq_len: int) -> tuple[torch.Tensor, ...]:
    """(ids [N], window starts [P], generated [N] bool) of the pieces back to back; a piece's window starts at the
    piece or, where prompt and continuation are longer than `seq_len`, `seq_len` before the continuation's end."""
    ids, generated, starts = [], [], []
    for prompt, continuation in zip(prompts, continuations):
        end = len(ids) + len(prompt) + len(continuation)
        starts.append(max(len(ids), end - seq_len))
        ids += prompt + continuation
        generated += [False] * len(prompt) + [True] * len(continuation)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    return (torch.tensor(ids, dtype=torch.int64), starts_t[starts_t + seq_len <= len(ids)],
            torch.tensor(generated, dtype=torch.bool))


def generated_streams(folder: Path, config: DistillConfig, code_bytes: int) -> dict:
    """See the module docstring; `code_bytes`: the training run's stdlib split (`TrainConfig.code_bytes`)."""
    from engine.llm import LLM

    llm = LLM(str(folder), dtype="float32")
    try:
        data = {}
        for kind, prompts in (("chat", chat_prompts(llm.tokenizer, config.generated_chat, config.seed)),
                              ("code", code_prompts(llm.tokenizer, config.generated_code, code_bytes))):
            ids, starts, generated = _stream(prompts, _continue(llm, prompts, config), config.seq_len)
            data |= {kind: ids, f"{kind}_starts": starts, f"{kind}_generated": generated}
        return data
    finally:
        llm.close()
