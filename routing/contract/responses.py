"""The stream through which a worker sends one request's tokens and result back to the frontend.

The worker appends events to `resp:<request-id>` (a Redis stream with a TTL); the frontend
process that accepted the request reads them. Any frontend process can read any stream, so a
request never depends on which process the worker happens to reach.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import redis

# The event types are the contract's; re-exported for the stream's readers.
from routing.contract.tasks import DONE, ERROR, STARTED, TOKEN, StreamEvent, event_data, parse_event
from routing.state.redis_keys import reply_text

__all__ = [
    "CANCEL_FAMILY",
    "DONE",
    "ERROR",
    "RESPONSE_FAMILY",
    "RESPONSE_TTL_SECS",
    "STARTED",
    "TOKEN",
    "ResponseEvent",
    "ResponseWriter",
    "cancel_key",
    "parse_response_read",
    "parse_stream_entries",
    "read_response_events",
    "response_key",
    "response_read",
]

RESPONSE_FAMILY = "resp:"
CANCEL_FAMILY = "cancel:"  # set by the frontend when the client went away or gave up
# The frontend's mark on a request it follows, refreshed while it reads the answer: a frontend
# killed mid-request stops refreshing, and the worker drops the request once the mark expires.
LIVE_FAMILY = "live:"
RESPONSE_TTL_SECS = 600


def response_key(namespace: str, request_id: str) -> str:
    return f"{namespace}{RESPONSE_FAMILY}{request_id}"


def cancel_key(namespace: str, request_id: str) -> str:
    return f"{namespace}{CANCEL_FAMILY}{request_id}"


def live_key(namespace: str, follow_id: str) -> str:
    return f"{namespace}{LIVE_FAMILY}{follow_id}"


@dataclass(frozen=True)
class ResponseEvent:
    id: str
    type: str
    data: dict[str, Any]

    @property
    def event(self) -> StreamEvent | None:
        """The typed event (routing.contract.tasks); None for a type the contract does not know."""
        return parse_event(self.type, self.data)


class ResponseWriter:
    """The worker's side: one writer per request."""

    def __init__(self, client: redis.Redis, namespace: str, request_id: str) -> None:
        self._client = client
        self._key = response_key(namespace, request_id)
        self._cancel_key = cancel_key(namespace, request_id)
        self._namespace = namespace
        self._live_key: str | None = None
        self._expiry_set = False
        self.abandoned = False  # the frontend's liveness mark expired: nobody reads this answer
        self.cancel_seen = False  # the frontend asked this worker to stop

    def follow(self, follow_id: str | None) -> None:
        """Watch the frontend's liveness mark for this request too (see LIVE_FAMILY)."""
        self._live_key = live_key(self._namespace, follow_id) if follow_id else None

    def send(self, event_type: str, **data: Any) -> None:
        fields = {"type": event_type, "data": json.dumps(data)}
        if self._expiry_set:
            # A token's path: one plain command (a pipeline object costs ~40 us more per event).
            self._client.xadd(self._key, fields)
            return
        pipe = self._client.pipeline(transaction=False)
        pipe.xadd(self._key, fields)
        pipe.expire(self._key, RESPONSE_TTL_SECS)
        pipe.execute()
        self._expiry_set = True

    def emit(self, event: StreamEvent) -> None:
        """Append one typed event of the contract."""
        self.send(event.type, **event_data(event))

    def cancelled(self) -> bool:
        """Whether to stop: the frontend asked (the client went away, the request timed out:
        `cancel_seen`), or the frontend itself is gone (its liveness mark expired without a
        cancel: `abandoned`). A frontend that ends a request sets its cancel before it drops the
        mark, so a deliberate stop never reads as a dead frontend."""
        if self._live_key is None:
            cancelled, followed = self._client.exists(self._cancel_key), True
        else:
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(self._cancel_key)
            pipe.exists(self._live_key)
            cancelled, followed = pipe.execute()
        if cancelled:
            self.cancel_seen = True
        elif not followed:
            self.abandoned = True
        return bool(cancelled) or not followed


def parse_stream_entries(entries: list[Any]) -> list[ResponseEvent]:
    """Stream entries as a client returns them (redis-py: each entry's fields a dict) or as Redis
    sends them (a direct line: a flat name, value, name, value list under RESP2)."""
    events = []
    for entry_id, fields in entries:
        entry_id = reply_text(entry_id)
        pairs = fields.items() if isinstance(fields, dict) else zip(fields[::2], fields[1::2], strict=True)
        decoded = {reply_text(k): v for k, v in pairs}
        raw_type = decoded.get("type", b"")
        event_type = reply_text(raw_type)
        events.append(ResponseEvent(entry_id, event_type, json.loads(decoded.get("data", b"{}"))))
    return events


def response_read(namespace: str, request_id: str, last_id: str, block_ms: int) -> tuple[Any, ...]:
    """The command that reads a request's events after `last_id`, waiting up to `block_ms` for the
    first one (`parse_response_read` reads its reply): for a caller that sends it along with
    commands of its own in one round trip."""
    return ("XREAD", "COUNT", 256, "BLOCK", block_ms, "STREAMS", response_key(namespace, request_id), last_id)


def parse_response_read(reply: Any) -> list[ResponseEvent]:
    """`response_read`'s reply as Redis sends it (a direct line): its events, in order."""
    if not reply:
        return []
    ((_key, entries),) = reply.items() if isinstance(reply, dict) else reply  # RESP3 answers a map
    return parse_stream_entries(entries)


async def read_response_events(
    lines: Any, namespace: str, request_id: str, last_id: str, block_ms: int
) -> list[ResponseEvent]:
    """Events after `last_id`, waiting up to `block_ms` for the first one, on an event loop's own
    connections (`lines`: routing.state.redis_direct.AsyncDirectCommands). Its reply is Redis's
    own: redis-py's XREAD parses the same entries for about four times the CPU."""
    return parse_response_read(await lines.execute(*response_read(namespace, request_id, last_id, block_ms)))
