"""The Responses API's REST routes (registered in gateway/app.py): `POST /v1/responses`, `GET` and `DELETE
/v1/responses/{response_id}`.

Contract:
- `POST /v1/responses` parses the body (gateway/responses/protocol.py), resolves `previous_response_id` in the
  store (404 `previous_response_not_found` when the store does not hold it for this tenant), translates the request
  to a chat request (gateway/responses/translate.py) and runs it through the chat path (planning, admission, the
  mesh) with `gateway.rest_translated.respond_translated`; errors use the OpenAI envelope, a chat field named in
  one is renamed to the Responses field (`messages` → `input`, `max_tokens` → `max_output_tokens`, ...).
  `store: true` with the store off (`--responses-store-size 0`) is a 400; `store` unset then stores nothing.
- `GET /v1/responses/{id}`: the stored response of this tenant (404 otherwise); `DELETE` removes it
  (`{"id", "object": "response.deleted", "deleted": true}`).
- The store is the app's (`request.app.state.responses`, a `ResponseStore`).
"""

from __future__ import annotations

from fastapi import Request

from gateway.protocol import ApiError, parse_chat
from gateway.responses.protocol import parse_response_request
from gateway.responses.render import ResponseRendering
from gateway.responses.store import ResponseStore
from gateway.responses.translate import chat_body, chat_param, input_messages
from gateway.rest_io import read_json
from gateway.rest_routes import error_response
from gateway.rest_translated import respond_translated
from gateway.tenancy import Principal


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _renamed(exc: ApiError) -> ApiError:
    if exc.param == chat_param(exc.param):
        return exc
    return ApiError(exc.status, exc.message, chat_param(exc.param), exc.code, exc.type, exc.headers)


async def create_response(request: Request):
    core, store = request.app.state.core, _store(request)

    async def start(principal: Principal, trace):
        parsed = parse_response_request(await read_json(request), core.served)
        if parsed.store is True and not store.enabled:
            raise ApiError(400, "'store': true needs the response store (--responses-store-size > 0); it is off on "
                                "this server", param="store", code="unsupported_parameter")
        history: list[dict] = []
        if parsed.previous_response_id is not None:
            previous = store.get(principal.tenant, parsed.previous_response_id)
            if previous is None:
                raise ApiError(404, f"Previous response with id '{parsed.previous_response_id}' not found.",
                               param="previous_response_id", code="previous_response_not_found")
            history = previous.conversation
        messages = input_messages(parsed)
        try:
            chat = parse_chat(chat_body(parsed, history, messages), core.served)
            run = core.chat(principal, await core.plan_chat(chat), trace=trace)
        except ApiError as exc:
            raise _renamed(exc) from None
        return run, ResponseRendering(parsed, run, store, principal.tenant, history + messages).rendering()

    return await respond_translated(request, "responses", request.headers.get("authorization"), start,
                                    error_response)


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


async def get_response(response_id: str, request: Request):
    principal = request.app.state.core.authenticate(request.headers.get("authorization"))
    entry = _store(request).get(principal.tenant, response_id)
    if entry is None:
        raise _not_found(response_id)
    return entry.body


async def delete_response(response_id: str, request: Request):
    principal = request.app.state.core.authenticate(request.headers.get("authorization"))
    if not _store(request).delete(principal.tenant, response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
