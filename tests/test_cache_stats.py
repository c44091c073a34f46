"""Cache counters: buffered off the request path, flushed to Redis, read back per worker."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from routing.observe import telemetry
from routing.observe.cache_stats import FIELDS, SERIES_TTL_SECS, CacheStats, read_all, read_series, series_key
from routing.observe.telemetry import MetricsRecorder


def test_counts_reach_redis_on_flush_per_worker_and_cache(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given
    gpu0 = CacheStats(redis_client, key_namespace, "gpu0")
    gpu1 = CacheStats(redis_client, key_namespace, "gpu1")
    # when
    gpu0.incr("local_image", "hits")
    gpu0.incr("local_image", "hits")
    gpu0.incr("shared_image", "bytes", 1234)
    gpu1.incr("kv", "misses", 3)
    buffered = read_all(redis_client, key_namespace)
    gpu0.flush()
    gpu1.flush()
    # then
    assert buffered == {}
    totals = read_all(redis_client, key_namespace)
    assert totals["gpu0"]["local_image"]["hits"] == 2
    assert totals["gpu0"]["shared_image"]["bytes"] == 1234
    assert totals["gpu0"]["kv"] == dict.fromkeys(FIELDS, 0)
    assert totals["gpu1"]["kv"]["misses"] == 3
    assert set(totals) == {"gpu0", "gpu1"}
    gpu0.close()
    gpu1.close()


def test_flushes_add_up_rather_than_overwrite(redis_client: redis.Redis, key_namespace: str) -> None:
    stats = CacheStats(redis_client, key_namespace, "gpu0")
    for _ in range(3):
        stats.incr("embedding", "hits", 2)
        stats.flush()
    assert read_all(redis_client, key_namespace)["gpu0"]["embedding"]["hits"] == 6
    stats.close()


def test_the_background_flusher_writes_without_being_asked(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    stats = CacheStats(redis_client, key_namespace, "gpu0", flush_interval=0.1)
    stats.incr("kv", "hits", 5)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if read_all(redis_client, key_namespace).get("gpu0", {}).get("kv", {}).get("hits") == 5:
            break
        time.sleep(0.05)
    assert read_all(redis_client, key_namespace)["gpu0"]["kv"]["hits"] == 5
    stats.close()


def test_counting_never_waits_on_redis(key_namespace: str) -> None:
    # A Redis that accepts connections and never answers: any wait on it would show.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    client = redis.Redis(port=silent.getsockname()[1], socket_timeout=2, socket_connect_timeout=2)
    stats = CacheStats(client, key_namespace, "gpu0", flush_interval=60)
    started = time.perf_counter()
    for _ in range(2000):
        stats.incr("local_image", "hits")
    assert time.perf_counter() - started < 0.5
    stats.recorder._stop.set()  # no close(): its final flush would wait on the silent server
    client.close()
    silent.close()


def test_a_failed_flush_keeps_the_counts_for_the_next_one(key_namespace: str) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    unreachable = redis.Redis(port=dead_port, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    stats = CacheStats(unreachable, key_namespace, "gpu0")
    stats.incr("kv", "hits", 4)
    with pytest.raises(redis.ConnectionError):
        stats.flush()
    with pytest.raises(redis.ConnectionError):
        stats.flush()
    assert sum(fields.get("hits", 0) for fields in stats.recorder._pending.values()) == 4
    stats.recorder._stop.set()


def test_per_minute_series_buckets_counts_with_a_day_of_ttl(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given a clock the test moves, so counts land in known minutes
    now = [1_700_000_000.0]
    stats = CacheStats(redis_client, key_namespace, "gpu0", clock=lambda: now[0])
    stats.incr("shared_image", "hits", 2)
    stats.incr("shared_image", "misses")
    now[0] += 120
    stats.incr("shared_image", "hits", 7)
    # when
    stats.flush()
    series = read_series(redis_client, key_namespace, "gpu0", "shared_image", 4, now=now[0])
    # then
    start = (1_700_000_000 // 60) * 60
    assert [minute for minute, _ in series] == [start - 60, start, start + 60, start + 120]
    assert [counts["hits"] for _, counts in series] == [0, 2, 0, 7]
    assert [counts["misses"] for _, counts in series] == [0, 1, 0, 0]
    ttl = redis_client.ttl(series_key(key_namespace, "gpu0", "shared_image", int(now[0] // 60)))
    assert 0 < ttl <= SERIES_TTL_SECS
    assert read_all(redis_client, key_namespace)["gpu0"]["shared_image"]["hits"] == 9
    stats.close()


def test_unknown_caches_and_counters_are_refused(redis_client: redis.Redis, key_namespace: str) -> None:
    stats = CacheStats(redis_client, key_namespace, "gpu0")
    with pytest.raises(ValueError, match="cache"):
        stats.incr("image", "hits")
    with pytest.raises(ValueError, match="counter"):
        stats.incr("kv", "hit")


def test_cache_counts_and_metrics_share_one_buffer_and_one_flush(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given a worker process's recorder, and its cache counters recording into it
    recorder = MetricsRecorder(redis_client, key_namespace, source="gpu0", flush_interval=60)
    stats = CacheStats(redis_client, key_namespace, "gpu0", recorder=recorder)
    # when both count and the recorder flushes once
    recorder.inc("completion_tokens", 3, labels={"worker": "gpu0", "model": "demo"})
    stats.incr("kv", "hits", 2)
    recorder.flush()
    # then both reach Redis, through one flusher thread
    assert read_all(redis_client, key_namespace)["gpu0"]["kv"]["hits"] == 2
    totals = telemetry.read_totals(redis_client, key_namespace)
    assert telemetry.counter_sum(totals, "completion_tokens", worker="gpu0") == 3
    flushers = [t for t in threading.enumerate() if t is recorder._flusher]
    assert len(flushers) == 1
    stats.close()  # the recorder is not its own: it stays for whoever made it
    assert recorder._flusher.is_alive()
    recorder.close()
