"""vLLM's `/tokenize` (a `prompt`, or chat `messages`) and `/detokenize` requests.

Contract:
- `parse_tokenize(body, served)` returns a `TokenizeCompletionRequest` (a `prompt`: what /v1/completions would feed
  the model — special-token text becomes the special id unless `split_special_tokens`, as there) or a `TokenizeChatRequest` (`messages`: the rendered chat), or raises `ApiError` (400: not exactly one
  of the two, a bad field, `continue_final_message`; 404 for a model not served).
- `parse_detokenize(body, served, vocab_size)` returns a `DetokenizeRequest` whose ids all lie in the vocabulary.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from gateway.protocol.common import RequestModel, ToolDefinition, check_served, tools_json, validate_body
from gateway.protocol.errors import ApiError


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False
    split_special_tokens: bool = False  # as /v1/completions: true encodes special-token text as plain text


class TokenizeChatRequest(RequestModel):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool = False

    def tools_json(self) -> list[dict] | None:
        return tools_json(self.tools)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


def parse_tokenize(body: Any, served: set[str]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    if isinstance(body, dict) and ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
    chat = isinstance(body, dict) and "messages" in body
    request = validate_body(TokenizeChatRequest if chat else TokenizeCompletionRequest, body)
    check_served(request.model, served)
    if isinstance(request, TokenizeChatRequest) and request.continue_final_message:
        raise ApiError(400, "'continue_final_message' is not supported by this server",
                       param="continue_final_message")
    return request


def parse_detokenize(body: Any, served: set[str], vocab_size: int) -> DetokenizeRequest:
    request = validate_body(DetokenizeRequest, body)
    check_served(request.model, served)
    if not all(0 <= t < vocab_size for t in request.tokens):
        raise ApiError(400, f"token ids must be integers in [0, {vocab_size})", param="tokens")
    return request
