"""Building an engine's speculative decoding from its `EngineArgs`: the drafter (by the method's registered
factory, engine/spec/config.py) and the `SpecDecoding` that drives it; None without a `speculative_config`."""

from __future__ import annotations

import importlib

from engine.compilation import CompilationConfig
from engine.spec.config import factory_path
from engine.spec.decoding import SpecDecoding
from engine.spec.drafter import DraftTarget


def open_spec_decoding(args, model, manager, plan, executor) -> SpecDecoding | None:
    config = args.speculative_config
    if config is None:
        return None
    module, func = factory_path(config.method).split(":")
    target = DraftTarget(model=model, model_dir=args.model, device=model.device, dtype=model.dtype,
                         max_model_len=plan.max_model_len, max_num_seqs=args.max_num_seqs,
                         compilation=None if args.enforce_eager else CompilationConfig.parse(args.compilation_config))
    drafter = getattr(importlib.import_module(module), func)(config, target)
    executor.set_taps(drafter.taps)
    return SpecDecoding(config, drafter, manager, plan.max_model_len)
