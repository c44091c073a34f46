"""Active load per worker in Redis, shared by every frontend process: prefill tokens, decode blocks.

Lifecycle (Dynamo's): `add` when a request is dispatched, `prefill_done` at its first token,
`free` on completion, failure or cancellation. A request counts its prefill tokens until its
first token, and all of its blocks until it is freed: like Dynamo's potential decode blocks,
the prompt's blocks stay resident for the whole decode, so a request in prefill already weighs
on decode capacity. Entries left by a frontend or worker that died expire after entry_ttl_s.

Layout:
- `load:req:<worker>`: hash, request id -> "<prefill tokens still to do> <blocks>".
- `load:totals`: hash, worker -> its running sums, four big-endian i64s (`parse_totals`): prefill
  tokens reserved, decode blocks, requests in flight, and when its reserved prefill should be done
  (Redis time, ms; 0: no estimate), the last written by the router's decision script
  (routing.kv.router, "Prefill drain") and zeroed by `adjust` when the reserved prefill reaches 0.
  One small hash whatever the number of requests in flight, one field per worker, which goes
  when the worker has no request left: a decision reads it whole in one call, and unpacks one
  string per worker rather than parse four numbers out of four hashes (about 60 us less inside
  Redis for 64 workers, bench/routing.py). The sums are derived from `load:req:<worker>`, so
  they go whole when its last entry goes: a sum that drifted heals then.
- `load:expiry`: sorted set, `<worker>\\n<request id>` scored by expiry (Redis server time, ms),
  swept by a Lua script right before every snapshot (the router's decision script runs it).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import redis

from routing.contract.kv_events import check_worker_name
from routing.state.lua import LuaScript, execute_pipeline, lua_constants, lua_script, lua_text

if TYPE_CHECKING:
    from routing.state.redis_direct import AsyncDirectCommands, Command

REQUESTS_FAMILY = "load:req:"
TOTALS_KEY = "load:totals"
EXPIRY_KEY = "load:expiry"
_TOTALS = struct.Struct(">qqqq")  # TOTALS_FORMAT in lua/load_functions.lua

DEFAULT_ENTRY_TTL_S = 300.0  # Dynamo sweeps stale load after five minutes


class WorkerLoad(NamedTuple):
    active_prefill_tokens: int = 0
    active_decode_blocks: int = 0
    active_requests: int = 0


IDLE = WorkerLoad()


class Totals(NamedTuple):
    """A worker's field of `load:totals`."""

    prefill_tokens: int
    decode_blocks: int
    requests: int
    drained_at_ms: int  # when its reserved prefill should be done (Redis time); 0: no estimate


def parse_totals(raw: bytes) -> Totals:
    return Totals(*_TOTALS.unpack(raw))


# The tracker's Lua, in routing/kv/lua/: its functions, composed in front of each script.
_LOAD_LUA_FUNCTIONS = lua_constants(
    REQUESTS_FAMILY=REQUESTS_FAMILY, TOTALS_KEY=TOTALS_KEY, EXPIRY_KEY=EXPIRY_KEY
) + lua_text(__package__, "load_functions.lua")
# The sweep of expired entries, as a Lua function the router's decision script embeds too.
SWEEP_LUA_FUNCTIONS = _LOAD_LUA_FUNCTIONS + lua_text(__package__, "sweep_functions.lua")

_ADD_LUA = lua_script(__package__, "load_add.lua", _LOAD_LUA_FUNCTIONS)
_PREFILL_DONE_LUA = lua_script(__package__, "load_prefill_done.lua", _LOAD_LUA_FUNCTIONS)
_FREE_LUA = lua_script(__package__, "load_free.lua", _LOAD_LUA_FUNCTIONS)
_RENEW_LUA = lua_script(__package__, "load_renew.lua", _LOAD_LUA_FUNCTIONS)
_FREE_WORKER_LUA = lua_script(__package__, "load_free_worker.lua", _LOAD_LUA_FUNCTIONS)
_SWEEP_LUA = lua_script(__package__, "load_sweep.lua", SWEEP_LUA_FUNCTIONS)


class LoadTracker:
    """Prefill and decode load of each worker, as every frontend process sees it."""

    def __init__(
        self, client: redis.Redis, namespace: str, *, entry_ttl_s: float = DEFAULT_ENTRY_TTL_S
    ) -> None:
        self._namespace = namespace
        self._ttl_ms = max(int(entry_ttl_s * 1000), 1)
        self._add = LuaScript(client, _ADD_LUA)
        self._prefill_done = LuaScript(client, _PREFILL_DONE_LUA)
        self._free = LuaScript(client, _FREE_LUA)
        self._free_worker = LuaScript(client, _FREE_WORKER_LUA)
        self._renew = LuaScript(client, _RENEW_LUA)
        self.sweep_script = LuaScript(client, _SWEEP_LUA)
        self._client = client

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def entry_ttl_ms(self) -> int:
        return self._ttl_ms

    def add(self, worker: str, request_id: str, prefill_tokens: int, blocks: int) -> None:
        if prefill_tokens < 0 or blocks < 0:
            raise ValueError("prefill_tokens and blocks must be >= 0")
        self._add(
            self._namespace,
            check_worker_name(worker),
            request_id,
            int(prefill_tokens),
            int(blocks),
            self._ttl_ms,
        )

    def prefill_done(self, worker: str, request_id: str) -> bool:
        """The first token came: the request leaves prefill. False if it is not tracked."""
        return bool(self._prefill_done(self._namespace, check_worker_name(worker), request_id, self._ttl_ms))

    async def aprefill_done(
        self, lines: AsyncDirectCommands, worker: str, request_id: str, *, along: Sequence[Command] = ()
    ) -> tuple[bool, list[Any]]:
        """`prefill_done` on an event loop's own connections (`lines`): no thread to hand it to.
        `along`: commands of the caller's sent after it in the same round trip; their replies
        come back beside the move's answer (`LuaScript.acall_along`)."""
        args = (self._namespace, check_worker_name(worker), request_id, self._ttl_ms)
        if not along:
            return bool(await self._prefill_done.acall(lines, *args)), []
        moved, replies = await self._prefill_done.acall_along(lines, *args, along=along)
        return bool(moved), replies

    def free(self, worker: str, request_id: str) -> bool:
        """Completion, failure or cancellation. False if it was not tracked (already freed)."""
        return bool(self._free(self._namespace, check_worker_name(worker), request_id))

    async def afree(
        self, lines: AsyncDirectCommands, worker: str, request_id: str, *, along: Sequence[Command] = ()
    ) -> bool:
        """`free` on an event loop's own connections (`lines`); `along`: commands of the caller's
        sent after it in the same round trip (`LuaScript.acall`)."""
        args = (self._namespace, check_worker_name(worker), request_id)
        return bool(await self._free.acall(lines, *args, along=along))

    def renew(self, worker: str, request_id: str, ttl_s: float) -> bool:
        """Push the entry's expiry to now + ttl_s (its frontend still follows it)."""
        ttl_ms = max(int(ttl_s * 1000), 1)
        return bool(self._renew(self._namespace, check_worker_name(worker), request_id, ttl_ms))

    async def arenew(self, lines: AsyncDirectCommands, worker: str, request_id: str, ttl_s: float) -> bool:
        """`renew` on an event loop's own connections (`lines`)."""
        ttl_ms = max(int(ttl_s * 1000), 1)
        return bool(
            await self._renew.acall(lines, self._namespace, check_worker_name(worker), request_id, ttl_ms)
        )

    def sweep(self) -> int:
        """Release entries whose time ran out; how many (workers run it with every heartbeat)."""
        return int(self.sweep_script(self._namespace))

    def free_worker(self, worker: str) -> int:
        """Free every request of a worker (its process was replaced); how many there were."""
        return int(self._free_worker(self._namespace, check_worker_name(worker)))

    def snapshot(self, workers: Sequence[str]) -> dict[str, WorkerLoad]:
        """Load of each worker (one round trip), after sweeping entries whose time ran out."""
        workers = list(dict.fromkeys(workers))
        pipe = self._client.pipeline(transaction=False)
        self.sweep_script.queue(pipe, self._namespace)
        self.queue_totals(pipe)
        replies = execute_pipeline(pipe, [self.sweep_script])
        return dict(zip(workers, self.loads(replies[1], workers), strict=True))

    def totals(self, worker: str) -> Totals | None:
        """A worker's running sums as stored (None: no request in flight), without a sweep."""
        raw = self._client.hget(f"{self._namespace}{TOTALS_KEY}", check_worker_name(worker))
        return None if raw is None else parse_totals(raw)

    def queue_totals(self, pipe: redis.client.Pipeline) -> None:
        """Queue a read of every worker's running sums (after a sweep), for `loads`.

        HGETALL rather than HMGET: the hash is a small listpack, which HMGET scans once per
        asked field (64 workers: 64 x 64 compares) and HGETALL reads once.
        """
        pipe.hgetall(f"{self._namespace}{TOTALS_KEY}")

    @staticmethod
    def loads(reply: dict[Any, Any], workers: Sequence[str]) -> list[WorkerLoad]:
        """The queued read as each worker's load, in the workers' order (IDLE: none)."""
        if reply and isinstance(next(iter(reply)), bytes):
            # Look the names up as bytes rather than decode every key the hash holds.
            names: Sequence[Any] = [worker.encode() for worker in workers]
        else:
            names = workers
        get, unpack = reply.get, _TOTALS.unpack
        loads = []
        for name in names:
            raw = get(name)
            loads.append(IDLE if raw is None else WorkerLoad(*unpack(raw)[:3]))
        return loads
