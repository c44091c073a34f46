"""Cache hit/miss counters per worker and cache, buffered in memory and flushed to Redis.

The request path only adds to an in-process buffer, the telemetry recorder's
(routing.observe.telemetry): its background flush writes these counts out with the process's
metrics, about once a second in one pipeline, so counting never waits on Redis. The dashboard
reads the totals and a per-minute series kept for a day.

Keys (this module owns them): `<ns>stats:<worker>:<cache>` (hash of totals),
`<ns>stats:ts:<worker>:<cache>:<minute>` (hash per minute since the epoch, 24 h TTL) and
`<ns>stats:workers` (set of workers that ever reported).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import redis

from routing.observe.telemetry import FLUSH_INTERVAL_SECS, CountTable, MetricsRecorder
from routing.state.redis_keys import reply_text

CACHES: tuple[str, ...] = ("kv", "embedding", "local_image", "shared_image")
# The KV cache also counts tokens: its hit rate is cached over prompt tokens, as the issue defines it.
FIELDS: tuple[str, ...] = ("hits", "misses", "bypasses", "errors", "bytes", "cached_tokens", "prompt_tokens")

SERIES_TTL_SECS = 24 * 3600

Counts = dict[str, dict[str, dict[str, int]]]


def totals_key(namespace: str, worker: str, cache: str) -> str:
    return f"{namespace}stats:{worker}:{cache}"


def series_key(namespace: str, worker: str, cache: str, minute: int | str) -> str:
    return f"{namespace}stats:ts:{worker}:{cache}:{minute}"


def workers_key(namespace: str) -> str:
    return f"{namespace}stats:workers"


class CacheStats:
    """One worker's counters. `incr` is cheap and thread-safe; `flush` writes them out.

    `recorder`: the process's telemetry recorder (`run_worker` passes it), whose flush then
    carries these counts too; without one the counters get a recorder of their own.
    """

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        worker: str,
        *,
        recorder: MetricsRecorder | None = None,
        flush_interval: float = FLUSH_INTERVAL_SECS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.worker = worker
        self._owns_recorder = recorder is None
        self.recorder = recorder or MetricsRecorder(
            client, namespace, source=worker, flush_interval=flush_interval, clock=clock
        )
        self._tables = {
            cache: CountTable(
                totals_key(namespace, worker, cache),
                series_key(namespace, worker, cache, ""),
                SERIES_TTL_SECS,
                member_of=(workers_key(namespace), worker),
            )
            for cache in CACHES
        }

    def incr(self, cache: str, field: str, n: int = 1) -> None:
        table = self._tables.get(cache)
        if table is None:
            raise ValueError(f"unknown cache {cache!r}; expected one of {CACHES}")
        if field not in FIELDS:
            raise ValueError(f"unknown counter {field!r}; expected one of {FIELDS}")
        if n == 0:
            return
        self.recorder.add_counts(table, {field: n})

    def flush(self) -> None:
        """Write buffered counts to Redis now; on failure they stay buffered for the next try."""
        self.recorder.flush()

    def close(self) -> None:
        """Write what is left (best effort); stop the recorder's flusher if it is this object's own
        (a shared recorder is closed by whoever made it)."""
        if self._owns_recorder:
            self.recorder.close()
        else:
            with contextlib.suppress(redis.RedisError):  # logged by flush
                self.recorder.flush()


def read_all(client: redis.Redis, namespace: str) -> Counts:
    """Totals of every worker that ever reported: worker -> cache -> field -> count."""
    workers = sorted(reply_text(w) for w in client.smembers(workers_key(namespace)))
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
        name = reply_text(field)
        counts[name] = int(value)
    return counts
