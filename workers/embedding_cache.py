"""Vision-encoder outputs of images already seen, so a KV miss on a known image skips the encoder.

Keyed by (session scope, image identity, model, processor settings); least recently used entries
go first once the tensors' bytes exceed the capacity.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class EmbeddingKey:
    scope_key: str | None  # the session scope hash when scoping partitions caches
    identity: str  # the image's 128-bit identity (hex)
    model: str
    processor_fingerprint: str  # image processor settings: other settings, other embeddings


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class EmbeddingCache:
    """Thread-safe LRU of image embeddings bounded by their total tensor bytes."""

    def __init__(
        self, capacity_bytes: int, *, on_evict: Callable[[EmbeddingKey], None] | None = None
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[EmbeddingKey, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        # Told of each entry evicted for room (an encode worker unlists it for the router).
        self._on_evict = on_evict

    def get(self, key: EmbeddingKey) -> torch.Tensor | None:
        """The cached embedding (shared: callers must not modify it), counting a hit or a miss."""
        with self._lock:
            embedding = self._entries.get(key)
            if embedding is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return embedding

    def put(self, key: EmbeddingKey, embedding: torch.Tensor) -> bool:
        """Caches an embedding, evicting the least recently used; False if it alone is too large."""
        size = tensor_bytes(embedding)
        evicted_keys: list[EmbeddingKey] = []
        with self._lock:
            if size > self.capacity_bytes:
                return False
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._bytes -= tensor_bytes(previous)
            while self._entries and self._bytes + size > self.capacity_bytes:
                evicted_key, evicted = self._entries.popitem(last=False)
                self._bytes -= tensor_bytes(evicted)
                self.evictions += 1
                evicted_keys.append(evicted_key)
            # detach(): a cached tensor must not keep an autograd graph (or a request's) alive.
            self._entries[key] = embedding.detach()
            self._bytes += size
        if self._on_evict is not None:
            for evicted_key in evicted_keys:  # outside the lock: the callback may do I/O
                self._on_evict(evicted_key)
        return True

    def discard_scope(self, scope_key: str) -> int:
        """Drops every entry of one session scope (a scoped flush); returns how many."""
        with self._lock:
            doomed = [key for key in self._entries if key.scope_key == scope_key]
            for key in doomed:
                self._bytes -= tensor_bytes(self._entries.pop(key))
            return len(doomed)

    def count(self, scope_key: str | None = None) -> int:
        """Entries held (all, or one session scope's)."""
        with self._lock:
            if scope_key is None:
                return len(self._entries)
            return sum(1 for key in self._entries if key.scope_key == scope_key)

    def keys(self) -> list[EmbeddingKey]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> int:
        with self._lock:
            dropped = len(self._entries)
            self._entries.clear()
            self._bytes = 0
            return dropped

    @property
    def size_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: object) -> bool:
        # A membership check is not a use: no counters, no reordering.
        with self._lock:
            return key in self._entries
