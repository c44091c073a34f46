"""The worker's paged KV pool: fixed-size blocks that running requests hold through block tables,
and that double as the prefix cache (a radix tree of the blocks whose prompt tokens are known).

A request reuses cached blocks by reference (no copy); its own prompt blocks become cacheable as
they fill. Blocks nobody holds stay cached until room is needed, then go least recently used
first, leaves before their parents. Every block cached, evicted or cleared is reported as a
`KvEvent`, in order, so the router's index mirrors exactly what this pool caches.

This module is bookkeeping only (block ids, hashes, reference counts); the tensors live in
`workers.paged_attention.KvPoolTensors`, indexed by the same block ids.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from routing.contract.kv_events import KvEvent

PublishEvents = Callable[[Sequence[KvEvent]], None]


@dataclass(eq=False)
class CachedBlock:
    """A block of `block_size` prompt tokens in the prefix tree, stored in pool block `block_id`."""

    sequence_hash: int
    local_hash: int | None  # None: not known to this pool's engine (the simulated one's)
    parent: CachedBlock | None
    depth: int  # 0 for a prompt's first block
    block_id: int
    children: int = 0
    last_used: int = 0


class KvPool:
    """Block allocation, reference counts and the prefix tree over `capacity_blocks` blocks."""

    def __init__(
        self,
        *,
        capacity_blocks: int,
        block_size: int,
        worker: str,
        publish_events: PublishEvents | None = None,
    ) -> None:
        if capacity_blocks < 1 or block_size < 1:
            raise ValueError("capacity_blocks and block_size must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.worker = worker
        self._publish = publish_events
        self._refs = [0] * capacity_blocks  # requests holding each block
        self._entries: list[CachedBlock | None] = [None] * capacity_blocks
        self._cached: dict[int, CachedBlock] = {}
        self._free: deque[int] = deque(range(capacity_blocks))  # neither held nor cached
        self._held = 0  # blocks with refs > 0
        # Candidates for eviction, (last_used, -depth, tie, entry); entries go stale when a block
        # is used again, gains a child or is evicted, and are checked when popped.
        self._evictable: list[tuple[int, int, int, CachedBlock]] = []
        self._tie = itertools.count()
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    # --- reading ---------------------------------------------------------------------------------
    def cached_prefix_blocks(self, sequence_hashes: Sequence[int]) -> int:
        """How many leading blocks are cached right now (a look, not a hold)."""
        with self._lock:
            count = 0
            for sequence_hash in sequence_hashes:
                if sequence_hash not in self._cached:
                    break
                count += 1
            return count

    def block_hashes(self) -> set[int]:
        with self._lock:
            return set(self._cached)

    def __len__(self) -> int:
        """Cached blocks (held or not)."""
        with self._lock:
            return len(self._cached)

    @property
    def held_blocks(self) -> int:
        """Blocks some running request holds (the rest are free or evictable)."""
        return self._held

    @property
    def free_blocks(self) -> int:
        """Blocks a request could get now: free ones and cached ones nobody holds."""
        return self.capacity_blocks - self._held

    # --- holding ---------------------------------------------------------------------------------
    def acquire_prefix(self, sequence_hashes: Sequence[int], limit: int | None = None) -> list[int]:
        """Holds the longest cached prefix of these blocks (at most `limit`); returns their ids."""
        with self._lock:
            now = next(self._clock)
            held: list[int] = []
            for sequence_hash in sequence_hashes[:limit]:
                entry = self._cached.get(sequence_hash)
                if entry is None:
                    break
                self._hold(entry.block_id)
                entry.last_used = now
                held.append(entry.block_id)
            return held

    def allocate(self, count: int) -> list[int] | None:
        """`count` fresh blocks, evicting unheld cached ones as needed; None when there are not
        enough (then nothing is evicted, short of a parent kept by a child another request holds)."""
        with self._lock:
            if self.capacity_blocks - self._held < count:
                return None
            events: list[KvEvent] = []
            while len(self._free) < count and self._evict_one(events):
                pass
            self._emit(events)
            if len(self._free) < count:
                return None
            blocks = [self._free.popleft() for _ in range(count)]
            for block in blocks:
                self._hold(block)
            return blocks

    def release(self, block_ids: Sequence[int]) -> None:
        """A request lets go of its blocks: cached ones become evictable, the rest free."""
        with self._lock:
            for block in block_ids:
                self._refs[block] -= 1
                if self._refs[block]:
                    continue
                self._held -= 1
                entry = self._entries[block]
                if entry is None:
                    self._free.append(block)
                else:
                    self._offer_for_eviction(entry)

    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._held += 1
        self._refs[block] += 1

    # --- caching ---------------------------------------------------------------------------------
    def commit(
        self,
        block_ids: Sequence[int],
        first: int,
        last: int,
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
    ) -> int:
        """Makes a request's filled prompt blocks `first..last-1` (indices into its block table and
        hashes) cacheable; returns how many were cached. `local_hashes` may be empty: an engine
        that knows only the router's sequence hashes (workers.sim_engine) announces none.

        A block whose hash another request cached meanwhile stays the request's own (the cached
        copy serves later prompts). A block whose parent is no longer cached is not cached either:
        the tree never holds orphans, so the index never sees a block without its prefix.
        """
        with self._lock:
            events: list[KvEvent] = []
            run: list[CachedBlock] = []
            cached = 0
            now = next(self._clock)
            parent = self._cached.get(sequence_hashes[first - 1]) if first > 0 else None
            if first > 0 and parent is None:
                return 0
            for index in range(first, last):
                existing = self._cached.get(sequence_hashes[index])
                if existing is not None:
                    if run:
                        events.append(self._stored_event(run))
                        run = []
                    parent = existing
                    continue
                block = block_ids[index]
                if self._entries[block] is not None:
                    break  # already someone's cached block (never happens for a private block)
                entry = CachedBlock(
                    sequence_hash=sequence_hashes[index],
                    local_hash=local_hashes[index] if local_hashes else None,
                    parent=parent,
                    depth=index,
                    block_id=block,
                    last_used=now,
                )
                if parent is not None:
                    parent.children += 1
                self._entries[block] = entry
                self._cached[entry.sequence_hash] = entry
                run.append(entry)
                cached += 1
                parent = entry
            if run:
                events.append(self._stored_event(run))
            self._emit(events)
            return cached

    @contextlib.contextmanager
    def unannounced(self) -> Iterator[None]:
        """Blocks cached and dropped inside publish no event (the engine's warm-up, before the
        worker takes requests: the router never hears of what it never held)."""
        publish, self._publish = self._publish, None
        try:
            yield
        finally:
            self._publish = publish

    def clear(self) -> int:
        """Forgets every cached block (held ones stay with their requests); returns how many."""
        with self._lock:
            dropped = len(self._cached)
            for entry in self._cached.values():
                self._entries[entry.block_id] = None
                if self._refs[entry.block_id] == 0:
                    self._free.append(entry.block_id)
                entry.children = 0
                entry.parent = None
            self._cached.clear()
            self._evictable.clear()
            self._emit([KvEvent(kind="cleared", worker=self.worker)])
            return dropped

    # --- eviction ----------------------------------------------------------------------------------
    def _offer_for_eviction(self, entry: CachedBlock) -> None:
        if self._evictable_now(entry):
            heapq.heappush(self._evictable, (entry.last_used, -entry.depth, next(self._tie), entry))
            if len(self._evictable) > 2 * len(self._cached) + 64:
                self._compact_evictable()

    def _evictable_now(self, entry: CachedBlock) -> bool:
        return (
            self._refs[entry.block_id] == 0
            and entry.children == 0
            and self._cached.get(entry.sequence_hash) is entry
        )

    def _compact_evictable(self) -> None:
        # Reuse pushes a fresh entry each time; without evictions the stale ones would pile up.
        self._evictable = [
            (entry.last_used, -entry.depth, next(self._tie), entry)
            for entry in self._cached.values()
            if self._evictable_now(entry)
        ]
        heapq.heapify(self._evictable)

    def _evict_one(self, events: list[KvEvent]) -> bool:
        """Evicts the least recently used unheld leaf; False when there is none."""
        while self._evictable:
            last_used, _, _, entry = heapq.heappop(self._evictable)
            if not self._evictable_now(entry) or entry.last_used != last_used:
                continue  # stale entry
            del self._cached[entry.sequence_hash]
            self._entries[entry.block_id] = None
            self._free.append(entry.block_id)
            events.append(KvEvent(kind="removed", worker=self.worker, block_hashes=(entry.sequence_hash,)))
            parent = entry.parent
            entry.parent = None
            if parent is not None:
                parent.children -= 1
                self._offer_for_eviction(parent)
            return True
        return False

    # --- events --------------------------------------------------------------------------------------
    def _stored_event(self, entries: Sequence[CachedBlock]) -> KvEvent:
        parent = entries[0].parent
        return KvEvent(
            kind="stored",
            worker=self.worker,
            block_hashes=tuple(entry.sequence_hash for entry in entries),
            parent_hash=None if parent is None else parent.sequence_hash,
            local_hashes=()
            if entries[0].local_hash is None
            else tuple(entry.local_hash for entry in entries),  # type: ignore[misc]
        )

    def _emit(self, events: list[KvEvent]) -> None:
        # Under the lock, so events reach the index in the pool's order.
        if events and self._publish is not None:
            self._publish(events)
