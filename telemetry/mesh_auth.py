"""The mesh token: the shared secret that every call between kdamesh services carries, checked by every internal server.

Contract:
- A caller sends the token as the `x-kdamesh-mesh-token` call metadata (`MESH_TOKEN_METADATA`);
  `client_interceptors(token)` adds it to every call of a `grpc.aio` channel (token None or "": nothing added).
- `MeshTokenInterceptor(token)` (a `grpc.aio.ServerInterceptor`) rejects every call whose metadata lacks the exact
  token (compared in constant time) with UNAUTHENTICATED before its handler runs, so an unauthenticated caller
  learns nothing a handler would say (the cache's DataPlane answer included). Health checks
  (`grpc.health.v1.Health`) and reflection stay open: load balancers and the launcher probe them without the token.
- `mesh_token_from_env(environ)` is the token a process was given in `KDAMESH_MESH_TOKEN` (None when unset or
  empty); the command lines read it there (the launcher generates one per launch and hands it to every child).
  Passing it in the environment keeps it out of `ps` output. A server started without a token accepts every call
  (a development mesh on loopback); `check_token` refuses a token shorter than `MIN_TOKEN_CHARS`.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Mapping

import grpc

MESH_TOKEN_METADATA = "x-kdamesh-mesh-token"
MESH_TOKEN_ENV = "KDAMESH_MESH_TOKEN"
MIN_TOKEN_CHARS = 16
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def new_mesh_token() -> str:
    """A fresh random token (43 URL-safe characters: 256 bits)."""
    return secrets.token_urlsafe(32)


def check_token(token: str | None) -> str | None:
    """`token` unchanged (None for None or ""); raises ValueError for one shorter than MIN_TOKEN_CHARS."""
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the mesh token must have at least {MIN_TOKEN_CHARS} characters")
    return token


def mesh_token_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The token in `KDAMESH_MESH_TOKEN` (None when unset or empty)."""
    return check_token(environ.get(MESH_TOKEN_ENV))


def _metadata_token(metadata) -> str | None:
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == MESH_TOKEN_METADATA:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


class MeshTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call without the mesh token (health and reflection excepted)."""

    def __init__(self, token: str):
        if not check_token(token):
            raise ValueError("MeshTokenInterceptor needs a token")
        self._token = token.encode()

    def authenticated(self, handler_call_details) -> bool:
        method = handler_call_details.method
        method = method.decode() if isinstance(method, bytes) else method
        if method.startswith(_OPEN_SERVICES):
            return True
        sent = _metadata_token(handler_call_details.invocation_metadata)
        return sent is not None and hmac.compare_digest(sent.encode(), self._token)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or self.authenticated(handler_call_details):
            return handler
        return _rejecting(handler)


def _rejecting(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with its behaviour replaced by an UNAUTHENTICATED abort of the same call kind."""
    async def reject_unary(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong mesh token (x-kdamesh-mesh-token)")

    async def reject_stream(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong mesh token (x-kdamesh-mesh-token)")
        yield  # pragma: no cover - makes this an async generator, as a streaming handler must be

    for kind, behaviour in (("unary_unary", reject_unary), ("stream_unary", reject_unary),
                            ("unary_stream", reject_stream), ("stream_stream", reject_stream)):
        if getattr(handler, kind) is not None:
            return handler._replace(**{kind: behaviour})
    return handler


# -- client ---------------------------------------------------------------------------------------------------------


_CLIENT_KINDS = ((grpc.aio.UnaryUnaryClientInterceptor, "intercept_unary_unary"),
                 (grpc.aio.UnaryStreamClientInterceptor, "intercept_unary_stream"),
                 (grpc.aio.StreamUnaryClientInterceptor, "intercept_stream_unary"),
                 (grpc.aio.StreamStreamClientInterceptor, "intercept_stream_stream"))


def client_interceptors(token: str | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that add `token` to every call's metadata (one per call kind); [] for no token."""
    if not token:
        return []
    return [_token_interceptor(kind, method, token) for kind, method in _CLIENT_KINDS]


def _token_interceptor(kind: type, method: str, token: str) -> grpc.aio.ClientInterceptor:
    async def intercept(self, continuation, client_call_details, request_or_iterator):
        return await continuation(_with_token(client_call_details, token), request_or_iterator)

    return type(f"_MeshToken{kind.__name__}", (kind,), {method: intercept})()


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()))
    if MESH_TOKEN_METADATA not in metadata:
        metadata.add(MESH_TOKEN_METADATA, token)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)
