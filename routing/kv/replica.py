"""A copy of the KV index in this frontend's memory, fed by the index's event stream.

Why: on a large fleet a decision weighs candidates, not every worker (KvRouter._decide_among):
the holders of the request's longest cached prefixes and a random sample for load. Finding the
holders inside Redis costs ~140 µs of Redis's one thread per decision at 1,024 workers, which is
what bounds how many decisions one Redis makes per second. Each frontend finds them here instead,
in its own memory (as Dynamo's router replicas do from its radix tree), and Redis is left the part
that must be shared and atomic: the load, the reservation, the predicted marks and the affinity.

What it holds: each block's holders as a bitmask of this replica's worker bits (a Python int), so
the overlap walk over a prompt's blocks is one dict lookup and one AND per block, and a holder
count is `int.bit_count`; and each worker's log of stored blocks (8 bytes each), so a `cleared`
event drops exactly what the worker held. About 150-250 bytes per cached block in all; a fleet of
1,024 workers caching a million distinct blocks costs a frontend ~200 MB.

How it stays right:
- **In order.** Every change to the index is applied in Redis and appended to the stream
  `kv:events` in the same atomic call (publish_events.lua; a purge announces `cleared` the same
  way), so applying the stream in order gives the index's state.
- **From a snapshot.** It starts from the index itself: the stream's last id, every worker's
  event count (`kv:event-ids`) and the workers holding blocks, read in one transaction; then each
  worker's blocks with its event count at that moment, in one atomic step per worker
  (KvIndex.snapshot). Events of a worker up to its snapshot's count are skipped; the others
  replay in order over the snapshot. Each event sets or clears (block, worker) pairs, so the
  last event to touch a pair decides it, snapshot or not.
- **Gaps.** The stream is capped (STREAM_MAXLEN). A replica that fell behind further finds a
  worker's event count jump, and reads that worker's blocks again (its snapshot) instead of
  missing what was trimmed.
- **Redis lost its data.** The index's epoch (`kv:epoch`) changes; the replica, which reads it at
  least every EPOCH_CHECK_S, starts again from a snapshot of the new index, which the workers
  fill by announcing their blocks again when they see the new epoch.
- **Across frontends.** Each replica reads the same stream, so they hold the same state a few
  milliseconds apart; what a decision of another frontend did in the meantime (a prompt sent to a
  worker whose events have not arrived) is in Redis's predicted marks, which the decision reads
  there. A replica that has not read the stream for STALE_AFTER_S (Redis unreachable) is not
  `ready`, and the router decides from Redis's index, as before it had one.

Only the event-backed holders are here. The approximate workers' blocks, the predicted marks and
which worker a session is with are written by decisions, and read by the decision in Redis.

One thread per replica reads the stream (`start`); decisions read the current state without a
lock (a state is replaced whole by a rebuild, and each event changes dict entries one at a time,
so a reader sees each block's holders before or after an event, never torn).
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import threading
import time
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import redis

from routing.kv.index import EVENT_IDS_KEY, EVENTS_STREAM, WORKER_IDS_KEY, KvIndex, unpack_hashes
from routing.state.redis_keys import reply_text

logger = logging.getLogger("routing.replica")

EPOCH_CHECK_S = 1.0
STALE_AFTER_S = 5.0
BATCH = 2_000  # stream entries per read
# A field of the index's id maps that no worker name can be (index_functions.lua's TABLE_FIELD).
_TABLE_FIELD = b"\n\n\n"


_serials = itertools.count()


class _State:
    """One epoch's copy of the index: rebuilt whole, then changed event by event."""

    def __init__(self, epoch: str, last_id: bytes, event_ids: dict[str, int]) -> None:
        self.epoch = epoch
        self.last_id = last_id  # the stream id read up to
        self.read_count = 0  # the stream's entries up to last_id, counted from its first ever
        self.event_ids = event_ids  # each worker's last event applied (or in its snapshot)
        self.masks: dict[int, int] = {}  # block hash -> holders, one bit per worker
        self.bit_of: dict[str, int] = {}
        self.name_of: list[str | None] = []
        self.free_bits: list[int] = []
        self.logs: dict[int, array] = {}  # bit -> the hashes it stored (removals stay)
        self.held: dict[int, int] = {}  # bit -> how many blocks it holds
        self.serial = next(_serials)  # tells this state from every other one of the process
        self.version = 0  # moves when a bit is given or freed: views of names made before are stale

    def _bit(self, worker: str) -> int:
        bit = self.bit_of.get(worker)
        if bit is None:
            if self.free_bits:
                bit = self.free_bits.pop()
                self.name_of[bit] = worker
            else:
                bit = len(self.name_of)
                self.name_of.append(worker)
            self.bit_of[worker] = bit
            self.logs[bit] = array("Q")
            self.held[bit] = 0
            self.version += 1
        return bit

    def store(self, worker: str, hashes: Iterable[int]) -> None:
        bit = self._bit(worker)
        flag = 1 << bit
        masks, log = self.masks, self.logs[bit]
        added = 0
        for h in hashes:
            mask = masks.get(h, 0)
            if not mask & flag:
                masks[h] = mask | flag
                log.append(h)
                added += 1
        if added:
            self.held[bit] += added
        elif not self.held[bit]:
            self._forget(worker, bit)

    def remove(self, worker: str, hashes: Iterable[int]) -> None:
        bit = self.bit_of.get(worker)
        if bit is None:
            return
        flag = 1 << bit
        masks = self.masks
        held = self.held[bit] - self._unset(hashes, flag)
        self.held[bit] = held
        if held <= 0:
            self._forget(worker, bit)
        elif len(self.logs[bit]) > held + held // 2 + 64:  # removals stay in the log: rewrite it
            self.logs[bit] = array("Q", (h for h in dict.fromkeys(self.logs[bit]) if masks.get(h, 0) & flag))

    def clear(self, worker: str) -> None:
        bit = self.bit_of.get(worker)
        if bit is None:
            return
        self._unset(self.logs[bit], 1 << bit)
        self._forget(worker, bit)

    def _unset(self, hashes: Iterable[int], flag: int) -> int:
        """Takes `flag`'s worker out of these blocks' holders; how many it held."""
        masks = self.masks
        unset = 0
        for h in hashes:
            mask = masks.get(h, 0)
            if mask & flag:
                mask ^= flag
                if mask:
                    masks[h] = mask
                else:
                    del masks[h]
                unset += 1
        return unset

    def _forget(self, worker: str, bit: int) -> None:
        del self.bit_of[worker], self.logs[bit], self.held[bit]
        self.name_of[bit] = None
        self.free_bits.append(bit)
        self.version += 1

    def apply(self, kind: str, worker: str, hashes: Sequence[int]) -> None:
        if kind == "stored":
            self.store(worker, hashes)
        elif kind == "removed":
            self.remove(worker, hashes)
        elif kind == "cleared":
            self.clear(worker)


class ReplicaFleet(NamedTuple):
    """A list of workers (a fleet read's eligible ones) as an IndexReplica's bits (`fleet`)."""

    version: tuple[int, int]  # the replica's state and the version of its bits it was made under
    mask: int  # the bits of the listed workers that hold blocks
    bits: array  # each listed worker's bit, by position in the list; -1: it holds nothing here
    position_of: array  # each bit's position in the list; -1: not listed


class IndexReplica:
    """This process's copy of the index's event-backed holders (see the module's docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        *,
        index: KvIndex,
        block_ms: int = 500,
        stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        if index.namespace != namespace:
            raise ValueError("the replica and its index must share one namespace")
        self._client = client
        self._namespace = namespace
        self._index = index
        self._stream = f"{namespace}{EVENTS_STREAM}".encode()
        self._block_ms = block_ms
        self._stale_after_s = stale_after_s
        self._state: _State | None = None
        self._synced_at = float("-inf")  # monotonic time of the last read of the stream
        self._epoch_checked_at = float("-inf")
        self._behind = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._start_lock = threading.Lock()
        self.rebuilds = 0  # how many times it started from a snapshot
        self.resyncs = 0  # how many workers it read again after a gap in their events

    # -- the thread -------------------------------------------------------------------------

    def start(self) -> None:
        """Starts following the stream in a daemon thread (once; later calls do nothing)."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._follow, name="index-replica", daemon=True)
                self._thread.start()

    def close(self) -> None:
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._block_ms / 1000 + 5)

    def _follow(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                self.sync(block_ms=self._block_ms)
                if failing:
                    logger.info("index replica: reading the event stream again")
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    logger.warning(
                        "index replica: the event stream cannot be read (%s); decisions use Redis's index",
                        exc,
                    )
                failing = True
                self._stop.wait(0.5)
            except Exception:  # a bug must not end the thread silently: decisions fall back
                logger.exception(
                    "index replica: failed applying the event stream; starting again from a snapshot"
                )
                self._state = None
                self._stop.wait(0.5)

    # -- reading the stream -----------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether decisions may use it: built, and the stream read within STALE_AFTER_S."""
        return self._state is not None and time.monotonic() - self._synced_at < self._stale_after_s

    def sync(self, block_ms: int | None = None) -> int:
        """Applies the stream's new events (waiting up to `block_ms` for one). First, at most every
        EPOCH_CHECK_S and after a full batch: rebuilds if there is no state yet or the index's
        epoch moved, and reads again the workers whose events were trimmed before it read them.
        Returns how many events were read."""
        now = time.monotonic()
        if self._state is None or self._behind or now - self._epoch_checked_at >= EPOCH_CHECK_S:
            epoch = self._index.epoch()
            self._epoch_checked_at = now
            if self._state is None or epoch != self._state.epoch:
                if self._state is not None:
                    logger.warning(
                        "index replica: the index's epoch moved (Redis lost its data?): rebuilding"
                    )
                self._rebuild(epoch)
            self._catch_up(self._state)
        state = self._state
        assert state is not None
        reply = self._client.xread({self._stream: state.last_id}, count=BATCH, block=block_ms or None)
        read = 0
        for _stream, entries in reply or ():
            for stream_id, fields in entries:
                self._apply_entry(state, fields)
                state.last_id = stream_id
                read += 1
        state.read_count += read
        self._behind = read >= BATCH  # then the next read looks for what was trimmed before it
        self._synced_at = time.monotonic()
        return read

    def _rebuild(self, epoch: str) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.xinfo_stream(self._stream)
        pipe.hgetall(f"{self._namespace}{EVENT_IDS_KEY}")
        pipe.hkeys(f"{self._namespace}{WORKER_IDS_KEY}")
        info, counts, holding = pipe.execute(raise_on_error=False)
        for reply in (counts, holding):
            if isinstance(reply, Exception):
                raise reply
        state = _State(epoch, b"0-0", {reply_text(name): int(count) for name, count in counts.items()})
        if not isinstance(info, Exception):  # (an error: no stream yet)
            state.last_id = info["last-entry"][0] if info.get("last-entry") else info["last-generated-id"]
            state.read_count = int(info["entries-added"])
        for raw in holding:
            if raw == _TABLE_FIELD:
                continue
            worker = reply_text(raw)
            event_id, packed = self._index.snapshot(worker)
            state.event_ids[worker] = max(event_id, state.event_ids.get(worker, 0))
            state.store(worker, unpack_hashes(packed))
        self.rebuilds += 1
        self._state = state

    def _catch_up(self, state: _State | None) -> None:
        """If the stream was trimmed past what this replica read, reads again each worker with
        events it has not applied (a worker whose missed events are all gone shows no gap in
        the events still there). The stream's entries are counted as they are added, so the
        first one still there has a number: past the one after the last read, some were missed."""
        if state is None:
            return
        try:
            info = self._client.xinfo_stream(self._stream)
        except redis.ResponseError:  # no stream: nothing was trimmed
            return
        first_kept = int(info["entries-added"]) - int(info["length"]) + 1
        if first_kept <= state.read_count + 1:
            return
        counts = self._client.hgetall(f"{self._namespace}{EVENT_IDS_KEY}")
        for raw, count in counts.items():
            worker = reply_text(raw)
            if int(count) > state.event_ids.get(worker, 0):
                self._resync(state, worker)
        state.read_count = first_kept - 1  # what was trimmed is in the snapshots now

    def _resync(self, state: _State, worker: str) -> None:
        self.resyncs += 1
        last, packed = self._index.snapshot(worker)
        state.clear(worker)
        state.store(worker, unpack_hashes(packed))
        state.event_ids[worker] = last

    def _apply_entry(self, state: _State, fields: dict) -> None:
        worker = reply_text(fields[b"worker"])
        event_id = int(fields[b"event_id"])
        last = state.event_ids.get(worker, 0)
        if event_id <= last:
            return  # in the worker's snapshot already
        if event_id > last + 1:  # events of this worker were trimmed before they were read
            self._resync(state, worker)
            if event_id <= state.event_ids[worker]:
                return
        state.event_ids[worker] = event_id
        event = json.loads(fields[b"event"])
        state.apply(event["kind"], worker, event.get("block_hashes") or ())

    # -- queries ----------------------------------------------------------------------------

    def fleet(self, workers: Sequence[str]) -> ReplicaFleet:
        """These workers (a fleet read's eligible list) as this replica's bits, for the state
        version they are valid for: made once per read and version (KvRouter keeps it), so a
        decision finds its candidates by position in the list, with no lookup by name."""
        state = self._state
        if state is None:
            return ReplicaFleet((-1, -1), 0, array("i"), array("i"))
        # (Read first: a bit given or freed while this is made leaves the view stale, never wrong.)
        version = (state.serial, state.version)
        bit_of = state.bit_of
        bits = array("i", (bit_of.get(name, -1) for name in workers))
        position_of = array("i", [-1]) * len(state.name_of)
        mask = 0
        for position, bit in enumerate(bits):
            if bit >= 0:
                position_of[bit] = position
                mask |= 1 << bit
        return ReplicaFleet(version, mask, bits, position_of)

    def version(self) -> tuple[int, int]:
        """Which state and which of its bit assignments: a view made under another is stale."""
        state = self._state
        return (-1, -1) if state is None else (state.serial, state.version)

    def candidates(
        self,
        block_hashes: Sequence[int],
        fleet: ReplicaFleet,
        cap: int,
        sample: Iterable[int],
        rng: random.Random,
    ) -> dict[int, int] | None:
        """The workers of `fleet` (by position in its list) holding the request's longest cached
        prefixes, at most `cap` per prefix length, drawn at random where more hold it (they hold
        the same prefix: the decision weighs them by load alone), deepest first, and the
        `sample`'s (positions too); each with its overlap in blocks (exact: a worker's overlap
        is the first block it lacks). None if the replica's bits moved since `fleet` was made
        (make it again).

        Hot path: at 1,024 workers it runs once per decision, so it touches compact arrays and
        the blocks' masks, never a worker's name."""
        state = self._state
        if state is None or (state.serial, state.version) != fleet.version:
            return None
        get = state.masks.get
        alive, depth = fleet.mask, 0
        levels: list[tuple[int, int]] = []  # (overlap, the workers with that overlap)
        for h in block_hashes:
            held = get(h, 0) & alive
            if held != alive:
                if depth:
                    levels.append((depth, alive ^ held))
                alive = held
                if not alive:
                    break
            depth += 1
        if alive and depth:
            levels.append((depth, alive))
        found: dict[int, int] = dict.fromkeys(sample, 0)
        if levels:
            # The sample first: its members holding a prefix count among that length's `cap`, so
            # a prefix the whole fleet holds (a system prompt) adds no draws to the sample's.
            bits, position_of = fleet.bits, fleet.position_of
            flags = bytearray(len(position_of) + 7 >> 3)
            for position in found:
                bit = bits[position]
                if bit >= 0:
                    flags[bit >> 3] |= 1 << (bit & 7)
            sampled = int.from_bytes(flags, "little")
            for overlap, members in reversed(levels):
                among_sample = members & sampled
                if among_sample:
                    for bit in _bits(among_sample):
                        found[position_of[bit]] = overlap
                    members ^= among_sample
                wanted = cap - among_sample.bit_count()
                if members and wanted > 0:
                    for bit in _drawn(members, wanted, rng):
                        found[position_of[bit]] = overlap
        if state.version != fleet.version[1]:
            return None  # bits moved while it looked: a position may stand for another worker
        return found

    def overlaps(self, block_hashes: Sequence[int], workers: Sequence[str]) -> dict[str, int]:
        """Each worker's overlap as this replica sees it (inspection and tests)."""
        state = self._state
        if state is None:
            raise RuntimeError("the index replica is not built yet")
        out = {}
        for name in workers:
            bit = state.bit_of.get(name)
            overlap = 0
            if bit is not None:
                for h in block_hashes:
                    if not state.masks.get(h, 0) >> bit & 1:
                        break
                    overlap += 1
            out[name] = overlap
        return out

    def entries(self) -> int:
        """(block, worker) pairs held: the size of what it mirrors."""
        state = self._state
        return 0 if state is None else sum(state.held.values())


def _bits(members: int) -> Iterable[int]:
    while members:
        low = members & -members
        yield low.bit_length() - 1
        members ^= low


def _drawn(members: int, cap: int, rng: random.Random) -> Iterable[int]:
    """The bits of `members`: all of them up to `cap`, else `cap` distinct ones spread over the
    mask from a random start (each the first member not yet drawn at or after its place: a member
    after a long run of non-members is drawn more often, which is spread enough for a draw among
    holders of one prefix, whom the decision tells apart by load alone)."""
    if members.bit_count() <= cap:
        yield from _bits(members)
        return
    length = members.bit_length()
    start = rng.randrange(length)
    left = members  # those not drawn yet: more than `cap` to begin with, so never empty here
    for i in range(cap):
        at = (start + i * length // cap) % length
        rest = left >> at
        if not rest:
            rest, at = left, 0
        bit = at + (rest & -rest).bit_length() - 1
        left ^= 1 << bit
        yield bit


def _stream_id(value: bytes | str) -> tuple[int, int]:
    ms, _, seq = reply_text(value).partition("-")
    return int(ms), int(seq or 0)


def _before(value: bytes | str) -> bytes:
    """The stream id just before this one."""
    ms, seq = _stream_id(value)
    return f"{ms}-{seq - 1}".encode() if seq else f"{ms - 1}-{2**64 - 1}".encode()
