"""The request id of the work being done, carried by a contextvar and, between services, by gRPC metadata.

Contract:
- `current_request_id()` is the id bound in this context (None outside a request). asyncio tasks inherit the value
  their creator had when it created them, so background work started for a request keeps its id.
- `request_id_scope(id)` binds an id for a `with` block and restores the previous value after it; `bind_request_id` /
  `reset_request_id` are the two halves for code that cannot use a block.
- Between services the id travels as the `x-request-id` gRPC metadata entry (`REQUEST_ID_METADATA`); the gateway
  reads the same name from REST headers (`request_id_from_headers`, which also makes a new id when there is none
  or it is unusable).
"""

from __future__ import annotations

import contextvars
import re
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

REQUEST_ID_METADATA = "x-request-id"  # gRPC metadata keys are lower case
REQUEST_ID_HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 128
_USABLE = re.compile(r"^[\x21-\x7e]{1,%d}$" % MAX_REQUEST_ID_CHARS)  # printable ASCII, no spaces

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kdamesh_request_id", default=None)


def current_request_id() -> str | None:
    return _request_id.get()


def bind_request_id(request_id: str | None) -> contextvars.Token:
    """Binds `request_id` in this context -> the token `reset_request_id` takes to restore the previous value."""
    return _request_id.set(request_id or None)


def reset_request_id(token: contextvars.Token) -> None:
    _request_id.reset(token)


@contextmanager
def request_id_scope(request_id: str | None) -> Iterator[str | None]:
    token = bind_request_id(request_id)
    try:
        yield request_id
    finally:
        reset_request_id(token)


def usable_request_id(value: str | None) -> str | None:
    """`value` when it can serve as a request id (1-128 printable ASCII characters, no spaces), else None."""
    return value if value is not None and _USABLE.match(value) else None


def new_request_id() -> str:
    return uuid.uuid4().hex


def request_id_from_headers(headers: Mapping[str, str]) -> str:
    """The client's `X-Request-Id` when usable, else a new id. `headers` may be any mapping (Starlette's `Headers`
    matches names case-insensitively; a plain dict is searched case-insensitively here)."""
    value = headers.get(REQUEST_ID_HEADER) if hasattr(headers, "getlist") else None
    if value is None:
        value = next((v for k, v in headers.items() if k.lower() == REQUEST_ID_METADATA), None)
    return usable_request_id(value) or new_request_id()


def request_id_from_metadata(metadata) -> str | None:
    """The usable `x-request-id` of gRPC invocation metadata (pairs or objects with key/value), else None."""
    for item in metadata or ():
        key, value = (item.key, item.value) if hasattr(item, "key") else item
        if key == REQUEST_ID_METADATA:
            return usable_request_id(value.decode("ascii", "replace") if isinstance(value, bytes) else value)
    return None
