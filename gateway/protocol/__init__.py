"""The OpenAI-compatible request protocol of the gateway: validation of request bodies and the error envelope.

Contract:
- `errors`: `ApiError` (the one error a handler raises; `body()` is the OpenAI envelope) and how mesh, gRPC and
  validation failures map onto it.
- `common`: the pydantic base, tools, response formats and the sampling fields both generation requests share.
- `chat` (`parse_chat`, `ChatCompletionRequest`), `completions` (`parse_completion` -> `CompletionJob`),
  `tokenize` (`parse_tokenize`, `parse_detokenize`): one pydantic model per request body, so the served
  `/openapi.json` documents them (`REQUEST_BODIES`).
Nothing here talks to the mesh; everything is pure and unit-tested (tests/unit/gateway/test_openai_protocol.py).
This package re-exports the names the rest of the gateway uses.
"""

from gateway.protocol.chat import ChatCompletionRequest, parse_chat, sampling_from_chat
from gateway.protocol.completions import CompletionJob, CompletionRequest, parse_completion
from gateway.protocol.errors import (HTTP_STATUS, ApiError, ClientGone, api_error_type, bad_json, failure_of,
                                     internal_error, mesh_api_error, not_found_model)
from gateway.protocol.tokenize import (DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest,
                                       parse_detokenize, parse_tokenize)

# The request body of each POST endpoint, as /openapi.json documents it (a tuple: one of these models).
REQUEST_BODIES = {
    "/v1/chat/completions": (ChatCompletionRequest,),
    "/v1/completions": (CompletionRequest,),
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/detokenize": (DetokenizeRequest,),
}

__all__ = ["HTTP_STATUS", "REQUEST_BODIES", "ApiError", "ChatCompletionRequest", "ClientGone", "CompletionJob",
           "CompletionRequest", "DetokenizeRequest", "TokenizeChatRequest", "TokenizeCompletionRequest",
           "api_error_type", "bad_json", "failure_of", "internal_error", "mesh_api_error", "not_found_model",
           "parse_chat", "parse_completion", "parse_detokenize", "parse_tokenize", "sampling_from_chat"]
