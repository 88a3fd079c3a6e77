"""The offline API, shaped like vLLM's: `LLM(model_dir, **engine_args).generate(prompts, params)`.

Contract:
- Engine arguments are `EngineArgs` fields as keywords (an unknown keyword is a `TypeError`).
- `generate(prompts, sampling_params)`: one prompt or a list (a str, a list of ids or `{"prompt_token_ids": [...]}`);
  params one for all or one per prompt. Every request is validated before any is queued, so a bad one raises
  `InvalidRequestError` and nothing runs; the engine stays usable. Returns one final `RequestOutput` per prompt, in
  order, each with its `n` completions in index order (cumulative fields filled; deltas empty).
- `generate(..., snapshot_hints=[[positions], ...])`: per prompt, the token positions to snapshot the KDA state at
  (where its system prompt and messages end; `EngineCore.add_request`), so later prompts sharing them resume there.
- `generate(..., export=True)` attaches to each output a `RequestState` (`.exported`: the KV and KDA state after
  every token but the last sampled one); `resume(states, params)` continues such states in this engine, with
  `params.max_tokens` counting the carried output tokens too.
- Runs the step loop in the calling thread until all of this call's requests finish. `close()` stops the rank
  processes of a tensor-parallel engine.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from engine.config import EngineArgs
from engine.core import EngineCore, PromptInput
from engine.errors import InvalidRequestError
from engine.memory.policy import hint_points
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling import SamplingParams
from engine.transfer import RequestState


class LLM:
    def __init__(self, model: str, **engine_args):
        self.engine_args = EngineArgs(model=str(model), **engine_args)
        self.engine = EngineCore(self.engine_args)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the model's rank processes (with `tensor_parallel_size` > 1)."""
        self.engine.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, check_integrity: bool = False,
                 export: bool = False, snapshot_hints: Sequence[Sequence[int]] | None = None) -> list[RequestOutput]:
        prompt_list = self._as_list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise InvalidRequestError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        hints = [tuple(h) for h in snapshot_hints] if snapshot_hints is not None else [()] * len(prompt_list)
        if len(hints) != len(prompt_list):
            raise InvalidRequestError(f"{len(hints)} snapshot hint lists for {len(prompt_list)} prompts",
                                      param="snapshot_hints")
        for prompt, p, h in zip(prompt_list, params_list, hints):  # validate all before queueing any
            if not isinstance(p, SamplingParams):
                raise InvalidRequestError("sampling_params must be SamplingParams", param="sampling_params")
            hint_points(h, len(self.engine.validate_prompt(prompt, p)[1]), self.engine.plan.block_size)
        ids = [f"llm-{next(self._ids)}" for _ in prompt_list]
        for request_id, prompt, p, prio, h in zip(ids, prompt_list, params_list, priorities, hints):
            self.engine.add_request(request_id, prompt, p, priority=prio, export_on_finish=export, snapshot_hints=h)
        return self._run(ids, check_integrity)

    def resume(self, states: RequestState | Sequence[RequestState], sampling_params: SamplingParams,
               check_integrity: bool = False, lean: bool = False) -> list[RequestOutput]:
        """Continues exported requests (from this or another engine of the same model); `lean`: states with only
        the KV after their last full block, whose full blocks are in this engine's prefix cache
        (`engine.exchange.import_block_tensors`; `EngineCore.import_request`)."""
        state_list = [states] if isinstance(states, RequestState) else list(states)
        ids = [f"llm-{next(self._ids)}" for _ in state_list]
        for request_id, state in zip(ids, state_list):
            self.engine.import_request(request_id, state, sampling_params, lean=lean)
        return self._run(ids, check_integrity)

    def _run(self, ids: list[str], check_integrity: bool) -> list[RequestOutput]:
        pending = set(ids)
        final: dict[str, RequestOutput] = {}
        while pending:
            for out in self.engine.step():
                if out.request_id not in pending:
                    continue
                merged = final.setdefault(out.request_id, out)
                if merged is not out:
                    by_index = {c.index: c for c in merged.outputs}
                    by_index.update({c.index: c for c in out.outputs})
                    merged.outputs = list(by_index.values())
                    merged.finished, merged.exported = out.finished, out.exported
                    merged.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    pending.discard(out.request_id)
            if check_integrity:
                self.engine.check_integrity()
        return [self._finalise(final[i]) for i in ids]

    @staticmethod
    def _finalise(out: RequestOutput) -> RequestOutput:
        out.outputs = [_cumulative(c) for c in sorted(out.outputs, key=lambda c: c.index)]
        return out

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
            return [list(prompts)]  # one prompt given as ids
        return list(prompts)


def _cumulative(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(index=c.index, text=c.text, token_ids=c.token_ids,
                            cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
