"""The worker's prefix KV cache: fixed-size blocks of per-layer key/value tensors, keyed by the
sequence hashes of `routing.hashing.block_hashes`, shared between prompts through parent links.

Every block stored, evicted or cleared is reported as a `KvEvent`, in order, so the router's
index mirrors exactly what this cache holds.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from routing.kv_events import KvEvent

if TYPE_CHECKING:
    import torch

# One (key, value) pair per decoder layer, each shaped [batch=1, kv_heads, tokens, head_dim].
LayerKv = list[tuple["torch.Tensor", "torch.Tensor"]]
PublishEvents = Callable[[Sequence[KvEvent]], None]


@dataclass(eq=False)
class KvBlock:
    """One block of `block_size` prompt tokens: its KV and its place in the prefix tree."""

    sequence_hash: int
    local_hash: int
    parent: KvBlock | None
    depth: int  # 0 for a prompt's first block
    layers: LayerKv
    children: int = 0
    refs: int = 0  # running requests using it: never evicted while > 0
    last_used: int = 0


@dataclass(eq=False)
class PrefixLease:
    """The blocks one request holds (its reused prefix, then what it stored): released at the end."""

    blocks: list[KvBlock] = field(default_factory=list)
    reused_blocks: int = 0
    released: bool = False


class PrefixKvCache:
    """A radix tree of KV blocks with LRU eviction of unreferenced leaves, under a block budget."""

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
        self._blocks: dict[int, KvBlock] = {}
        # Candidates for eviction, (last_used, -depth, tie, block); entries go stale when a block
        # is used again, gains a child or is evicted, and are checked when popped.
        self._evictable: list[tuple[int, int, int, KvBlock]] = []
        self._tie = itertools.count()
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    # --- reading ---------------------------------------------------------------------------------
    def acquire(self, sequence_hashes: Sequence[int]) -> PrefixLease:
        """Holds the longest cached prefix of these blocks for one request (refs keep it cached)."""
        with self._lock:
            now = next(self._clock)
            lease = PrefixLease()
            for sequence_hash in sequence_hashes:
                block = self._blocks.get(sequence_hash)
                if block is None:
                    break
                block.refs += 1
                block.last_used = now
                lease.blocks.append(block)
            lease.reused_blocks = len(lease.blocks)
            return lease

    def release(self, lease: PrefixLease) -> None:
        """The request is done with its blocks: they become evictable again, leaves first."""
        with self._lock:
            if lease.released:
                return
            lease.released = True
            for block in lease.blocks:
                block.refs -= 1
                self._offer_for_eviction(block)

    def block_hashes(self) -> set[int]:
        with self._lock:
            return set(self._blocks)

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    # --- writing ---------------------------------------------------------------------------------
    def store(
        self,
        lease: PrefixLease,
        sequence_hashes: Sequence[int],
        local_hashes: Sequence[int],
        prompt_kv: LayerKv,
    ) -> int:
        """Stores the prompt's full blocks after the lease's prefix; returns how many were stored.

        `prompt_kv` holds the whole prompt's KV (from position 0). Blocks are cloned out of it, so
        the request's tensors can be freed. Storing stops when no block can be evicted to make room:
        a prompt larger than the cache is then only partly cached.
        """
        with self._lock:
            if lease.released:
                raise ValueError("the lease was released")
            events: list[KvEvent] = []
            stored: list[KvBlock] = []
            stored_count = 0
            parent = lease.blocks[-1] if lease.blocks else None
            start = len(lease.blocks)
            if parent is not None and self._blocks.get(parent.sequence_hash) is not parent:
                return 0  # the cache was cleared under this request: its prefix is gone
            now = next(self._clock)
            for index in range(start, len(sequence_hashes)):
                existing = self._blocks.get(sequence_hashes[index])
                if existing is not None:
                    # Another request stored it meanwhile (or a hash repeats): share it.
                    if stored:
                        events.append(self._stored_event(stored))
                        stored = []
                    existing.refs += 1
                    existing.last_used = now
                    lease.blocks.append(existing)
                    parent = existing
                    continue
                if len(self._blocks) >= self.capacity_blocks and not self._evict_one(events, stored):
                    break
                block = KvBlock(
                    sequence_hash=sequence_hashes[index],
                    local_hash=local_hashes[index],
                    parent=parent,
                    depth=index,
                    layers=_block_slice(prompt_kv, index * self.block_size, self.block_size),
                    refs=1,
                    last_used=now,
                )
                if parent is not None:
                    parent.children += 1
                self._blocks[block.sequence_hash] = block
                lease.blocks.append(block)
                stored.append(block)
                stored_count += 1
                parent = block
            if stored:
                events.append(self._stored_event(stored))
            self._emit(events)
            return stored_count

    def clear(self) -> int:
        """Drops every block (running requests keep their own copies); returns how many."""
        with self._lock:
            dropped = len(self._blocks)
            for block in self._blocks.values():
                block.children = 0
            self._blocks.clear()
            self._evictable.clear()
            self._emit([KvEvent(kind="cleared", worker=self.worker)])
            return dropped

    # --- eviction ----------------------------------------------------------------------------------
    def _offer_for_eviction(self, block: KvBlock) -> None:
        if block.refs == 0 and block.children == 0 and self._blocks.get(block.sequence_hash) is block:
            heapq.heappush(self._evictable, (block.last_used, -block.depth, next(self._tie), block))
            if len(self._evictable) > 2 * len(self._blocks) + 64:
                self._compact_evictable()

    def _compact_evictable(self) -> None:
        # Reuse pushes a fresh entry each time; without evictions the stale ones would pile up.
        self._evictable = [
            (block.last_used, -block.depth, next(self._tie), block)
            for block in self._blocks.values()
            if block.refs == 0 and block.children == 0
        ]
        heapq.heapify(self._evictable)

    def _evict_one(self, events: list[KvEvent], pending_store: list[KvBlock]) -> bool:
        """Removes the least recently used unreferenced leaf; False when every block is in use."""
        while self._evictable:
            last_used, _, _, block = heapq.heappop(self._evictable)
            if (
                block.refs
                or block.children
                or block.last_used != last_used
                or self._blocks.get(block.sequence_hash) is not block
            ):
                continue  # stale entry
            if pending_store:
                # Keep the event order true: what was stored so far is published before the removal.
                events.append(self._stored_event(pending_store))
                pending_store.clear()
            del self._blocks[block.sequence_hash]
            events.append(KvEvent(kind="removed", worker=self.worker, block_hashes=(block.sequence_hash,)))
            parent = block.parent
            block.parent = None
            block.layers = []
            if parent is not None:
                parent.children -= 1
                self._offer_for_eviction(parent)
            return True
        return False

    # --- events --------------------------------------------------------------------------------------
    def _stored_event(self, blocks: Sequence[KvBlock]) -> KvEvent:
        parent = blocks[0].parent
        return KvEvent(
            kind="stored",
            worker=self.worker,
            block_hashes=tuple(block.sequence_hash for block in blocks),
            parent_hash=None if parent is None else parent.sequence_hash,
            local_hashes=tuple(block.local_hash for block in blocks),
        )

    def _emit(self, events: list[KvEvent]) -> None:
        # Under the lock, so events from concurrent requests reach the index in cache order.
        if events and self._publish is not None:
            self._publish(events)


def _block_slice(prompt_kv: LayerKv, start: int, length: int) -> LayerKv:
    # clone(): a view would keep the whole request's KV tensor alive as long as the block.
    return [
        (keys[:, :, start : start + length].clone(), values[:, :, start : start + length].clone())
        for keys, values in prompt_kv
    ]


def prefix_kv(blocks: Sequence[KvBlock]) -> LayerKv:
    """The KV of consecutive blocks, joined per layer (the layout `DynamicCache` takes)."""
    import torch

    if not blocks:
        return []
    layers = len(blocks[0].layers)
    return [
        (
            torch.cat([block.layers[layer][0] for block in blocks], dim=2),
            torch.cat([block.layers[layer][1] for block in blocks], dim=2),
        )
        for layer in range(layers)
    ]
