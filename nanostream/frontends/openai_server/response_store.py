"""Stored responses of the Responses API (``store``, default true): in this server process's memory,
bounded by count and by bytes, the least recently used leaving first. A stored response is what
``GET /v1/responses/{id}`` returns and what ``previous_response_id`` continues: its object, and the
conversation up to and including its output as chat messages. The ``--workers`` of one server share
one store (workers.py serves it from a manager process); a restart forgets it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass
class Stored:
    response: dict[str, Any]  # the response object, as returned
    messages: list[dict[str, Any]]  # the conversation it ends (instructions left out, as the API does)
    size: int  # bytes of both, as JSON


class ResponseStore:
    """At most ``max_responses`` responses and ``max_bytes`` of them; ``get`` makes one the most recent."""

    def __init__(self, max_responses: int = DEFAULT_MAX_RESPONSES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_responses < 0 or max_bytes < 0:
            raise ValueError("the response store's bounds must be >= 0 (0: store nothing)")
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> bool:
        """Keep ``response``; False if it alone is over the bytes bound (then it is not kept)."""
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if size > self.max_bytes or self.max_responses == 0:
            return False
        self.delete(response["id"])
        self._items[response["id"]] = Stored(response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size
        return stored is not None
