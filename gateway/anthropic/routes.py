"""The Anthropic Messages API's REST routes (registered in gateway/app.py): `POST /v1/messages` and
`POST /v1/messages/count_tokens`.

Contract:
- The API key comes from `x-api-key` (Anthropic's clients), else `Authorization: Bearer` (`auth_token`): the same
  tenants, limits and cache salts as every other endpoint.
- Every error — bad JSON, validation, authentication, admission (429 with `Retry-After`), the mesh — is answered in
  Anthropic's envelope with the `ApiError`'s status (gateway/anthropic/protocol.py `error_body`); a chat field named
  in an error is renamed to the Messages field (`stop` → `stop_sequences`, ...).
- `POST /v1/messages` translates the request to a chat request (gateway/anthropic/translate.py) and runs it through
  the chat path with `gateway.rest_translated.respond_translated` (a message, or its event stream).
- `POST /v1/messages/count_tokens` → `{"input_tokens": N}`: the prompt the same request would send to the model —
  the rendered system, messages and tools, each image counted as the feature rows it expands to.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from gateway.anthropic.protocol import error_body, parse_count_tokens, parse_messages
from gateway.anthropic.render import MessageRendering
from gateway.anthropic.translate import chat_body, chat_messages, chat_param, thinking_kwargs, tools_and_choice
from gateway.media import collect_images, image_parts
from gateway.protocol import ApiError, TokenizeChatRequest, parse_chat
from gateway.protocol.common import validate_body
from gateway.rest_io import read_json
from gateway.rest_translated import respond_translated
from gateway.tenancy import Principal
from telemetry.context import REQUEST_ID_HEADER, request_id_from_headers


def authorization(request: Request) -> str | None:
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key else request.headers.get("authorization")


def anthropic_error(exc: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    headers = {**exc.headers, **(headers or {})}
    return JSONResponse(error_body(exc, headers.get(REQUEST_ID_HEADER)), status_code=exc.status, headers=headers)


def _renamed(exc: ApiError) -> ApiError:
    if exc.param == chat_param(exc.param):
        return exc
    return ApiError(exc.status, exc.message, chat_param(exc.param), exc.code, exc.type, exc.headers)


async def messages(request: Request):
    core = request.app.state.core

    async def start(principal: Principal, trace):
        parsed = parse_messages(await read_json(request), core.served)
        body = chat_body(parsed, chat_messages(parsed))
        try:
            run = core.chat(principal, await core.plan_chat(parse_chat(body, core.served)), trace=trace)
        except ApiError as exc:
            raise _renamed(exc) from None
        return run, MessageRendering(run, omit_thinking=parsed.omits_thinking).rendering()

    return await respond_translated(request, "messages", authorization(request), start, anthropic_error)


async def count_tokens(request: Request):
    core = request.app.state.core
    ids = {REQUEST_ID_HEADER: request_id_from_headers(request.headers)}
    try:
        core.authenticate(authorization(request))
        parsed = parse_count_tokens(await read_json(request), core.served)
        messages = chat_messages(parsed)
        body = {"messages": messages, **tools_and_choice(parsed), **thinking_kwargs(parsed)}
        body.pop("tool_choice", None), body.pop("parallel_tool_calls", None)
        return JSONResponse({"input_tokens": await _prompt_tokens(core, body)}, headers=ids)
    except ApiError as exc:
        return anthropic_error(_renamed(exc), ids)


async def _prompt_tokens(core, body: dict) -> int:
    """The rendered prompt's tokens, each image's one pad counted as its feature rows."""
    tokens = len(await core.tokenize(validate_body(TokenizeChatRequest, body)))
    media = core.planner.media
    if media is None or not image_parts(body["messages"]):
        return tokens
    fetched = await core.fetcher.fetch(body["messages"], media.max_images, media.processor.max_image_bytes)
    return tokens + sum(image.feature_rows - 1 for image in collect_images(body["messages"], media, fetched))
