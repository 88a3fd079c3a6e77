"""The REST API's last line of defence: no exception escapes to the HTTP server.

Contract:
- `ContainErrors(app)` (ASGI middleware, outside FastAPI's exception handlers) turns an exception no handler mapped
  into a 500 in the OpenAI envelope (`server_error`, the message naming only the request id, never the exception's
  text) and logs it with its traceback. The connection stays usable (keep-alive): the server never sees the
  exception. If the response had already started, nothing more can be sent; the exception is logged and the response
  ends there.
- The 500 is `gateway.protocol.internal_error(request_id)` (also the final event of a stream that fails
  unexpectedly, and the gRPC API's INTERNAL status for a bug).
"""

from __future__ import annotations

import logging

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.protocol import internal_error
from telemetry.context import REQUEST_ID_HEADER, request_id_from_headers

log = logging.getLogger(__name__)


class ContainErrors:
    """ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception:
            request_id = request_id_from_headers(Headers(scope=scope))
            log.exception("unexpected error in %s %s (request id %s)", scope.get("method"), scope.get("path"),
                          request_id)
            if started:
                return
            error = internal_error(request_id)
            reply = JSONResponse(error.body(), status_code=500, headers={REQUEST_ID_HEADER: request_id})
            await reply(scope, receive, send)
