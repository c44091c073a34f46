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
from typing import Any, NamedTuple

import redis

from routing.contract.kv_events import check_worker_name
from routing.kv.index import LuaScript, execute_pipeline

REQUESTS_FAMILY = "load:req:"
TOTALS_KEY = "load:totals"
EXPIRY_KEY = "load:expiry"
_TOTALS = struct.Struct(">qqqq")  # TOTALS_FORMAT in the Lua below

DEFAULT_ENTRY_TTL_S = 300.0  # Dynamo sweeps stale load after five minutes
_SWEEP_BATCH = 256  # expired entries released per snapshot; the rest go at the next one


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


_LOAD_LUA_FUNCTIONS = """
local function server_time_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A worker's field of load:totals: prefill tokens, blocks, requests, drained at (ms), as
-- Python's `_TOTALS`. Whatever reads or writes the field (the router's decision script too)
-- uses this format.
local TOTALS_FORMAT = '>i8i8i8i8'

local function totals_of(ns, worker)
  local raw = redis.call('HGET', ns .. 'load:totals', worker)
  if not raw then return 0, 0, 0, 0 end
  local prefill, blocks, requests, drained_at = struct.unpack(TOTALS_FORMAT, raw)
  return prefill, blocks, requests, drained_at
end

-- Adds to a worker's sums; `drained_at` (nil: kept) replaces its drain estimate, which goes
-- when nothing reserved is left to drain. The field goes with the worker's last request.
local function adjust(ns, worker, prefill, blocks, requests, drained_at)
  local p, b, r, d = totals_of(ns, worker)
  p, b, r = p + prefill, b + blocks, r + requests
  if r <= 0 then
    redis.call('HDEL', ns .. 'load:totals', worker)
    return
  end
  if drained_at then d = drained_at end
  if p <= 0 then d = 0 end
  redis.call('HSET', ns .. 'load:totals', worker, struct.pack(TOTALS_FORMAT, p, b, r, d))
end

local function entry_of(ns, worker, request_id)
  local raw = redis.call('HGET', ns .. 'load:req:' .. worker, request_id)
  if not raw then return nil end
  local space = string.find(raw, ' ', 1, true)
  return tonumber(string.sub(raw, 1, space - 1)), tonumber(string.sub(raw, space + 1))
end

local function release(ns, worker, request_id)
  redis.call('ZREM', ns .. 'load:expiry', worker .. '\\n' .. request_id)
  local prefill, blocks = entry_of(ns, worker, request_id)
  if not prefill then return 0 end
  redis.call('HDEL', ns .. 'load:req:' .. worker, request_id)
  if redis.call('EXISTS', ns .. 'load:req:' .. worker) == 0 then
    -- The worker's last request: nothing is in flight there, whatever its sums say. A sum that
    -- drifted (a process of an older layout freed an entry without it) heals here.
    redis.call('HDEL', ns .. 'load:totals', worker)
  else
    adjust(ns, worker, -prefill, -blocks, -1)
  end
  return 1
end
"""

_ADD_LUA = (
    _LOAD_LUA_FUNCTIONS
    + """
-- ARGV: ns, worker, request id, prefill tokens, blocks, ttl ms
local ns, worker, request_id = ARGV[1], ARGV[2], ARGV[3]
local prefill, blocks = tonumber(ARGV[4]), tonumber(ARGV[5])
release(ns, worker, request_id)  -- a re-add replaces, never double counts
redis.call('HSET', ns .. 'load:req:' .. worker, request_id, prefill .. ' ' .. blocks)
adjust(ns, worker, prefill, blocks, 1)
redis.call('ZADD', ns .. 'load:expiry', server_time_ms() + tonumber(ARGV[6]), worker .. '\\n' .. request_id)
return 1
"""
)

_PREFILL_DONE_LUA = (
    _LOAD_LUA_FUNCTIONS
    + """
-- ARGV: ns, worker, request id, ttl ms
local ns, worker, request_id = ARGV[1], ARGV[2], ARGV[3]
local prefill, blocks = entry_of(ns, worker, request_id)
if not prefill then return 0 end
if prefill > 0 then
  redis.call('HSET', ns .. 'load:req:' .. worker, request_id, '0 ' .. blocks)
  adjust(ns, worker, -prefill, 0, 0)
end
-- Decoding has begun: the request is alive, so its expiry starts again.
local member = worker .. '\\n' .. request_id
redis.call('ZADD', ns .. 'load:expiry', 'XX', server_time_ms() + tonumber(ARGV[4]), member)
return 1
"""
)

_FREE_LUA = _LOAD_LUA_FUNCTIONS + "return release(ARGV[1], ARGV[2], ARGV[3])\n"

_RENEW_LUA = (
    _LOAD_LUA_FUNCTIONS
    + """
-- ARGV: ns, worker, request id, ttl ms -> 1 if the entry is still tracked
return redis.call('ZADD', ARGV[1] .. 'load:expiry', 'XX', 'CH', server_time_ms() + tonumber(ARGV[4]),
  ARGV[2] .. '\\n' .. ARGV[3])
"""
)

_FREE_WORKER_LUA = (
    _LOAD_LUA_FUNCTIONS
    + """
-- ARGV: ns, worker -> how many requests were freed
local ids = redis.call('HKEYS', ARGV[1] .. 'load:req:' .. ARGV[2])
for _, request_id in ipairs(ids) do release(ARGV[1], ARGV[2], request_id) end
return #ids
"""
)

# The sweep of expired entries, as a Lua function the router's decision script embeds too.
SWEEP_LUA_FUNCTIONS = (
    _LOAD_LUA_FUNCTIONS
    + """
local function load_sweep(ns)
  local expired = redis.call('ZRANGEBYSCORE', ns .. 'load:expiry', '-inf', server_time_ms(),
    'LIMIT', 0, {sweep_batch})
  for _, member in ipairs(expired) do
    local cut = string.find(member, '\\n', 1, true)
    release(ns, string.sub(member, 1, cut - 1), string.sub(member, cut + 1))
  end
  return #expired
end
""".replace("{sweep_batch}", str(_SWEEP_BATCH))
)

_SWEEP_LUA = SWEEP_LUA_FUNCTIONS + "return load_sweep(ARGV[1])\n"


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

    def free(self, worker: str, request_id: str) -> bool:
        """Completion, failure or cancellation. False if it was not tracked (already freed)."""
        return bool(self._free(self._namespace, check_worker_name(worker), request_id))

    def renew(self, worker: str, request_id: str, ttl_s: float) -> bool:
        """Push the entry's expiry to now + ttl_s (its frontend still follows it)."""
        ttl_ms = max(int(ttl_s * 1000), 1)
        return bool(self._renew(self._namespace, check_worker_name(worker), request_id, ttl_ms))

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
