"""KV cache events (stored / removed / cleared) and their publication by a worker process.

A publish applies the events to the router's index and appends them to the capped stream
`kv:events` in one Lua call, so the index mirrors the worker's cache at once and in order, and
observers (dashboards, a rebuilding router) can replay the stream.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import redis

from routing.index import INDEX_LUA_FUNCTIONS, KvIndex, LuaScript, check_worker_name, pack_hashes

EVENTS_STREAM = "kv:events"
EVENT_IDS_KEY = "kv:event-ids"  # hash: worker -> last event id given to it
STREAM_MAXLEN = 10_000

KvEventKind = Literal["stored", "removed", "cleared"]
_KINDS = ("stored", "removed", "cleared")


@dataclass(frozen=True)
class KvEvent:
    kind: KvEventKind
    worker: str
    block_hashes: tuple[int, ...] = ()  # sequence hashes, in prompt order
    parent_hash: int | None = None  # sequence hash of the block before the first stored one
    local_hashes: tuple[int, ...] = ()
    event_id: int = 0  # per worker, increasing; assigned at publication

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown kv event kind {self.kind!r}")
        check_worker_name(self.worker)

    def to_dict(self) -> dict[str, Any]:
        # JSON keeps u64s exact (Python ints); JavaScript readers should treat them as strings.
        return {
            "kind": self.kind,
            "worker": self.worker,
            "block_hashes": list(self.block_hashes),
            "parent_hash": self.parent_hash,
            "local_hashes": list(self.local_hashes),
            "event_id": self.event_id,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvEvent:
        parent = data.get("parent_hash")
        return cls(
            kind=data["kind"],
            worker=str(data["worker"]),
            block_hashes=tuple(int(h) for h in data.get("block_hashes", ())),
            parent_hash=None if parent is None else int(parent),
            local_hashes=tuple(int(h) for h in data.get("local_hashes", ())),
            event_id=int(data.get("event_id", 0)),
        )


_PUBLISH_LUA = (
    INDEX_LUA_FUNCTIONS
    + """
-- ARGV: ns, maxlen, then (kind, worker, packed hashes, event json) per event
local ns = ARGV[1]
local stream = ns .. 'kv:events'
local ids_key = ns .. 'kv:event-ids'
local maxlen = ARGV[2]
local ids = {}
for i = 3, #ARGV, 4 do
  local kind, worker = ARGV[i], ARGV[i + 1]
  local err = kv_apply(ns, kind, worker, ARGV[i + 2])
  if err then return err end
  local event_id = redis.call('HINCRBY', ids_key, worker, 1)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*',
    'worker', worker, 'event_id', event_id, 'event', ARGV[i + 3])
  ids[#ids + 1] = event_id
end
return ids
"""
)


class KvEventPublisher:
    """The worker's side: every change to its prefix cache, published as it happens."""

    def __init__(
        self, client: redis.Redis, namespace: str, *, index: KvIndex, maxlen: int = STREAM_MAXLEN
    ) -> None:
        if index.namespace != namespace:
            raise ValueError("the publisher and its index must share one namespace")
        self._namespace = namespace
        self._maxlen = maxlen
        self._script = LuaScript(client, _PUBLISH_LUA)

    def publish(self, events: Sequence[KvEvent]) -> None:
        """Apply the events to the index and append them to the stream, atomically and in order."""
        if not events:
            return
        args: list[Any] = [self._namespace, self._maxlen]
        for event in events:
            # The id comes from Redis so a restarted worker process keeps counting up.
            payload = event.to_dict()
            del payload["event_id"]
            args += [event.kind, event.worker, pack_hashes(event.block_hashes), json.dumps(payload)]
        self._script(*args)


def read_events(
    client: redis.Redis, namespace: str, last_id: str = "0-0", count: int = 100
) -> list[tuple[str, KvEvent]]:
    """Events after stream id `last_id` (oldest first), each with its stream id to resume from."""
    reply = client.xread({f"{namespace}{EVENTS_STREAM}": last_id}, count=count)
    out: list[tuple[str, KvEvent]] = []
    for _stream, entries in reply or ():
        for stream_id, fields in entries:
            # Works whether or not the client decodes responses.
            text = {_text(k): _text(v) for k, v in fields.items()}
            data = json.loads(text["event"])
            data["event_id"] = int(text["event_id"])
            out.append((_text(stream_id), KvEvent.from_dict(data)))
    return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
