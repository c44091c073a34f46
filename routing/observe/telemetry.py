"""Counters, histograms and gauges that any process records, summed in Redis.

Every frontend and worker process records into an in-memory buffer (`inc`, `observe`,
`set_gauge`: a dict update under a lock, never a Redis call); a background thread flushes it
about once a second in one pipeline. Because the sums live in Redis, `/metrics` shows the same
figures whichever frontend is scraped, and they survive any process restart. Each counter and
histogram is also added to a per-minute bucket (kept a day), the pre-aggregated table that the
dashboard's windows read, as Zulip's charts read its count tables.

Keys (this module owns them):
- `<ns>m:total` hash, one field per series (`name`, histogram part, labels) -> running sum;
- `<ns>m:min:<minute>` hash, the same fields, what was added during that minute (TTL 25 h);
- `<ns>m:g:<source>` hash of a process's gauges (TTL `GAUGE_TTL_SECS`, renewed each flush),
  and `<ns>m:sources` sorted set, source -> last flush time, so readers skip dead processes.

A field is `name \\x1f part \\x1f labels-json`: part is "" for a counter, and for a histogram
"sum", "count" or "b<i>" (observations in bucket i, not cumulative; i = len(buckets) is +Inf).
A gauge is also sampled into the minute's bucket at each flush, as parts "gsum" (its values
added) and "gn" (samples taken), so the dashboard can chart a level over time (the mean per
minute: queue depth, KV pool use) from the same pre-aggregated buckets.
JSON escapes control characters, so the separator never appears inside a label value.

The same buffer and flush carry other modules' counters to the tables they own (`CountTable`:
routing.observe.cache_stats' per-worker cache counters), so a process has one buffer, one
flusher thread and one pipeline a second, whatever it counts.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import redis

from routing.observe.metric_catalog import CATALOG, Metric
from routing.state.redis_keys import reply_text

logger = logging.getLogger(__name__)

FLUSH_INTERVAL_SECS = 1.0
MINUTE_TTL_SECS = 25 * 3600
GAUGE_TTL_SECS = 15
SEP = "\x1f"

LabelKey = str  # labels as canonical JSON
Labels = Mapping[str, str | int]


def total_key(namespace: str) -> str:
    return f"{namespace}m:total"


def minute_key(namespace: str, minute: int | str) -> str:
    return f"{namespace}m:min:{minute}"


def gauge_key(namespace: str, source: str) -> str:
    return f"{namespace}m:g:{source}"


def sources_key(namespace: str) -> str:
    return f"{namespace}m:sources"


@dataclass(frozen=True)
class CountTable:
    """Where a flush adds counts: a hash of running totals and a hash per minute since the epoch
    (`<minute_prefix><minute>`, expiring `minute_ttl_s` after its last write). `member_of`, a set
    key and a member, is added to the set at each flush, so readers can find the tables."""

    totals: str
    minute_prefix: str
    minute_ttl_s: int
    member_of: tuple[str, str] | None = None


def metrics_table(namespace: str) -> CountTable:
    """The counters' and histograms' own table: `m:total` and `m:min:<minute>`."""
    return CountTable(total_key(namespace), minute_key(namespace, ""), MINUTE_TTL_SECS)


def _metric(name: str, kind: str) -> Metric:
    metric = CATALOG.get(name)
    if metric is None:
        raise ValueError(f"metric {name!r} is not declared in routing.observe.metric_catalog")
    if metric.kind != kind:
        raise ValueError(f"metric {name!r} is a {metric.kind}, not a {kind}")
    return metric


def _label_key(metric: Metric, labels: Labels | None) -> LabelKey:
    given = dict(labels or {})
    if set(given) != set(metric.labels):
        raise ValueError(f"metric {metric.name!r} takes labels {metric.labels}, got {tuple(given)}")
    return json.dumps([str(given[name]) for name in metric.labels], separators=(",", ":"))


def field_name(name: str, part: str, label_key: LabelKey) -> str:
    return f"{name}{SEP}{part}{SEP}{label_key}"


def bucket_index(metric: Metric, value: float) -> int:
    """The first bucket whose upper bound holds the value (bounds are inclusive, as `le` says)."""
    return bisect.bisect_left(metric.buckets, value)


class MetricsRecorder:
    """One process's recorder. Thread-safe; recording never touches Redis.

    Until `attach` gives it a Redis client it only buffers, so code may record before the
    process has set up its connection (an import-time path, a test).
    """

    def __init__(
        self,
        client: redis.Redis | None = None,
        namespace: str = "",
        *,
        source: str = "",
        flush_interval: float = FLUSH_INTERVAL_SECS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self.source = source
        self._flush_interval = flush_interval
        self._clock = clock
        self._lock = threading.Lock()
        # (table, minute) -> field -> amount; the minute is when it was recorded, not when
        # flushed. Table None is the metrics' own, whose keys are known once attached.
        self._pending: dict[tuple[CountTable | None, int], dict[str, float]] = defaultdict(
            lambda: defaultdict(float)
        )
        self._gauges: dict[str, float] = {}
        self._checked: dict[tuple[str, str, tuple], tuple[Metric, LabelKey]] = {}
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

    def attach(self, client: redis.Redis, namespace: str, source: str) -> None:
        with self._lock:
            self._client, self._namespace, self.source = client, namespace, source

    def inc(self, name: str, n: float = 1, labels: Labels | None = None) -> None:
        _, key = self._series(name, "counter", labels)
        if n < 0:
            raise ValueError(f"counter {name!r} cannot go down (got {n})")
        if n:
            self._add({field_name(name, "", key): n})

    def observe(self, name: str, value: float, labels: Labels | None = None) -> None:
        metric, key = self._series(name, "histogram", labels)
        self._add(
            {
                field_name(name, f"b{bucket_index(metric, value)}", key): 1,
                field_name(name, "sum", key): value,
                field_name(name, "count", key): 1,
            }
        )

    def _series(self, name: str, kind: str, labels: Labels | None) -> tuple[Metric, LabelKey]:
        """The metric and its labels' key, checked once per series (the request path repeats them)."""
        cache_key = (name, kind, tuple(labels.items()) if labels else ())
        found = self._checked.get(cache_key)
        if found is None:
            metric = _metric(name, kind)
            found = self._checked[cache_key] = (metric, _label_key(metric, labels))
        return found

    def set_gauge(self, name: str, value: float, labels: Labels | None = None) -> None:
        _, key = self._series(name, "gauge", labels)
        with self._lock:
            self._gauges[field_name(name, "", key)] = float(value)
            self._start_flusher()

    def add_counts(self, table: CountTable, amounts: Mapping[str, float]) -> None:
        """Add to fields of another module's table at the next flush (its names, its checks)."""
        self._add(amounts, table)

    def _add(self, amounts: Mapping[str, float], table: CountTable | None = None) -> None:
        minute = int(self._clock() // 60)
        with self._lock:
            pending = self._pending[(table, minute)]
            for name, amount in amounts.items():
                pending[name] += amount
            self._start_flusher()

    def _start_flusher(self) -> None:
        if self._flusher is None and not self._stop.is_set():
            self._flusher = threading.Thread(
                target=self._flush_periodically, name="metrics-flush", daemon=True
            )
            self._flusher.start()

    def flush(self) -> None:
        """Write what was recorded since the last flush; on failure it stays for the next try."""
        with self._lock:
            client, namespace, source = self._client, self._namespace, self.source
            if client is None:
                return
            pending, self._pending = self._pending, defaultdict(lambda: defaultdict(float))
            gauges = dict(self._gauges)
        if not pending and not gauges:
            return
        pipe = client.pipeline(transaction=False)
        own = metrics_table(namespace)
        members: set[tuple[str, str]] = set()
        for (table, minute), amounts in pending.items():
            table = table or own
            bucket = f"{table.minute_prefix}{minute}"
            for name, amount in amounts.items():
                _incr(pipe, table.totals, name, amount)
                _incr(pipe, bucket, name, amount)
            pipe.expire(bucket, table.minute_ttl_s)
            if table.member_of is not None:
                members.add(table.member_of)
        for set_key, member in members:
            pipe.sadd(set_key, member)
        if gauges:
            # One sample of each gauge in this minute's bucket: the dashboard's level over time.
            bucket = minute_key(namespace, int(self._clock() // 60))
            for name, value in gauges.items():
                gauge, _, labels = name.split(SEP, 2)
                _incr(pipe, bucket, f"{gauge}{SEP}gsum{SEP}{labels}", value)
                pipe.hincrby(bucket, f"{gauge}{SEP}gn{SEP}{labels}", 1)
            pipe.expire(bucket, MINUTE_TTL_SECS)
            # Rewritten whole, so a gauge the process no longer sets goes with the next flush.
            key = gauge_key(namespace, source)
            pipe.delete(key)
            pipe.hset(key, mapping=gauges)
            pipe.expire(key, GAUGE_TTL_SECS)
            pipe.zadd(sources_key(namespace), {source: self._clock()})
        try:
            pipe.execute()
        except redis.RedisError as exc:
            logger.warning("metrics flush from %s failed: %s", source, type(exc).__name__)
            with self._lock:
                for slot, amounts in pending.items():
                    for name, amount in amounts.items():
                        self._pending[slot][name] += amount
            raise

    def close(self) -> None:
        """Stop the background flusher and write what is left (best effort)."""
        self._stop.set()
        flusher = self._flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join(timeout=self._flush_interval + 1)
        with contextlib.suppress(redis.RedisError):
            self.flush()

    def _flush_periodically(self) -> None:
        while not self._stop.wait(self._flush_interval):
            with contextlib.suppress(redis.RedisError):  # logged by flush; retried next round
                self.flush()


def _incr(pipe: redis.client.Pipeline, key: str, name: str, amount: float) -> None:
    # Integers stay integers in Redis (exact, and HINCRBY is cheaper than HINCRBYFLOAT).
    if float(amount).is_integer():
        pipe.hincrby(key, name, int(amount))
    else:
        pipe.hincrbyfloat(key, name, amount)


# --- The process's recorder: what instrumented code calls ---------------------------------

_process_recorder = MetricsRecorder()


def process_recorder() -> MetricsRecorder:
    return _process_recorder


def attach(client: redis.Redis, namespace: str, source: str) -> MetricsRecorder:
    """Send this process's metrics to Redis (a frontend on its first request, `run_worker` at start)."""
    _process_recorder.attach(client, namespace, source)
    return _process_recorder


def inc(name: str, n: float = 1, labels: Labels | None = None) -> None:
    _process_recorder.inc(name, n, labels)


def observe(name: str, value: float, labels: Labels | None = None) -> None:
    _process_recorder.observe(name, value, labels)


def set_gauge(name: str, value: float, labels: Labels | None = None) -> None:
    _process_recorder.set_gauge(name, value, labels)


# --- Reading ------------------------------------------------------------------------------


@dataclass
class Series:
    """One metric's samples: labels -> value (a counter's or gauge's), or histogram parts."""

    metric: Metric
    values: dict[tuple[str, ...], float] = field(default_factory=dict)
    # histogram: labels -> (per-bucket counts, not cumulative; sum; count)
    histograms: dict[tuple[str, ...], tuple[list[float], float, float]] = field(default_factory=dict)
    # gauge, in a minute's bucket: labels -> (values sampled, added; samples taken)
    samples: dict[tuple[str, ...], tuple[float, float]] = field(default_factory=dict)


Parsed = dict[str, Series]


def parse_fields(reply: Mapping[bytes | str, bytes | str]) -> Parsed:
    """A hash of fields as `MetricsRecorder.flush` writes them, by metric and labels."""
    parsed: Parsed = {}
    for raw_field, raw_value in reply.items():
        text = reply_text(raw_field)
        name, part, label_json = ([*text.split(SEP, 2), "", ""])[:3]
        metric = CATALOG.get(name)
        if metric is None:
            continue  # a metric a newer (or older) version records: not ours to show
        try:
            labels = tuple(json.loads(label_json))
        except ValueError:
            continue
        if len(labels) != len(metric.labels):
            continue  # the metric's labels changed between versions
        value = float(raw_value)
        series = parsed.setdefault(name, Series(metric))
        if metric.kind == "gauge" and part in ("gsum", "gn"):
            total, taken = series.samples.get(labels, (0.0, 0.0))
            series.samples[labels] = (total + value, taken) if part == "gsum" else (total, taken + value)
            continue
        if metric.kind != "histogram":
            series.values[labels] = series.values.get(labels, 0.0) + value
            continue
        buckets, total, count = series.histograms.get(labels) or ([0.0] * (len(metric.buckets) + 1), 0.0, 0.0)
        if part == "sum":
            total += value
        elif part == "count":
            count += value
        elif part.startswith("b") and part[1:].isdigit() and int(part[1:]) < len(buckets):
            buckets[int(part[1:])] += value
        series.histograms[labels] = (buckets, total, count)
    return parsed


def merge(many: Iterable[Parsed]) -> Parsed:
    merged: Parsed = {}
    for parsed in many:
        for name, series in parsed.items():
            into = merged.setdefault(name, Series(series.metric))
            for labels, value in series.values.items():
                into.values[labels] = into.values.get(labels, 0.0) + value
            for labels, (total, taken) in series.samples.items():
                have_total, have_taken = into.samples.get(labels, (0.0, 0.0))
                into.samples[labels] = (have_total + total, have_taken + taken)
            for labels, (buckets, total, count) in series.histograms.items():
                have = into.histograms.get(labels)
                if have is None:
                    into.histograms[labels] = (list(buckets), total, count)
                else:
                    into.histograms[labels] = (
                        [a + b for a, b in zip(have[0], buckets, strict=True)],
                        have[1] + total,
                        have[2] + count,
                    )
    return merged


def read_totals(client: redis.Redis, namespace: str) -> Parsed:
    """Every counter and histogram since the deployment began."""
    return parse_fields(client.hgetall(total_key(namespace)))


def read_gauges(client: redis.Redis, namespace: str, *, now: float | None = None) -> Parsed:
    """The gauges of every process that flushed within `GAUGE_TTL_SECS`, summed per labels."""
    now = time.time() if now is None else now
    sources_at = sources_key(namespace)
    client.zremrangebyscore(sources_at, "-inf", now - 24 * 3600)  # forget long-gone processes
    sources = client.zrangebyscore(sources_at, now - GAUGE_TTL_SECS, "+inf")
    if not sources:
        return {}
    pipe = client.pipeline(transaction=False)
    for source in sources:
        pipe.hgetall(gauge_key(namespace, reply_text(source)))
    return merge(parse_fields(reply) for reply in pipe.execute())


def read_minutes(client: redis.Redis, namespace: str, minutes: Iterable[int]) -> list[Parsed]:
    """What was recorded in each of these minutes (since the epoch), in one round trip."""
    wanted = list(minutes)
    pipe = client.pipeline(transaction=False)
    for minute in wanted:
        pipe.hgetall(minute_key(namespace, minute))
    return [parse_fields(reply) for reply in pipe.execute()]


def counter_sum(parsed: Parsed, name: str, **where: str) -> float:
    """A counter summed over every series whose labels match `where`."""
    series = parsed.get(name)
    if series is None:
        return 0.0
    positions = {series.metric.labels.index(label): value for label, value in where.items()}
    return sum(
        value
        for labels, value in series.values.items()
        if all(labels[i] == wanted for i, wanted in positions.items())
    )


def gauge_mean(parsed: Parsed, name: str, **where: str) -> float | None:
    """A gauge's mean over a minute's samples, summed over the series whose labels match `where`
    (e.g. the queue depth of every worker); None if no process sampled it then."""
    series = parsed.get(name)
    if series is None:
        return None
    positions = {series.metric.labels.index(label): value for label, value in where.items()}
    means = [
        total / taken
        for labels, (total, taken) in series.samples.items()
        if taken and all(labels[i] == wanted for i, wanted in positions.items())
    ]
    return sum(means) if means else None


def label_values(parsed: Parsed, name: str, label: str) -> set[str]:
    """The values a label takes in a metric's counters, histograms and gauge samples."""
    series = parsed.get(name)
    if series is None:
        return set()
    position = series.metric.labels.index(label)
    labelled = [*series.values, *series.histograms, *series.samples]
    return {labels[position] for labels in labelled}


def histogram_quantile(metric: Metric, buckets: list[float], q: float) -> float | None:
    """Prometheus's estimate: linear within the bucket holding the q-th observation."""
    count = sum(buckets)
    if not count:
        return None
    rank = q * count
    seen = 0.0
    for i, in_bucket in enumerate(buckets):
        if seen + in_bucket >= rank and in_bucket:
            if i == len(metric.buckets):  # +Inf: the highest finite bound, as Prometheus says
                return metric.buckets[-1]
            lower = metric.buckets[i - 1] if i else 0.0
            return lower + (metric.buckets[i] - lower) * (rank - seen) / in_bucket
        seen += in_bucket
    return metric.buckets[-1]


def histogram_merged(parsed: Parsed, name: str, **where: str) -> list[float]:
    """A histogram's per-bucket counts summed over every series whose labels match `where`."""
    metric = CATALOG[name]
    merged = [0.0] * (len(metric.buckets) + 1)
    series = parsed.get(name)
    if series is None:
        return merged
    positions = {metric.labels.index(label): value for label, value in where.items()}
    for labels, (buckets, _total, _count) in series.histograms.items():
        if all(labels[i] == wanted for i, wanted in positions.items()):
            merged = [a + b for a, b in zip(merged, buckets, strict=True)]
    return merged
