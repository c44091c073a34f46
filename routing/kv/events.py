"""The publication of a worker's KV events (`routing.contract.kv_events`) into the index.

A publish applies the events to the router's index and appends them to the capped stream
`kv:events` in one Lua call, so the index mirrors the worker's cache at once and in order, and
observers (dashboards, a rebuilding router) can replay the stream.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import redis

from routing.contract.kv_events import KvEvent
from routing.kv.index import EVENTS_STREAM, INDEX_LUA_FUNCTIONS, STREAM_MAXLEN, KvIndex, pack_hashes
from routing.state.lua import LuaScript, lua_script
from routing.state.redis_keys import reply_text

__all__ = ["EVENTS_STREAM", "STREAM_MAXLEN", "KvEventPublisher", "read_events"]

_PUBLISH_LUA = lua_script(__package__, "publish_events.lua", INDEX_LUA_FUNCTIONS)


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
            text = {reply_text(k): reply_text(v) for k, v in fields.items()}
            data = json.loads(text["event"])
            data["event_id"] = int(text["event_id"])
            out.append((reply_text(stream_id), KvEvent.from_dict(data)))
    return out
