"""The model runtime shared by prefill and decode: model layers and loader, KV/state pools, prefix cache,
scheduler, sampler, runner and the offline `LLM` API.

Importing `engine` itself imports no torch (the gateway imports `engine.tokenizer`); runtime names are loaded lazily.
"""

_LAZY = {
    "ModelConfig": "engine.model.config",
    "load_model_config": "engine.model.config",
    "load_model": "engine.model.loader",
    "LoadConfig": "engine.model.loader",
    "LLM": "engine.llm",
    "SamplingParams": "engine.sampling",
    "AsyncEngine": "engine.async_engine",
    "EngineArgs": "engine.config",
    "EngineCore": "engine.core",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "InvalidRequestError": "engine.errors",
    "EngineDeadError": "engine.errors",
    "RequestTimeoutError": "engine.errors",
    "RequestState": "engine.transfer",
    "TransferError": "engine.transfer",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
