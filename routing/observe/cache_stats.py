"""Cache hit/miss counters per worker and cache, buffered in memory and flushed to Redis.

The request path only adds to an in-process buffer; a background thread writes it out about
once a second, so counting never waits on Redis. The dashboard reads the totals and a
per-minute series kept for a day.

Keys (this module owns them): `<ns>stats:<worker>:<cache>` (hash of totals),
`<ns>stats:ts:<worker>:<cache>:<minute>` (hash per minute since the epoch, 24 h TTL) and
`<ns>stats:workers` (set of workers that ever reported).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import redis

logger = logging.getLogger(__name__)

CACHES: tuple[str, ...] = ("kv", "embedding", "local_image", "shared_image")
# The KV cache also counts tokens: its hit rate is cached over prompt tokens, as the issue defines it.
FIELDS: tuple[str, ...] = ("hits", "misses", "bypasses", "errors", "bytes", "cached_tokens", "prompt_tokens")

FLUSH_INTERVAL_SECS = 1.0
SERIES_TTL_SECS = 24 * 3600

Counts = dict[str, dict[str, dict[str, int]]]


def totals_key(namespace: str, worker: str, cache: str) -> str:
    return f"{namespace}stats:{worker}:{cache}"


def series_key(namespace: str, worker: str, cache: str, minute: int) -> str:
    return f"{namespace}stats:ts:{worker}:{cache}:{minute}"


def workers_key(namespace: str) -> str:
    return f"{namespace}stats:workers"


class CacheStats:
    """One worker's counters. `incr` is cheap and thread-safe; `flush` writes them out."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        worker: str,
        *,
        flush_interval: float = FLUSH_INTERVAL_SECS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self.worker = worker
        self._flush_interval = flush_interval
        self._clock = clock
        self._lock = threading.Lock()
        # (cache, minute) -> field -> count; the minute is taken when counted, not when flushed.
        self._pending: dict[tuple[str, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

    def incr(self, cache: str, field: str, n: int = 1) -> None:
        if cache not in CACHES:
            raise ValueError(f"unknown cache {cache!r}; expected one of {CACHES}")
        if field not in FIELDS:
            raise ValueError(f"unknown counter {field!r}; expected one of {FIELDS}")
        if n == 0:
            return
        minute = int(self._clock() // 60)
        with self._lock:
            self._pending[(cache, minute)][field] += n
            if self._flusher is None and not self._stop.is_set():
                self._flusher = threading.Thread(
                    target=self._flush_periodically, name=f"cache-stats-{self.worker}", daemon=True
                )
                self._flusher.start()

    def flush(self) -> None:
        """Write buffered counts to Redis now; on failure they stay buffered for the next try."""
        with self._lock:
            pending, self._pending = self._pending, defaultdict(lambda: defaultdict(int))
        if not pending:
            return
        pipe = self._client.pipeline(transaction=False)
        pipe.sadd(workers_key(self._namespace), self.worker)
        for (cache, minute), fields in pending.items():
            totals = totals_key(self._namespace, self.worker, cache)
            series = series_key(self._namespace, self.worker, cache, minute)
            for field, count in fields.items():
                pipe.hincrby(totals, field, count)
                pipe.hincrby(series, field, count)
            pipe.expire(series, SERIES_TTL_SECS)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            # Counters are best effort, but losing them silently would skew the dashboard:
            # put them back so the next flush carries them.
            logger.warning("cache stats flush for %s failed: %s", self.worker, type(exc).__name__)
            with self._lock:
                for slot, fields in pending.items():
                    for field, count in fields.items():
                        self._pending[slot][field] += count
            raise

    def close(self) -> None:
        """Stop the background flusher and write what is left."""
        self._stop.set()
        flusher = self._flusher
        if flusher is not None:
            flusher.join(timeout=self._flush_interval + 1)
        self.flush()

    def _flush_periodically(self) -> None:
        while not self._stop.wait(self._flush_interval):
            # Already logged by flush; the counts wait for the next round.
            with contextlib.suppress(redis.RedisError):
                self.flush()


def read_all(client: redis.Redis, namespace: str) -> Counts:
    """Totals of every worker that ever reported: worker -> cache -> field -> count."""
    workers = sorted(
        w.decode() if isinstance(w, bytes) else w for w in client.smembers(workers_key(namespace))
    )
    pipe = client.pipeline(transaction=False)
    for worker in workers:
        for cache in CACHES:
            pipe.hgetall(totals_key(namespace, worker, cache))
    replies = iter(pipe.execute())
    result: Counts = {}
    for worker in workers:
        result[worker] = {cache: _as_counts(next(replies)) for cache in CACHES}
    return result


def read_series(
    client: redis.Redis,
    namespace: str,
    worker: str,
    cache: str,
    minutes: int,
    *,
    now: float | None = None,
) -> list[tuple[int, dict[str, int]]]:
    """The last `minutes` minutes (oldest first) as (minute start, unix seconds; counts).

    Minutes with no traffic are present with every field at 0, so a chart needs no gap logic.
    """
    if cache not in CACHES:
        raise ValueError(f"unknown cache {cache!r}; expected one of {CACHES}")
    current = int((time.time() if now is None else now) // 60)
    wanted = list(range(current - minutes + 1, current + 1))
    pipe = client.pipeline(transaction=False)
    for minute in wanted:
        pipe.hgetall(series_key(namespace, worker, cache, minute))
    return [(minute * 60, _as_counts(reply)) for minute, reply in zip(wanted, pipe.execute(), strict=True)]


def _as_counts(reply: dict[bytes | str, bytes | str]) -> dict[str, int]:
    counts = dict.fromkeys(FIELDS, 0)
    for field, value in reply.items():
        name = field.decode() if isinstance(field, bytes) else field
        counts[name] = int(value)
    return counts
