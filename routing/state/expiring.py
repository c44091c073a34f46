"""A small in-process map whose entries expire: the frontend's kept image sizes
(`routing.media.images.ImageSizes`), verified API keys (`tenants.keys.VerifiedKeys`) and worker rows
(`routing.fleet.worker_rows.KeptRows`, one entry) are each one.

Each entry lives until its own deadline on `clock` (monotonic seconds); at most `max_entries`
are kept, the least recently used going first. Thread-safe: requests run on several threads.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


def _monotonic() -> float:
    return time.monotonic()  # looked up at each call, so a test can move time.monotonic


class ExpiringLru(Generic[V]):
    def __init__(self, max_entries: int, clock: Callable[[], float] | None = None) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._clock = clock or _monotonic
        self._entries: OrderedDict[Hashable, tuple[float, V]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> V | None:
        """The value, if it has not expired (an expired one goes now)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            expires, value = entry
            if self._clock() >= expires:
                del self._entries[key]
                return None
            self._entries.move_to_end(key)
            return value

    def put(self, key: Hashable, value: V, ttl_s: float) -> None:
        """Keep `value` for `ttl_s` seconds; nothing is kept for 0 or less."""
        if ttl_s <= 0:
            return
        with self._lock:
            self._entries[key] = (self._clock() + ttl_s, value)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def pop(self, key: Hashable) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
