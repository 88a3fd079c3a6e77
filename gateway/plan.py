"""Everything decided about a chat request before it reaches the mesh (`ChatPlan`), and the prompt-length rule.

Contract:
- `ChatPlanner(renderer, config, max_model_len, media, special_ids).plan(request, fetched)` (`max_model_len`: a
  callable giving the context length now, None while unknown; `special_ids`: the tokenizer's, for the hints) renders a validated chat request and
  decides: the prompt ids; the sampling parameters with structured output (`tool_choice` "required" / named and
  `response_format` json kinds become the engine's grammar, wrapped in the model's output format; `tool_choice`
  "none" with tools declared becomes a text grammar that cannot open a tool block); which output
  parsers read the text (the configured ones; with a grammar, the family's own, since its wrapping must be read
  back). Images (`media`, gateway/media.py; None: a text-only model, whose image parts are a 400) are decoded and
  checked first — data: URLs, and the bytes of http(s) / file: URLs in `fetched` (read before planning by
  gateway/media_fetch.py, since planning is synchronous) —, their sizes given to the renderer, each pad expanded
  to the image's feature rows in `prompt_ids`, and `media` holds their `MediaItem`s. Raises `ApiError` for a bad
  image (see gateway/media.py), a malformed conversation (naming the field: `messages`, `tools`, ...),
  a prompt beyond the context, and "auto" tool choice without `--enable-auto-tool-choice`; and the structure hints
  (`gateway.hints`: where the system block and every message but the last end, plus the client's
  `kdamesh_snapshot_hints`, 400 `param: "kdamesh_snapshot_hints"` for one outside the prompt), as positions in the
  prompt the mesh gets (shifted past expanded image pads).
- `planner_for(config, tokenizer, max_model_len)`: the planner of `config.model`, as the gateway builds it.
- `render(request, fetched)` renders a chat (or /tokenize chat) request with the same checks, nothing else decided
  (its ids hold one pad per image, as the chat template writes it).
- `check_prompt_length(prompt_tokens, max_tokens, limit, param)`: 400 `context_length_exceeded` when the prompt
  (plus `max_tokens` when given) does not fit in `limit` tokens; 503 (`Retry-After`) when `limit` is None (no
  worker has reported its context length yet, gateway/worker_pool.py): the gateway never admits a request it
  cannot check.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gateway.chat import ChatFormatError, ChatRenderer, RenderedPrompt
from gateway.config import GatewayConfig
from gateway.media import DecodedImage, MediaConfig, collect_images, expand, load_media_config
from gateway.hints import check_client_hints, merge_hints, shift_past_media, structure_hints
from gateway.protocol import ApiError, ChatCompletionRequest, TokenizeChatRequest, sampling_from_chat
from gateway.protocol.errors import RETRY_AFTER_S
from protos import common_pb2

CHAT_FIELDS = ("messages", "tools", "tool_choice", "response_format", "chat_template_kwargs")
IMAGE_PARTS = ("image_url", "image", "input_image")
StructuredOutput = common_pb2.StructuredOutput
NOTHING_FETCHED: Mapping[str, bytes] = MappingProxyType({})
UNBOUNDED = -1  # StructuredOutput's limits: no bound


@dataclass(frozen=True)
class ChatPlan:
    """Everything decided about a chat request before it reaches the mesh."""

    request: ChatCompletionRequest
    prompt: RenderedPrompt
    sampling: common_pb2.SamplingParams
    tool_parser: str | None  # parser names (gateway.parsers); both None: the text is the content
    reasoning_parser: str | None
    expanded_ids: list[int] | None = None  # with images: the prompt with each pad expanded to its feature rows
    media: tuple[common_pb2.MediaItem, ...] = field(default=())
    snapshot_hints: tuple[int, ...] = ()  # prompt positions where reusable parts end (gateway.hints)

    @property
    def prompt_ids(self) -> list[int]:
        return self.expanded_ids if self.expanded_ids is not None else self.prompt.token_ids


def planner_for(config: GatewayConfig, tokenizer, max_model_len: Callable[[], int | None]) -> ChatPlanner:
    """The planner of `config.model` (its chat template, images, the tokenizer's specials), as the gateway and its
    preparation processes (gateway/prep_worker.py) build it."""
    renderer = ChatRenderer.from_pretrained(config.model, tokenizer)
    return ChatPlanner(renderer, config, max_model_len, load_media_config(config.model),
                       frozenset(tokenizer.special_tokens.values()))


def check_prompt_length(prompt_tokens: int, max_tokens: int | None, limit: int | None, param: str) -> None:
    if limit is None:
        raise ApiError(503, "no model server has reported its context length yet; retry shortly",
                       code="context_length_unknown", headers={"Retry-After": RETRY_AFTER_S})
    if prompt_tokens >= limit or prompt_tokens + (max_tokens or 0) > limit:
        asked = f" + {max_tokens} completion tokens" if max_tokens else ""
        raise ApiError(400, f"this model's maximum context length is {limit} tokens; the request has "
                            f"{prompt_tokens} prompt tokens{asked}", param=param, code="context_length_exceeded")


class ChatPlanner:
    def __init__(self, renderer: ChatRenderer, config: GatewayConfig, max_model_len: Callable[[], int | None],
                 media: MediaConfig | None = None, special_ids: frozenset[int] = frozenset()):
        self.renderer = renderer
        self.special_ids = special_ids  # the tokenizer's special ids: end-of-message markers for the hints
        self.media = media
        self.config = config
        self.max_model_len = max_model_len

    def render(self, request: ChatCompletionRequest | TokenizeChatRequest,
               fetched: Mapping[str, bytes] = NOTHING_FETCHED) -> RenderedPrompt:
        return self._render(request, None, None, self._images(request, fetched))

    def _images(self, request, fetched: Mapping[str, bytes]) -> list[DecodedImage]:
        if not _has_images(request.messages):
            return []
        if self.media is None:
            raise ApiError(400, "this model is text-only; image inputs are not supported", param="messages")
        return collect_images(request.messages, self.media, fetched)

    def _render(self, request, tool_choice, response_format: dict | None,
                images: list[DecodedImage]) -> RenderedPrompt:
        try:
            return self.renderer.render(request.messages, request.tools_json(), request.add_generation_prompt,
                                        request.chat_template_kwargs, tool_choice=tool_choice,
                                        response_format=response_format,
                                        image_sizes=[image.size for image in images] or None)
        except ChatFormatError as exc:
            raise ApiError(400, str(exc), param=_chat_param(str(exc))) from None

    def plan(self, request: ChatCompletionRequest, fetched: Mapping[str, bytes] = NOTHING_FETCHED) -> ChatPlan:
        tool_choice = request.effective_tool_choice
        if tool_choice == "auto" and not (self.config.enable_auto_tool_choice and self.config.tool_call_parser):
            raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                "set", param="tool_choice")
        response_format = request.response_format_json()
        images = self._images(request, fetched)
        prompt = self._render(request, tool_choice, response_format, images)
        expanded, media = expand(prompt.token_ids, images, self.media.pad_id) if images else (None, ())
        check_prompt_length(len(expanded or prompt.token_ids), request.completion_limit, self.max_model_len(),
                            "messages")
        client_hints = check_client_hints(request.kdamesh_snapshot_hints, len(prompt.token_ids))
        hints = merge_hints(client_hints, structure_hints(self.renderer, request.messages, request.tools_json(),
                                                          request.chat_template_kwargs, prompt.token_ids,
                                                          self.special_ids))
        hints = shift_past_media(hints, media)
        tool_parser, reasoning_parser = self._parsers(request, tool_choice, response_format)
        parsed = tool_parser is not None or reasoning_parser is not None
        sampling = sampling_from_chat(request, skip_special_tokens=False if parsed else request.skip_special_tokens)
        structured = _structured(request, tool_choice, response_format, self.renderer.output_format,
                                 prompt.starts_in_reasoning)
        if structured is not None:
            sampling.structured_output.CopyFrom(structured)
        return ChatPlan(request, prompt, sampling, tool_parser, reasoning_parser, expanded, media, hints)

    def _parsers(self, request: ChatCompletionRequest, tool_choice, response_format: dict | None):
        """(tool-call parser, reasoning parser) names that read this request's output."""
        family_format = self.renderer.output_format
        forced = tool_choice in ("required", "none") or isinstance(tool_choice, dict)
        json_kind = response_format is not None and response_format["type"] in ("json_object", "json_schema")
        tool_parser = None
        if request.tools and tool_choice != "none":
            tool_parser = self.config.tool_call_parser if tool_choice == "auto" else (
                self.config.tool_call_parser or family_format)
        reasoning_parser = self.config.reasoning_parser
        if (forced or json_kind) and reasoning_parser is None:
            reasoning_parser = tool_parser or family_format  # the grammar's wrapping must be read back
        if tool_parser is not None and reasoning_parser is not None and tool_parser != reasoning_parser:
            reasoning_parser = tool_parser
        return tool_parser, reasoning_parser


def _structured(request: ChatCompletionRequest, tool_choice, response_format: dict | None, output_format: str,
                starts_in_reasoning: bool) -> StructuredOutput | None:
    common = dict(output_format=output_format, starts_in_reasoning=starts_in_reasoning)
    if tool_choice == "required" or isinstance(tool_choice, dict):
        tools = [StructuredOutput.Tool(name=t.function.name, parameters_json=json.dumps(t.function.parameters)
                                       if t.function.parameters is not None else "") for t in request.tools]
        if tool_choice == "required":
            out = StructuredOutput(kind=StructuredOutput.KIND_TOOL_CALL, tools=tools,
                                   tool_mode=StructuredOutput.TOOL_MODE_REQUIRED, **common)
            if request.parallel_tool_calls is not None:
                out.parallel_tool_calls = request.parallel_tool_calls
            return out
        return StructuredOutput(kind=StructuredOutput.KIND_TOOL_CALL, tools=tools,
                                tool_mode=StructuredOutput.TOOL_MODE_NAMED,
                                tool_name=tool_choice["function"]["name"], **common)
    if response_format is None or response_format["type"] == "text":
        if tool_choice == "none":  # tools declared, none may be called: the message cannot open a tool block
            return StructuredOutput(kind=StructuredOutput.KIND_TEXT, max_reasoning_tokens=UNBOUNDED, **common)
        return None
    if response_format["type"] == "json_object":
        return StructuredOutput(kind=StructuredOutput.KIND_JSON_OBJECT, **common)
    schema = response_format["json_schema"]["schema"]
    return StructuredOutput(kind=StructuredOutput.KIND_JSON_SCHEMA, json_schema=json.dumps(schema), **common)


def _chat_param(message: str) -> str | None:
    head = message.split(":", 1)[0].split("[", 1)[0].split(".", 1)[0].strip()
    return head if head in CHAT_FIELDS else "messages"


def _has_images(messages: list) -> bool:
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
                    return True
    return False
