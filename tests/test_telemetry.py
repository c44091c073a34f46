"""routing.observe.telemetry: what processes record is summed in Redis, per minute and in total."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from routing.observe import telemetry
from routing.observe.metric_catalog import CATALOG, LATENCY_BUCKETS
from routing.observe.telemetry import MetricsRecorder


def test_two_processes_counts_add_up_in_redis(redis_client: redis.Redis, key_namespace: str) -> None:
    # given: two frontends recording the same series
    one = MetricsRecorder(redis_client, key_namespace, source="web:a")
    two = MetricsRecorder(redis_client, key_namespace, source="web:b")
    # when
    one.inc("requests", labels={"status": "200", "worker": "gpu0", "model": "demo"})
    two.inc("requests", 2, labels={"status": "200", "worker": "gpu0", "model": "demo"})
    two.inc("requests", labels={"status": "503", "worker": "none", "model": "none"})
    one.close()
    two.close()
    # then: whichever process reads, it reads the sum
    totals = telemetry.read_totals(redis_client, key_namespace)
    assert telemetry.counter_sum(totals, "requests", status="200") == 3
    assert telemetry.counter_sum(totals, "requests", worker="none") == 1
    assert telemetry.counter_sum(totals, "requests") == 4


def test_histogram_buckets_sum_and_quantiles(redis_client: redis.Redis, key_namespace: str) -> None:
    recorder = MetricsRecorder(redis_client, key_namespace, source="w")
    for seconds in (0.02, 0.02, 0.3, 7.0):
        recorder.observe("ttft_seconds", seconds, labels={"worker": "gpu0", "model": "demo"})
    # exactly on a bound: le holds it
    recorder.observe("ttft_seconds", 0.1, labels={"worker": "gpu1", "model": "demo"})
    recorder.close()

    totals = telemetry.read_totals(redis_client, key_namespace)
    buckets, total, count = totals["ttft_seconds"].histograms[("gpu0", "demo")]
    assert count == 4 and total == pytest.approx(7.34)
    assert buckets[LATENCY_BUCKETS.index(0.025)] == 2
    assert buckets[LATENCY_BUCKETS.index(0.5)] == 1
    assert buckets[LATENCY_BUCKETS.index(10.0)] == 1
    gpu1 = telemetry.histogram_merged(totals, "ttft_seconds", worker="gpu1")
    assert gpu1[LATENCY_BUCKETS.index(0.1)] == 1
    merged = telemetry.histogram_merged(totals, "ttft_seconds")
    assert sum(merged) == 5
    # the median of five observations is the third (0.1 s): inside the (0.05, 0.1] bucket
    median = telemetry.histogram_quantile(CATALOG["ttft_seconds"], merged, 0.5)
    assert 0.05 < median <= 0.1


def test_minutes_hold_what_was_recorded_in_them(redis_client: redis.Redis, key_namespace: str) -> None:
    now = 1_800_000_000.0
    earlier = MetricsRecorder(redis_client, key_namespace, source="w", clock=lambda: now - 600)
    earlier.inc("prompt_tokens", 100, labels={"worker": "gpu0", "model": "demo"})
    earlier.close()
    current = MetricsRecorder(redis_client, key_namespace, source="w", clock=lambda: now)
    current.inc("prompt_tokens", 7, labels={"worker": "gpu0", "model": "demo"})
    current.close()

    minute = int(now // 60)
    window = telemetry.merge(
        telemetry.read_minutes(redis_client, key_namespace, range(minute - 4, minute + 1))
    )
    assert telemetry.counter_sum(window, "prompt_tokens") == 7
    totals = telemetry.read_totals(redis_client, key_namespace)
    assert telemetry.counter_sum(totals, "prompt_tokens") == 107
    assert 0 < redis_client.ttl(telemetry.minute_key(key_namespace, minute)) <= telemetry.MINUTE_TTL_SECS


def test_gauges_are_last_values_and_leave_with_their_process(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    recorder = MetricsRecorder(redis_client, key_namespace, source="gpu0")
    recorder.set_gauge("engine_running_requests", 3, labels={"worker": "gpu0"})
    recorder.set_gauge("engine_running_requests", 2, labels={"worker": "gpu0"})
    recorder.close()
    gauges = telemetry.read_gauges(redis_client, key_namespace)
    assert gauges["engine_running_requests"].values == {("gpu0",): 2.0}
    # a process that stopped flushing long ago is not read, even if its key were still there
    later = telemetry.read_gauges(redis_client, key_namespace, now=10**10)
    assert later == {}
    assert 0 < redis_client.ttl(telemetry.gauge_key(key_namespace, "gpu0")) <= telemetry.GAUGE_TTL_SECS


def test_undeclared_names_wrong_kinds_and_wrong_labels_are_refused() -> None:
    recorder = MetricsRecorder()
    with pytest.raises(ValueError, match="not declared"):
        recorder.inc("requets")
    with pytest.raises(ValueError, match="is a histogram"):
        recorder.inc("ttft_seconds")
    with pytest.raises(ValueError, match="takes labels"):
        recorder.observe("ttft_seconds", 1.0, labels={"wrker": "gpu0"})
    with pytest.raises(ValueError, match="cannot go down"):
        recorder.inc("prompt_tokens", -1, labels={"worker": "gpu0", "model": "demo"})


def test_a_recorder_without_redis_keeps_what_it_recorded_until_attached(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    recorder = MetricsRecorder()
    recorder.inc("completion_tokens", 5, labels={"worker": "gpu0", "model": "demo"})
    recorder.flush()  # nowhere to write yet: kept
    recorder.attach(redis_client, key_namespace, "web:x")
    recorder.close()
    totals = telemetry.read_totals(redis_client, key_namespace)
    assert telemetry.counter_sum(totals, "completion_tokens") == 5


def test_a_failed_flush_keeps_the_counts_for_the_next(redis_url: str, key_namespace: str) -> None:
    """Fault injection: Redis on a closed port, then the real one."""
    from tests.test_dashboard import closed_port

    # no retries: redis-py's default backs off ten times (seconds) before it gives up
    dead = redis.Redis(port=closed_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    recorder = MetricsRecorder(dead, key_namespace, source="w")
    recorder.inc("completion_tokens", 2, labels={"worker": "gpu0", "model": "demo"})
    with pytest.raises(redis.RedisError):
        recorder.flush()
    live = redis.Redis.from_url(redis_url)
    try:
        recorder.attach(live, key_namespace, "w")
        recorder.close()
        assert telemetry.counter_sum(telemetry.read_totals(live, key_namespace), "completion_tokens") == 2
    finally:
        for key in live.scan_iter(match=f"{key_namespace}*"):
            live.delete(key)
        live.close()
