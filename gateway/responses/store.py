"""The gateway's bounded in-memory store of Responses API responses (`store: true`, `previous_response_id`,
`GET` / `DELETE /v1/responses/{id}`).

Contract:
- `ResponseStore(max_items, max_bytes)` keeps at most `max_items` responses (`--responses-store-size`) of at most
  `max_bytes` together (`--responses-store-mib`; an entry's size is its JSON text: conversations may hold images),
  the least recently stored or read ones dropped first; one entry larger than `max_bytes` is not kept. 0 items
  stores nothing (`enabled` False). It lives in the gateway process: replicas do not share it, and a restart
  empties it.
- Each entry belongs to the tenant that created it: `get` / `delete` of another tenant's id answer as for an unknown
  id (None / False), so ids never reveal other tenants' responses.
- `put(tenant, body, conversation)`: `body` is the response as the API returned it, `conversation` the chat
  messages a follow-up continues from (the input without the instructions, plus the output as an assistant
  message), as OpenAI's `previous_response_id` does (instructions are not carried over).
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    tenant: str
    body: dict
    conversation: list[dict]
    size: int = 0  # bytes of its JSON text


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int = 256 << 20):
        if max_items < 0 or max_bytes < 0:
            raise ValueError(f"max_items and max_bytes must be >= 0, got {max_items}, {max_bytes}")
        self.max_items, self.max_bytes = max_items, max_bytes
        self.bytes = 0  # held now
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_items > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tenant: str, body: dict, conversation: list[dict]) -> bool:
        """Keeps the response; False when it is not kept (the store is off, or the entry alone is over budget)."""
        size = len(json.dumps([body, conversation], ensure_ascii=False).encode())
        if not self.enabled or size > self.max_bytes:
            return False
        self._drop(body["id"])
        self._items[body["id"]] = StoredResponse(tenant, copy.deepcopy(body), copy.deepcopy(conversation), size)
        self.bytes += size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
        return True

    def _drop(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        self._items.move_to_end(response_id)
        return StoredResponse(entry.tenant, copy.deepcopy(entry.body), copy.deepcopy(entry.conversation), entry.size)

    def delete(self, tenant: str, response_id: str) -> bool:
        entry = self._items.get(response_id)
        if entry is None or entry.tenant != tenant:
            return False
        self._drop(response_id)
        return True
