"""The router's KV index in Redis: which worker holds which prefix block, and the overlap query.

Layout (every key under the deployment namespace; block hashes are u64s packed as 8 big-endian
bytes, against up to 20 as decimal text: shorter keys, and one Lua argument carries a whole
prompt's hashes, sliced with string.sub instead of parsed):

- `kv:blk:<hash>`: a Redis hash whose fields are the workers holding the block. A small hash is
  stored as a listpack, far smaller than a set of strings; HLEN counts its holders in O(1),
  which the overlap query bisects on (see kv_overlaps_bisect).
- `kv:w:<worker>`: a set of the worker's block hashes, so a purge finds what to drop.
- `kv:approx:<worker>`: the blocks the router itself sent to a worker, scored by expiry (Redis
  server time, milliseconds): for a worker that publishes no events (approximate mode) its
  only credit, for the others predicted blocks with a short TTL that cover the time until the
  worker's own `stored` events arrive.
  `kv:approximate` is the set of workers that have one (at most one entry per worker), so the
  overlap query looks for approximate blocks only where there can be some.

Both event-backed keys are kept consistent inside Lua, and Redis deletes a hash or set when its
last member goes, so nothing stays behind after a worker removes its blocks or is purged.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import redis

from routing.contract.kv_events import check_worker_name
from routing.state.redis_direct import direct_commands

if TYPE_CHECKING:
    from routing.contract.kv_events import KvEvent

BLOCK_FAMILY = "kv:blk:"
WORKER_FAMILY = "kv:w:"
APPROXIMATE_FAMILY = "kv:approx:"
# A random token set by whoever first finds it missing. Redis restarted without its data (or
# flushed) loses it with the index: a worker that sees it change re-announces its blocks.
EPOCH_KEY = "kv:epoch"

DEFAULT_APPROXIMATE_TTL_S = 120.0  # Dynamo's approximate-mode default

_U64_MAX = (1 << 64) - 1

# Lua shared by the index's own scripts and the event publisher's (which must apply events and
# append them to the stream in one atomic call). Keys are built inside the script because a
# prompt's blocks are only known there; the deployment is a single Redis, not a cluster.
INDEX_LUA_FUNCTIONS = """
local function kv_store(ns, worker, packed)
  local worker_key = ns .. 'kv:w:' .. worker
  for i = 1, #packed, 8 do
    local h = string.sub(packed, i, i + 7)
    redis.call('HSET', ns .. 'kv:blk:' .. h, worker, '1')
    redis.call('SADD', worker_key, h)
  end
end

local function kv_remove(ns, worker, packed)
  local worker_key = ns .. 'kv:w:' .. worker
  for i = 1, #packed, 8 do
    local h = string.sub(packed, i, i + 7)
    redis.call('HDEL', ns .. 'kv:blk:' .. h, worker)
    redis.call('SREM', worker_key, h)
  end
end

local function kv_purge(ns, worker)
  local worker_key = ns .. 'kv:w:' .. worker
  local held = redis.call('SMEMBERS', worker_key)
  for _, h in ipairs(held) do
    redis.call('HDEL', ns .. 'kv:blk:' .. h, worker)
  end
  redis.call('DEL', worker_key, ns .. 'kv:approx:' .. worker)
  redis.call('SREM', ns .. 'kv:approximate', worker)
  return #held
end

local function kv_apply(ns, kind, worker, packed)
  if kind == 'stored' then
    kv_store(ns, worker, packed)
  elseif kind == 'removed' then
    kv_remove(ns, worker, packed)
  elseif kind == 'cleared' then
    kv_purge(ns, worker)
  else
    return redis.error_reply('unknown kv event kind ' .. kind)
  end
end

local function server_time_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Blocks the router sent to a worker, credited to it until now + ttl (approximate mode, and
-- the predicted blocks of event-publishing workers until their own events arrive).
local function kv_predict(ns, worker, packed, now, ttl)
  local key = ns .. 'kv:approx:' .. worker
  local expiry = now + ttl
  local args = {}
  for i = 1, #packed, 8 do
    args[#args + 1] = expiry
    args[#args + 1] = string.sub(packed, i, i + 7)
    if #args >= 1000 then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  if #args > 0 then redis.call('ZADD', key, unpack(args)) end
  -- Expired entries go at every write and the key itself expires with its newest entry,
  -- so a worker the router stops using leaves nothing behind.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  redis.call('SADD', ns .. 'kv:approximate', worker)
end
"""

_APPLY_LUA = (
    INDEX_LUA_FUNCTIONS
    + """
-- ARGV: ns, then (kind, worker, packed hashes) per event
local ns = ARGV[1]
for i = 2, #ARGV, 3 do
  local err = kv_apply(ns, ARGV[i], ARGV[i + 1], ARGV[i + 2])
  if err then return err end
end
return 0
"""
)

_PURGE_LUA = INDEX_LUA_FUNCTIONS + "return kv_purge(ARGV[1], ARGV[2])\n"

_RECORD_ROUTED_LUA = (
    INDEX_LUA_FUNCTIONS
    + """
-- ARGV: ns, worker, ttl_ms, packed hashes
kv_predict(ARGV[1], ARGV[2], ARGV[4], server_time_ms(), tonumber(ARGV[3]))
return 0
"""
)

# The overlap query, as Lua functions the router's decision script embeds too. Both variants
# look for approximate blocks only for workers listed in `kv:approximate` (one SMISMEMBER).
OVERLAPS_LUA_FUNCTIONS = """
local function kv_overlap_probe(ns, packed, workers)
  local approximate = {}
  local any_approximate = false
  local now = 0
  if #packed > 0 and #workers > 0 then
    local flags = redis.call('SMISMEMBER', ns .. 'kv:approximate', unpack(workers))
    for j, worker in ipairs(workers) do
      if flags[j] == 1 then
        approximate[worker] = ns .. 'kv:approx:' .. worker
        any_approximate = true
      end
    end
    if any_approximate then now = server_time_ms() end
  end
  -- Splits a group into the workers that hold block b and the others, in one HMGET.
  return function(b, group)
    local h = string.sub(packed, b * 8 - 7, b * 8)
    local held = redis.call('HMGET', ns .. 'kv:blk:' .. h, unpack(group))
    local yes, no = {}, {}
    for j, worker in ipairs(group) do
      local holds = held[j]
      if not holds and any_approximate and approximate[worker] then
        local expiry = redis.call('ZSCORE', approximate[worker], h)
        holds = expiry and tonumber(expiry) > now
      end
      if holds then yes[#yes + 1] = worker else no[#no + 1] = worker end
    end
    return yes, no
  end
end

-- Numeric loops rather than ipairs on the per-worker passes: ipairs is a function call per
-- element in Redis's Lua 5.1, and these run on every routing decision.
local function kv_overlap_list(workers, overlap)
  local out = {}
  for i = 1, #workers do out[i] = overlap[workers[i]] or 0 end
  return out
end

-- Exact walk, block by block in prompt order, asking only the workers that matched every
-- block so far and stopping when none is left. Cost: the sum over blocks of workers alive.
-- `position` goes unused: it is in the signature because the decision script calls whichever
-- variant the index uses with the same arguments, and the bisect one reads it.
local function kv_overlaps_linear(ns, packed, workers, position)
  local holders = kv_overlap_probe(ns, packed, workers)
  local overlap = {}
  local alive = workers
  for b = 1, #packed / 8 do
    if #alive == 0 then break end
    local yes = holders(b, alive)
    for _, worker in ipairs(yes) do overlap[worker] = b end
    alive = yes
  end
  return kv_overlap_list(workers, overlap)
end

-- Change points of the holder count. When every worker's blocks are prefix-closed (holding
-- block b means holding every block before it), the holders of the request's blocks are
-- nested, shrinking sets, so equal HLENs at two blocks mean the same holders at every block
-- between them. Bisecting on HLEN (O(1) each) finds the blocks after which some workers drop
-- out, about (distinct overlaps) x log2(blocks) calls whatever the number of workers; reading
-- the holders of those blocks alone, deepest first, gives each worker its overlap. A prefix
-- cache that evicts leaves first (ours, vLLM's, SGLang's) keeps its blocks prefix-closed:
-- sequence hashes chain, so a block is never cached without the prefix it extends.
-- Approximate records are searched per worker (they are a prefix too: a route refreshes the
-- whole chain it records), and a worker's overlap is the larger of the two.
local function kv_overlaps_bisect(ns, packed, workers, position)
  local n, m = #packed / 8, #workers
  -- Overlaps by the workers' positions (0: none yet); `position` maps a name to its place, made
  -- here unless the caller has one (the decision script does). Names are distinct.
  if not position then
    position = {}
    for i = 1, m do position[workers[i]] = i end
  end
  local out = {}
  for i = 1, m do out[i] = 0 end
  local unassigned = m
  local prefix, sub, call = ns .. 'kv:blk:', string.sub, redis.call
  local function count(b) return call('HLEN', prefix .. sub(packed, b * 8 - 7, b * 8)) end
  if n > 0 and unassigned > 0 then
    local first = count(1)
    if first > 0 then
      local changes = {}  -- blocks b whose holders are not all holders of b + 1
      local last = count(n)
      if last > 0 then changes[1] = n end
      -- Segments still to search (from, its count, to, its count), as four stacks: no table
      -- per segment.
      local los, clos, his, chis, top = {1}, {first}, {n}, {last}, 1
      while top > 0 do
        local lo, clo, hi, chi = los[top], clos[top], his[top], chis[top]
        top = top - 1
        if clo ~= chi then
          if hi == lo + 1 then
            changes[#changes + 1] = lo
          else
            local mid = math.floor((lo + hi) / 2)
            local cmid = count(mid)
            los[top + 1], clos[top + 1], his[top + 1], chis[top + 1] = lo, clo, mid, cmid
            los[top + 2], clos[top + 2], his[top + 2], chis[top + 2] = mid, cmid, hi, chi
            top = top + 2
          end
        end
      end
      table.sort(changes, function(a, b) return a > b end)
      for k = 1, #changes do
        local b = changes[k]
        local holders = call('HKEYS', prefix .. sub(packed, b * 8 - 7, b * 8))
        for i = 1, #holders do
          local j = position[holders[i]]
          if j and out[j] == 0 then
            out[j] = b
            unassigned = unassigned - 1
          end
        end
        if unassigned == 0 then break end
      end
    end
  end
  if n > 0 and m > 0 and redis.call('EXISTS', ns .. 'kv:approximate') == 1 then
    local flags = redis.call('SMISMEMBER', ns .. 'kv:approximate', unpack(workers))
    local now = nil
    for j = 1, m do
      if flags[j] == 1 then
        now = now or server_time_ms()
        local key = ns .. 'kv:approx:' .. workers[j]
        local function held(b)
          local expiry = redis.call('ZSCORE', key, string.sub(packed, b * 8 - 7, b * 8))
          return expiry and tonumber(expiry) > now
        end
        local best = out[j]
        if best < n and held(best + 1) then
          -- Largest k with block k held: the last block first, then bisection.
          local lo, hi = best + 1, n
          if held(hi) then lo = hi end
          while lo < hi do
            local mid = math.floor((lo + hi + 1) / 2)
            if held(mid) then lo = mid else hi = mid - 1 end
          end
          out[j] = lo
        end
      end
    end
  end
  return out
end
"""

_OVERLAPS_SCRIPT = (
    INDEX_LUA_FUNCTIONS
    + OVERLAPS_LUA_FUNCTIONS
    + "return {fn}(ARGV[1], ARGV[2], {unpack(ARGV, 3)})\n"  # ns, packed hashes, worker...
)

_WORKER_BLOCKS_LUA = (
    INDEX_LUA_FUNCTIONS
    + """
-- ARGV: ns, worker -> {event-backed blocks, unexpired approximate blocks}
local now = server_time_ms()
return {
  redis.call('SMEMBERS', ARGV[1] .. 'kv:w:' .. ARGV[2]),
  redis.call('ZRANGEBYSCORE', ARGV[1] .. 'kv:approx:' .. ARGV[2], '(' .. now, '+inf'),
}
"""
)

_BLOCK_COUNTS_LUA = (
    INDEX_LUA_FUNCTIONS
    + """
-- ARGV: ns, worker... -> per worker: event-backed blocks + unexpired approximate blocks
local now = server_time_ms()
local out = {}
for i = 2, #ARGV do
  out[#out + 1] = redis.call('SCARD', ARGV[1] .. 'kv:w:' .. ARGV[i])
    + redis.call('ZCOUNT', ARGV[1] .. 'kv:approx:' .. ARGV[i], '(' .. now, '+inf')
end
return out
"""
)


def pack_hashes(block_hashes: Sequence[int]) -> bytes:
    """u64 block hashes as consecutive 8-byte big-endian values (the index's key encoding)."""
    try:
        return struct.pack(f">{len(block_hashes)}Q", *block_hashes)
    except struct.error as exc:
        raise ValueError(f"block hashes must be u64 integers: {exc}") from None


def unpack_hashes(packed: bytes) -> list[int]:
    return list(struct.unpack(f">{len(packed) // 8}Q", packed))


def checked_workers(workers: Sequence[str]) -> Sequence[str]:
    """The names, refused if one cannot be a key part; one scan for the whole list."""
    # A name holding a newline shows as an extra separator, an empty name as a falsy element.
    if "\n".join(workers).count("\n") != max(len(workers) - 1, 0) or not all(workers):
        for worker in workers:
            check_worker_name(worker)
    return workers


class LuaScript:
    """A script run by SHA, loaded on first use and again if Redis forgot it (restart, flush).

    redis-py's own Script checks SCRIPT EXISTS before every pipeline, an extra round trip the
    router's one-round-trip decision cannot afford; here a pipeline just sends EVALSHA. A call
    goes on the client's direct line (routing.state.redis_direct): the scripts are the router's hot
    path, and redis-py's per-command overhead is as long as the round trip.
    """

    def __init__(self, client: redis.Redis, source: str) -> None:
        self._direct = direct_commands(client)
        self.source = source
        self.sha = self._load()  # on the direct line: its connection is open before the first call

    def _load(self) -> str:
        sha = self._direct.execute("SCRIPT", "LOAD", self.source)
        return sha.decode() if isinstance(sha, bytes) else sha

    def __call__(self, *args: Any) -> Any:
        try:
            return self._direct.execute("EVALSHA", self.sha, 0, *args)
        except redis.exceptions.NoScriptError:
            self.sha = self._load()
            return self._direct.execute("EVALSHA", self.sha, 0, *args)

    def queue(self, pipe: redis.client.Pipeline, *args: Any) -> None:
        pipe.evalsha(self.sha, 0, *args)

    def reload(self) -> None:
        self.sha = self._load()


def execute_pipeline(pipe: redis.client.Pipeline, scripts: Iterable[LuaScript]) -> list[Any]:
    """Run a pipeline of EVALSHAs; if Redis lost the scripts, load them and run it once more.

    Only for pipelines whose commands can safely run twice (reads, idempotent sweeps).
    """
    commands = list(pipe.command_stack)
    try:
        return pipe.execute()
    except redis.exceptions.NoScriptError:
        reloaded = {}
        for script in scripts:
            old = script.sha
            script.reload()
            reloaded[old] = script.sha
        pipe.reset()
        for args, options in commands:
            if args[0] == "EVALSHA" and args[1] in reloaded:
                args = (args[0], reloaded[args[1]], *args[2:])
            pipe.execute_command(*args, **options)
        return pipe.execute()


class KvIndex:
    """Which worker holds which block, as the router sees it, shared by every frontend process.

    Block hashes travel as raw bytes: the client must not decode responses.
    """

    def __init__(self, client: redis.Redis, namespace: str, *, prefix_closed: bool = True) -> None:
        """prefix_closed: workers' blocks form prefixes (see kv_overlaps_bisect), so overlaps
        may bisect; False walks every block (exact whatever the events, slower on long prompts).
        """
        self._client = client
        self._namespace = namespace
        self._apply = LuaScript(client, _APPLY_LUA)
        self._purge = LuaScript(client, _PURGE_LUA)
        self._record = LuaScript(client, _RECORD_ROUTED_LUA)
        # The name of the Lua overlap function, for scripts (the router's) that embed it.
        self.overlaps_function = "kv_overlaps_bisect" if prefix_closed else "kv_overlaps_linear"
        self.overlaps_script = LuaScript(client, _OVERLAPS_SCRIPT.replace("{fn}", self.overlaps_function))
        self._worker_blocks = LuaScript(client, _WORKER_BLOCKS_LUA)
        self._block_counts = LuaScript(client, _BLOCK_COUNTS_LUA)

    @property
    def namespace(self) -> str:
        return self._namespace

    def apply(self, event: KvEvent) -> None:
        """Apply one worker event (stored / removed / cleared) to the index."""
        self.apply_many([event])

    def apply_many(self, events: Sequence[KvEvent]) -> None:
        args: list[Any] = [self._namespace]
        for event in events:
            args += [event.kind, check_worker_name(event.worker), pack_hashes(event.block_hashes)]
        if events:
            self._apply(*args)

    def purge_worker(self, worker: str) -> int:
        """Drop every block of a worker (heartbeat lapsed, or it cleared its cache); how many."""
        return int(self._purge(self._namespace, check_worker_name(worker)))

    def record_routed(
        self, worker: str, block_hashes: Sequence[int], ttl_s: float = DEFAULT_APPROXIMATE_TTL_S
    ) -> None:
        """Approximate mode: assume the worker holds what the router just sent it, for ttl_s."""
        if not block_hashes:
            return
        ttl_ms = max(int(ttl_s * 1000), 1)
        self._record(self._namespace, check_worker_name(worker), ttl_ms, pack_hashes(block_hashes))

    def epoch(self) -> str:
        """The index's epoch, created if missing (one round trip; SET NX, so all agree on it)."""
        key = f"{self._namespace}{EPOCH_KEY}"
        proposed = uuid.uuid4().hex
        pipe = self._client.pipeline(transaction=False)
        pipe.set(key, proposed, nx=True)
        pipe.get(key)
        _created, current = pipe.execute()
        return current.decode() if isinstance(current, bytes) else str(current)

    def worker_blocks(self, worker: str) -> set[int]:
        """The blocks the index believes the worker holds (events, plus unexpired approximate)."""
        stored, approximate = self._worker_blocks(self._namespace, check_worker_name(worker))
        return {int.from_bytes(h, "big") for h in (*stored, *approximate)}

    def block_counts(self, workers: Sequence[str]) -> dict[str, int]:
        workers = list(dict.fromkeys(workers))
        if not workers:
            return {}
        counts = self._block_counts(self._namespace, *map(check_worker_name, workers))
        return dict(zip(workers, map(int, counts), strict=True))

    def overlaps(self, block_hashes: Sequence[int], workers: Sequence[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the request it holds (one round trip)."""
        workers = list(dict.fromkeys(workers))
        if not workers:
            return {}
        reply = self.overlaps_script(*self.overlaps_args(block_hashes, workers))
        return self.parse_overlaps(reply, workers)

    def overlaps_args(self, block_hashes: Sequence[int], workers: Sequence[str]) -> list[Any]:
        return [self._namespace, pack_hashes(block_hashes), *checked_workers(workers)]

    @staticmethod
    def parse_overlaps(reply: Sequence[int], workers: Sequence[str]) -> dict[str, int]:
        return dict(zip(workers, map(int, reply), strict=True))
