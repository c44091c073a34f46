"""The router's KV index in Redis: which worker holds which prefix block, and the overlap query.

Layout (every key under the deployment namespace; block hashes are u64s packed as 8 big-endian
bytes, against up to 20 as decimal text: shorter keys, and one Lua argument carries a whole
prompt's hashes, sliced with string.sub instead of parsed). Memory is what bounds the index on a
fleet: a key of its own per block cost ~120 bytes before its first holder, and a set member ~50,
so the index keeps blocks in buckets and workers as 2-byte ids:

- `kv:b:<first 2 bytes of the hash>`: a Redis hash, one of 65,536 buckets, whose fields are the
  other 6 bytes of its blocks' hashes and whose values are the holders: the 2-byte ids of the
  workers holding the block, concatenated. A bucket of up to `hash-max-listpack-entries` (512
  by default; 128 in the sample redis.conf) fields of up to 64 bytes stays a listpack: ~12 bytes
  for a block with one holder, 2 more per holder. Up to 65,536 x 512 blocks it stays so; past
  that buckets turn into hash tables, ~70 bytes a block, still correct. The holder count the
  overlap query bisects on is the value's length over 2 (one HSTRLEN; a STRLEN more for a
  block with a key of its own).
- `kv:blk:<hash>`: the holder string of a block held by more than 32 workers (a shared system
  prompt on a large fleet), whose bucket field then holds `*`: a value over 64 bytes would turn
  its whole bucket into a hash table. It goes back inline once the holders are down to 16.
- `kv:wid` (name -> id) and `kv:wname` (id -> name): a worker's id, given on its first stored
  block (a freed one first, `kv:wid:free`, else the next of `kv:wid:next`) and freed when it
  holds nothing: at most 65,535 workers hold blocks at once. Each map also holds one field no
  name or id can be (three newlines) whose 1 KB value keeps it a hash table: a decision reads
  every weighed worker's id with one HMGET, which a listpack answers by a linear scan per name.
- `kv:w:<worker>`: the worker's log, its stored blocks' hashes appended, so a purge finds what to
  drop; a removal leaves its block there, and the log is rewritten to the blocks held once it is
  half again as long (amortized constant per stored block). `kv:wn` counts each worker's blocks.
- `kv:approx:<worker>`: the blocks the router itself sent to a worker, scored by expiry (Redis
  server time, milliseconds): for a worker that publishes no events (approximate mode) its
  only credit, for the others predicted blocks with a short TTL that cover the time until the
  worker's own `stored` events arrive.
  `kv:approximate` is the set of workers that have one (at most one entry per worker), so the
  overlap query looks for approximate blocks only where there can be some.

Every event-backed key is kept consistent inside Lua (routing/kv/lua/index_functions.lua), and
nothing stays behind after a worker removes its blocks or is purged: an emptied bucket field is
deleted, and so is an emptied hash, a worker's log, count and id.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis

from routing.contract.kv_events import check_worker_name
from routing.state.lua import LuaScript, lua_constants, lua_script, lua_text
from routing.state.redis_keys import reply_text

if TYPE_CHECKING:
    from routing.contract.kv_events import KvEvent

BUCKET_FAMILY = "kv:b:"
HOLDERS_FAMILY = "kv:blk:"
# A bucket field's value for a block whose holders live under HOLDERS_FAMILY (a holder string
# has an even length, so it can never be this).
PROMOTED = "*"
INLINE_HOLDER_BYTES = 64  # Redis's default hash-max-listpack-value: 32 holders
WORKER_FAMILY = "kv:w:"
WORKER_COUNTS_KEY = "kv:wn"
WORKER_IDS_KEY = "kv:wid"
WORKER_NAMES_KEY = "kv:wname"
FREE_IDS_KEY = "kv:wid:free"
NEXT_ID_KEY = "kv:wid:next"
APPROXIMATE_FAMILY = "kv:approx:"
APPROXIMATE_KEY = "kv:approximate"
# `kv:pred:<hash>`: the worker the router last sent a prompt holding this block to, for the
# predicted TTL; only every PREDICTED_STRIDE-th block of a prompt is marked. A decision over a
# large fleet reads candidates, not every worker (KvIndex.prefix_holders), and finds by these
# marks the worker a sibling was just sent to, before that worker's events arrive.
PREDICTED_FAMILY = "kv:pred:"
PREDICTED_STRIDE = 16
# The event stream every change to the index is appended to, in the order applied (publish_events.lua,
# and a purge's `cleared`), capped near STREAM_MAXLEN entries: what observers and each frontend's
# replica of the index (routing.kv.replica) read. EVENT_IDS_KEY counts each worker's events, so a
# reader that finds a worker's count jump knows it missed some.
EVENTS_STREAM = "kv:events"
EVENT_IDS_KEY = "kv:event-ids"  # hash: worker -> last event id given to it
STREAM_MAXLEN = 10_000
# A random token set by whoever first finds it missing. Redis restarted without its data (or
# flushed) loses it with the index: a worker that sees it change re-announces its blocks.
EPOCH_KEY = "kv:epoch"

DEFAULT_APPROXIMATE_TTL_S = 120.0  # Dynamo's approximate-mode default

_U64_MAX = (1 << 64) - 1

# Lua shared by the index's own scripts and the event publisher's (which must apply events and
# append them to the stream in one atomic call), in routing/kv/lua/. Keys are built inside the
# scripts because a prompt's blocks are only known there; the deployment is a single Redis, not a
# cluster.
INDEX_LUA_FUNCTIONS = lua_constants(
    PREDICTED_FAMILY=PREDICTED_FAMILY,
    PREDICTED_STRIDE=str(PREDICTED_STRIDE),
    BUCKET_FAMILY=BUCKET_FAMILY,
    HOLDERS_FAMILY=HOLDERS_FAMILY,
    PROMOTED=PROMOTED,
    INLINE_HOLDER_BYTES=str(INLINE_HOLDER_BYTES),
    WORKER_FAMILY=WORKER_FAMILY,
    WORKER_COUNTS_KEY=WORKER_COUNTS_KEY,
    WORKER_IDS_KEY=WORKER_IDS_KEY,
    WORKER_NAMES_KEY=WORKER_NAMES_KEY,
    FREE_IDS_KEY=FREE_IDS_KEY,
    NEXT_ID_KEY=NEXT_ID_KEY,
    APPROXIMATE_FAMILY=APPROXIMATE_FAMILY,
    APPROXIMATE_KEY=APPROXIMATE_KEY,
    EVENTS_STREAM=EVENTS_STREAM,
    EVENT_IDS_KEY=EVENT_IDS_KEY,
    STREAM_MAXLEN=str(STREAM_MAXLEN),
) + lua_text(__package__, "index_functions.lua")
# The overlap query, as Lua functions the router's decision script embeds too.
OVERLAPS_LUA_FUNCTIONS = lua_text(__package__, "overlaps_functions.lua")


def overlaps_choice(function: str) -> str:
    """The Lua that makes `kv_overlaps`, which the overlap and decision scripts call, one of the
    two variants of OVERLAPS_LUA_FUNCTIONS (its name: `KvIndex.overlaps_function`)."""
    return f"local kv_overlaps = {function}\n"


_APPLY_LUA = lua_script(__package__, "index_apply.lua", INDEX_LUA_FUNCTIONS)
_PURGE_LUA = lua_script(__package__, "index_purge.lua", INDEX_LUA_FUNCTIONS)
_RECORD_ROUTED_LUA = lua_script(__package__, "index_record_routed.lua", INDEX_LUA_FUNCTIONS)
_WORKER_BLOCKS_LUA = lua_script(__package__, "index_worker_blocks.lua", INDEX_LUA_FUNCTIONS)
_BLOCK_COUNTS_LUA = lua_script(__package__, "index_block_counts.lua", INDEX_LUA_FUNCTIONS)
_SNAPSHOT_LUA = lua_script(__package__, "index_snapshot.lua", INDEX_LUA_FUNCTIONS)
_CANDIDATES_LUA = lua_script(__package__, "index_candidates.lua", INDEX_LUA_FUNCTIONS, OVERLAPS_LUA_FUNCTIONS)


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
        self.overlaps_script = LuaScript(
            client,
            lua_script(
                __package__,
                "index_overlaps.lua",
                INDEX_LUA_FUNCTIONS,
                OVERLAPS_LUA_FUNCTIONS,
                overlaps_choice(self.overlaps_function),
            ),
        )
        self._worker_blocks = LuaScript(client, _WORKER_BLOCKS_LUA)
        self._snapshot = LuaScript(client, _SNAPSHOT_LUA)
        self._candidates = LuaScript(client, _CANDIDATES_LUA)
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
        """Drop every block of a worker (heartbeat lapsed, or it cleared its cache); how many.
        A worker that held any is announced on the event stream as `cleared`, so the index's
        replicas drop it too."""
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

    def snapshot(self, worker: str) -> tuple[int, bytes]:
        """The worker's last event id and the blocks it holds then (packed hashes), read in one
        atomic step: applying its events after that id to these blocks gives its blocks now."""
        event_id, packed = self._snapshot(self._namespace, check_worker_name(worker))
        return int(event_id), packed if isinstance(packed, bytes) else packed.encode("latin-1")

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

    def candidates(
        self, block_hashes: Sequence[int], cap: int, sample: Sequence[str], affinity_key: str = ""
    ) -> dict[str, int]:
        """The workers holding the request's longest cached prefixes (at most `cap` per prefix
        length), those a sibling prompt was just routed to (`kv:pred:`), those of `sample` and
        the worker `affinity_key` names, each with its overlap in blocks. One round trip, bounded
        by the prefix lengths present and the sample, never by the number of workers."""
        names, overlaps = self._candidates(
            self._namespace, pack_hashes(block_hashes), cap, "\n".join(checked_workers(sample)), affinity_key
        )
        if isinstance(overlaps, str):
            overlaps = overlaps.encode("latin-1")
        found = struct.unpack(f">{len(overlaps) // 4}i", overlaps)
        return {reply_text(name): overlap for name, overlap in zip(names, found, strict=True)}

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
