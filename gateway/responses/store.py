"""The gateway's bounded in-memory store of Responses API responses (`store: true`, `previous_response_id`,
`GET` / `DELETE /v1/responses/{id}`).

Contract:
- `ResponseStore(max_items)` keeps at most `max_items` responses (`--responses-store-size`), the least recently
  stored or read one dropped first; 0 stores nothing (`enabled` False). It lives in the gateway process: replicas
  do not share it, and a restart empties it.
- Each entry belongs to the tenant that created it: `get` / `delete` of another tenant's id answer as for an unknown
  id (None / False), so ids never reveal other tenants' responses.
- `put(tenant, body, conversation)`: `body` is the response as the API returned it, `conversation` the chat
  messages a follow-up continues from (the input without the instructions, plus the output as an assistant
  message), as OpenAI's `previous_response_id` does (instructions are not carried over).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredResponse:
    tenant: str
    body: dict
    conversation: list[dict]


class ResponseStore:
    def __init__(self, max_items: int):
        if max_items < 0:
            raise ValueError(f"max_items must be >= 0, got {max_items}")
        self.max_items = max_items
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_items > 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tenant: str, body: dict, conversation: list[dict]) -> None:
        if not self.enabled:
            return
        self._items[body["id"]] = StoredResponse(tenant, copy.deepcopy(body), copy.deepcopy(conversation))
        self._items.move_to_end(body["id"])
        while len(self._items) > self.max_items:
            self._items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        entry = self._items.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        self._items.move_to_end(response_id)
        return StoredResponse(entry.tenant, copy.deepcopy(entry.body), copy.deepcopy(entry.conversation))

    def delete(self, tenant: str, response_id: str) -> bool:
        entry = self._items.get(response_id)
        if entry is None or entry.tenant != tenant:
            return False
        del self._items[response_id]
        return True
