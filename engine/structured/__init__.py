"""Structured output: grammar-constrained decoding with xgrammar (JSON, JSON Schema, forced tool calls).

The package follows the seams of the work:
- `params`: `StructuredOutputParams` and `ToolSpec` — what the output must look like, validated on construction;
- `schema`: JSON Schema checks and rewrites (the JSON-safe string patterns, K3's per-argument encoding plan);
- `grammar`: the xgrammar structural tag of a request, in the bare, K3 (XTML) or K2 syntax;
- `budget`: finishing within max_tokens (the steered way to the end) and the per-sequence `GrammarState`;
- `backend`: `GrammarBackend`, one per engine — compiler, grammar cache, matchers and logits masks;
- `requests`: `ConstrainedRequests`, the engine's bookkeeping of constrained requests and its compile threads.

How the engine uses it (engine/core.py): `AsyncEngine` first waits for the grammar, compiled on a compile thread
(`requests.ConstrainedRequests.compile_async`), so the step thread never compiles; `add_request` then finds it in
the cache (the synchronous `LLM` compiles it there) and gives each sequence a matcher; each step fills the bitmasks
of the constrained rows before the forward, masks their logits rows and advances each matcher with its sampled
token. The gateway builds these parameters from OpenAI requests on its side
(gateway/plan.py) and sends them as `common.StructuredOutput`; worker/codec.py turns that into
`StructuredOutputParams`.
"""

from engine.structured.backend import GrammarBackend
from engine.structured.budget import GrammarState
from engine.structured.params import (DEFAULT_MAX_REASONING_TOKENS, DEFAULT_MAX_STRING_TOKENS,
                                      StructuredOutputParams, ToolSpec)

__all__ = ["DEFAULT_MAX_REASONING_TOKENS", "DEFAULT_MAX_STRING_TOKENS", "GrammarBackend", "GrammarState",
           "StructuredOutputParams", "ToolSpec"]
