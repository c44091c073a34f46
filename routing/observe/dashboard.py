"""One read of the deployment's live state for operators: the admin dashboard, /metrics and
`manage.py routing_stats` all show this snapshot, so they never disagree.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import redis

from routing.fleet.encoders import EncoderPool, dashboard_section
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.kv.index import KvIndex
from routing.kv.load import IDLE, LoadTracker, WorkerLoad
from routing.observe import telemetry
from routing.observe.cache_stats import CACHES, FIELDS, series_key, totals_key, workers_key
from routing.state.lua import execute_pipeline
from routing.state.redis_keys import reply_text

DEFAULT_MINUTES = 30
# The windows the dashboard offers (minutes); any 1..MAX_MINUTES is accepted.
WINDOWS: tuple[int, ...] = (5, 15, 60, 360, 1440)
QUANTILES: tuple[float, ...] = (0.5, 0.9, 0.99)
MAX_MINUTES = 24 * 60  # the per-minute series is kept for a day (cache_stats.SERIES_TTL_SECS)

Counts = dict[str, int]
Snapshot = dict[str, Any]


class WorkerRow(Protocol):
    """What the dashboard needs of an operator's worker row (routing.models.Worker has it)."""

    name: str
    enabled: bool
    draining: bool
    device: str
    model_name: str


def hit_rate(cache: str, counts: Counts) -> float | None:
    """The share of lookups the cache answered; None before the first lookup.

    The KV cache is measured in tokens (cached over prompt tokens, as its users see it), the
    others in lookups; bypasses were never lookups, so they count on neither side.
    """
    if cache == "kv":
        hits, total = counts["cached_tokens"], counts["prompt_tokens"]
    else:
        hits, total = counts["hits"], counts["hits"] + counts["misses"]
    return hits / total if total else None


def worker_state(*, live: bool, registered: bool, enabled: bool, draining: bool, stopping: bool) -> str:
    """One word for the operator, in the order the dispatcher refuses a worker."""
    if not live:
        return "down"
    if not registered:
        return "unregistered"
    if not enabled:
        return "disabled"
    if draining:
        return "draining"
    if stopping:
        return "stopping"
    return "serving"


class DashboardReader:
    """Reads a snapshot in four round trips whatever the number of workers and minutes: the
    reporting workers, their heartbeats, their block counts, and one pipeline for load and
    counters.

    Build it once per Redis client and namespace (see `shared_reader`): the index and load
    tracker load their Lua scripts when constructed. Live state (heartbeats, index, load,
    encoders) is read under `namespace`; counters (cache hits, telemetry) under
    `statistics_namespace`, the deployment's own (routing.deployment; the same by default).
    """

    def __init__(self, client: redis.Redis, namespace: str, statistics_namespace: str | None = None) -> None:
        self._client = client
        self._namespace = namespace
        self._statistics = namespace if statistics_namespace is None else statistics_namespace
        self._registry = WorkerRegistry(client, namespace)
        self._index = KvIndex(client, namespace)
        self._load = LoadTracker(client, namespace)
        self._encoders = EncoderPool(client, namespace, statistics_namespace=self._statistics)

    def snapshot(
        self, rows: Iterable[WorkerRow], *, minutes: int = DEFAULT_MINUTES, now: float | None = None
    ) -> Snapshot:
        """Every worker that has a row or ever reported cache counters, live or not.

        minutes: how many per-minute hit-rate points to read (0: totals only, as /metrics wants).
        """
        if not 0 <= minutes <= MAX_MINUTES:
            raise ValueError(f"minutes must be between 0 and {MAX_MINUTES}")
        now = time.time() if now is None else now
        rows_by_name = {row.name: row for row in rows}
        reported = {reply_text(name) for name in self._client.smembers(workers_key(self._statistics))}
        names = sorted(rows_by_name.keys() | reported)
        # Heartbeats of known names, not WorkerRegistry.all_alive: its SCAN walks the whole
        # keyspace (every KV block is a key) on each 2 s poll. A worker process registers its
        # row when it starts, so a live one without a row or counters is not missed for long.
        beats = self._registry.alive(names)
        cached_blocks = self._index.block_counts(names)

        current_minute = int(now // 60)
        minute_starts = [m * 60 for m in range(current_minute - minutes + 1, current_minute + 1)]
        loads, totals, series, metric_totals = self._read_load_and_counters(names, minute_starts)

        workers = [
            _worker_entry(
                name,
                rows_by_name.get(name),
                beats.get(name),
                loads[i],
                cached_blocks.get(name, 0),
                totals[name],
                series[name],
            )
            for i, name in enumerate(names)
        ]
        all_totals = {cache: _summed(totals[name][cache] for name in names) for cache in CACHES}
        all_series = {
            cache: [
                hit_rate(cache, _summed(series[name][cache][i] for name in names))
                for i in range(len(minute_starts))
            ]
            for cache in CACHES
        }
        window_caches = {
            cache: _summed(series[name][cache][i] for name in names for i in range(len(minute_starts)))
            for cache in CACHES
        }
        return {
            "generated_at": now,
            "minutes": minutes,
            "configuration": configuration_check(workers),
            "series_start": minute_starts[0] if minute_starts else None,
            "workers": workers,
            # Lifetime totals (what /metrics exposes) ...
            "caches": {cache: _with_rate(cache, all_totals[cache]) for cache in CACHES},
            "series": all_series,
            "routing": routing_quality(metric_totals),
            # ... and the chosen window's figures, read from the per-minute buckets only.
            "window": self._window(minute_starts, window_caches) if minutes else None,
            # E/PD: encoder load and queue, embedding-cache hit rate, transfer bytes and time per image.
            "encoders": self._encoder_section(workers, now),
        }

    def _encoder_section(self, workers: Sequence[dict[str, Any]], now: float) -> dict[str, Any]:
        """E/PD's section. An encode worker lists its embeddings for the router; a `both` or `llm`
        worker's own embedding cache is known only from its gauge, so its row reads that (it
        read 0, the empty router list, while the worker held some)."""
        section = dashboard_section(self._encoders, {w["name"]: w["role"] for w in workers})
        held = telemetry.read_gauges(self._client, self._statistics, now=now).get("embedding_cache_entries")
        for entry in section["workers"]:
            if entry["role"] != "encode":
                own = held.values.get((entry["name"],)) if held is not None else None
                entry["cached_entries"] = None if own is None else int(own)
        return section

    def _window(self, minute_starts: Sequence[int], caches: dict[str, Counts]) -> dict[str, Any]:
        """The window's requests, tokens, errors, latencies and routing quality, per minute and summed."""
        per_minute = telemetry.read_minutes(self._client, self._statistics, [m // 60 for m in minute_starts])
        summed = telemetry.merge(per_minute)
        # Workers that answered requests, or whose engine reported its queue, in the window.
        workers = sorted(
            (
                telemetry.label_values(summed, "requests", "worker")
                | telemetry.label_values(summed, "engine_waiting_requests", "worker")
            )
            - {"none"}
        )
        return {
            "minute_starts": list(minute_starts),
            "totals": _window_figures(summed, len(minute_starts)),
            "caches": {cache: _with_rate(cache, caches[cache]) for cache in CACHES},
            "per_minute": [_window_figures(parsed, 1) for parsed in per_minute],
            "statuses": sorted(_statuses(summed)),
            "workers": workers,
            "per_worker": {worker: _worker_window(summed, per_minute, worker) for worker in workers},
        }

    def _read_load_and_counters(
        self, names: Sequence[str], minute_starts: Sequence[int]
    ) -> tuple[
        list[WorkerLoad],
        dict[str, dict[str, Counts]],
        dict[str, dict[str, list[Counts]]],
        telemetry.Parsed,
    ]:
        """Load, counter totals and per-minute counters of every worker, in one pipeline."""
        pipe = self._client.pipeline(transaction=False)
        # Sweep first, as LoadTracker.snapshot does, so requests of a dead frontend do not linger.
        self._load.sweep_script.queue(pipe, self._namespace)
        self._load.queue_totals(pipe)
        for name in names:
            for cache in CACHES:
                pipe.hgetall(totals_key(self._statistics, name, cache))
        for name in names:
            for cache in CACHES:
                for start in minute_starts:
                    pipe.hgetall(series_key(self._statistics, name, cache, start // 60))
        pipe.hgetall(telemetry.total_key(self._statistics))
        replies = iter(execute_pipeline(pipe, [self._load.sweep_script])[1:])
        loads = LoadTracker.loads(next(replies), names)
        totals = {name: {cache: _counts(next(replies)) for cache in CACHES} for name in names}
        series = {
            name: {cache: [_counts(next(replies)) for _ in minute_starts] for cache in CACHES}
            for name in names
        }
        metric_totals = telemetry.parse_fields(next(replies))
        return loads, totals, series, metric_totals


def routing_quality(metric_totals: telemetry.Parsed) -> dict[str, Any]:
    """The router's decisions and the prefix blocks it gave up: "the hit rate we could have had".

    best_overlap_blocks sums, over decisions, the longest prefix any eligible worker held;
    overlap_given_up_blocks what the chosen worker lacked of it (load, affinity or a baseline
    mode chose elsewhere). given_up_fraction is their ratio (None before any overlap was seen).
    """

    def total(name: str) -> int:
        series = metric_totals.get(name)
        return int(sum(series.values.values())) if series is not None else 0

    best, given_up = total("routing_best_overlap_blocks"), total("routing_overlap_given_up_blocks")
    return {
        "decisions": total("routing_decisions"),
        "best_overlap_blocks": best,
        "overlap_given_up_blocks": given_up,
        "given_up_fraction": given_up / best if best else None,
    }


_readers: dict[tuple[redis.Redis, str, str | None], DashboardReader] = {}
_readers_lock = threading.Lock()


def shared_reader(
    client: redis.Redis, namespace: str, statistics_namespace: str | None = None
) -> DashboardReader:
    """One reader per client and namespaces for the process (web requests poll every 5 s)."""
    key = (client, namespace, statistics_namespace)
    with _readers_lock:
        reader = _readers.get(key)
        if reader is None:
            reader = _readers[key] = DashboardReader(client, namespace, statistics_namespace)
        return reader


def _worker_entry(
    name: str,
    row: WorkerRow | None,
    beat: Heartbeat | None,
    load: tuple[int, int, int],
    cached_blocks: int,
    totals: dict[str, Counts],
    series: dict[str, list[Counts]],
) -> dict[str, Any]:
    prefill, decode_blocks, requests = load if load[2] else IDLE
    live, registered = beat is not None, row is not None
    # A worker with no row cannot be dispatched to, whatever its heartbeat says.
    enabled = bool(row and row.enabled)
    draining = bool(row and row.draining)
    stopping = bool(beat and beat.stopping)
    capacity = beat.kv_capacity_blocks if beat else 0
    return {
        "name": name,
        "state": worker_state(
            live=live, registered=registered, enabled=enabled, draining=draining, stopping=stopping
        ),
        "live": live,
        "registered": registered,
        "enabled": enabled,
        "draining": draining,
        "stopping": stopping,
        # The heartbeat says what the process serves now; the row what it served last.
        "model": beat.model if beat else (row.model_name if row else ""),
        "device": beat.device if beat else (row.device if row else ""),
        "block_size": beat.block_size if beat else None,
        "role": beat.role if beat else getattr(row, "role", "both"),
        "active_requests": requests,
        "active_prefill_tokens": prefill,
        "active_decode_blocks": decode_blocks,
        "cached_blocks": cached_blocks,
        "capacity_blocks": capacity,
        "cache_fill": cached_blocks / capacity if capacity else None,
        # Session-scope configuration as the process reports it (None: no heartbeat to say).
        "session_scoped": beat.session_scoped if beat else None,
        "shared_image_cache": beat.shared_image_cache if beat else None,  # redacted by the worker
        # The engine's own state, as its last heartbeat reported it (workers.engine.EngineLoad).
        "engine_running": beat.running if beat else 0,
        "engine_waiting": beat.waiting if beat else 0,
        "engine_max_running": beat.max_running if beat else 0,
        "kv_blocks_used": beat.kv_blocks_used if beat else 0,
        "kv_blocks_free": beat.kv_blocks_free if beat else 0,
        # KV cache usage as vLLM and Dynamo users read "KV %": the pool's blocks held by running
        # requests (cached but unreferenced blocks are free to take). Not the prefix hit rate.
        "kv_usage": _pool_use(beat),
        "caches": {cache: _with_rate(cache, totals[cache]) for cache in CACHES},
        "window_caches": {cache: _with_rate(cache, _summed(series[cache])) for cache in CACHES},
        "series": {cache: [hit_rate(cache, counts) for counts in series[cache]] for cache in CACHES},
    }


def _pool_use(beat: Heartbeat | None) -> float | None:
    if beat is None or beat.kv_blocks_used + beat.kv_blocks_free <= 0:
        return None
    return beat.kv_blocks_used / (beat.kv_blocks_used + beat.kv_blocks_free)


def configuration_check(workers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Session-scope settings that disagree between live workers: a misconfiguration.

    One worker scoped and another not means a session's images are private on one and shared on
    the other; workers on different shared caches never see each other's images.
    """
    live = [w for w in workers if w["live"]]
    scoped = sorted(w["name"] for w in live if w["session_scoped"])
    unscoped = sorted(w["name"] for w in live if not w["session_scoped"])
    caches = sorted({w["shared_image_cache"] for w in live})
    problems = []
    if scoped and unscoped:
        problems.append(
            f"Session-scoped caches are on for {', '.join(scoped)} but off for {', '.join(unscoped)}: "
            "set DYN_MM_IMAGE_CACHE_SESSION_SCOPED the same on every worker."
        )
    if len(caches) > 1:
        problems.append(
            f"Workers use {len(caches)} different shared image caches ({', '.join(caches)}): "
            "they cannot share fetched images."
        )
    return {
        "session_scope_mismatch": bool(scoped and unscoped),
        "shared_cache_mismatch": len(caches) > 1,
        "problems": problems,
    }


RATE_LIMITED = "429"


def status_class(status: str) -> str:
    """Whose doing a status is: "server" (5xx: ours to fix), "rate_limited" (429: a limit doing
    its job), "client" (any other 4xx, 499 included: the caller's mistake or departure), "ok"."""
    if status == RATE_LIMITED:
        return "rate_limited"
    if status.startswith("5"):
        return "server"
    if status.startswith("4"):
        return "client"
    return "ok"


def _window_figures(parsed: telemetry.Parsed, minutes: int) -> dict[str, Any]:
    requests = telemetry.counter_sum(parsed, "requests")
    ok = telemetry.counter_sum(parsed, "requests", status="200")
    by_status = {
        status: int(telemetry.counter_sum(parsed, "requests", status=status))
        for status in sorted(_statuses(parsed))
    }
    by_class = dict.fromkeys(("server", "client", "rate_limited"), 0)
    for status, n in by_status.items():
        if status_class(status) in by_class:
            by_class[status_class(status)] += n
    prompt = telemetry.counter_sum(parsed, "prompt_tokens")
    cached = telemetry.counter_sum(parsed, "cached_prompt_tokens")
    completion = telemetry.counter_sum(parsed, "completion_tokens")
    seconds = 60 * minutes
    ttft = telemetry.histogram_merged(parsed, "ttft_seconds")
    duration = telemetry.histogram_merged(parsed, "request_duration_seconds")
    inter_token = telemetry.histogram_merged(parsed, "inter_token_seconds")
    ttft_metric = telemetry.CATALOG["ttft_seconds"]
    duration_metric = telemetry.CATALOG["request_duration_seconds"]
    inter_token_metric = telemetry.CATALOG["inter_token_seconds"]
    queue_wait_metric = telemetry.CATALOG["admission_queue_wait_seconds"]
    queue_wait = telemetry.histogram_merged(parsed, "admission_queue_wait_seconds")
    given_up = telemetry.counter_sum(parsed, "routing_overlap_given_up_blocks")
    best = telemetry.counter_sum(parsed, "routing_best_overlap_blocks")
    return {
        "requests": int(requests),
        "errors": int(requests - ok),
        # Split by whose doing they are, each with its share of the requests (None: no request).
        "server_errors": by_class["server"],
        "client_errors": by_class["client"],
        "rate_limited": by_class["rate_limited"],
        "server_error_share": by_class["server"] / requests if requests else None,
        "client_error_share": by_class["client"] / requests if requests else None,
        "rate_limited_share": by_class["rate_limited"] / requests if requests else None,
        "by_status": by_status,
        "prompt_tokens": int(prompt),
        "cached_prompt_tokens": int(cached),
        "completion_tokens": int(completion),
        "requests_per_s": requests / seconds,
        "tokens_per_s": (prompt + completion) / seconds,
        "completion_tokens_per_s": completion / seconds,
        "kv_hit_rate": cached / prompt if prompt else None,
        "ttft": {f"p{round(q * 100)}": telemetry.histogram_quantile(ttft_metric, ttft, q) for q in QUANTILES},
        "latency": {
            f"p{round(q * 100)}": telemetry.histogram_quantile(duration_metric, duration, q)
            for q in QUANTILES
        },
        "inter_token": {
            f"p{round(q * 100)}": telemetry.histogram_quantile(inter_token_metric, inter_token, q)
            for q in QUANTILES
        },
        # Levels (mean of the per-second samples, summed over workers; None: none reported).
        "engine_waiting": telemetry.gauge_mean(parsed, "engine_waiting_requests"),
        "engine_running": telemetry.gauge_mean(parsed, "engine_running_requests"),
        # The admission queue: requests waiting on average (Little's law: the time they spent
        # waiting over the window's time, so every frontend's waits add up; None: no request
        # waited), how long they waited, and how many it turned away.
        "queued": _waited_seconds(parsed) / seconds if queue_wait_metric.name in parsed else None,
        "queue_wait": {
            f"p{round(q * 100)}": telemetry.histogram_quantile(queue_wait_metric, queue_wait, q)
            for q in QUANTILES
        },
        "shed": int(telemetry.counter_sum(parsed, "requests_shed")),
        # Recorded by the router once it computes it (None: nothing recorded in the window).
        "overlap_given_up_blocks": int(given_up) if best or given_up else None,
        "best_overlap_blocks": int(best) if best or given_up else None,
        "overlap_given_up_share": given_up / best if best else None,
    }


def _waited_seconds(parsed: telemetry.Parsed) -> float:
    """Seconds requests spent in the admission queue, summed over the waits that ended."""
    series = parsed.get("admission_queue_wait_seconds")
    return sum(total for _, total, _ in series.histograms.values()) if series is not None else 0.0


def _worker_window(
    summed: telemetry.Parsed, per_minute: list[telemetry.Parsed], worker: str
) -> dict[str, Any]:
    ttft_metric = telemetry.CATALOG["ttft_seconds"]
    return {
        "requests": int(telemetry.counter_sum(summed, "requests", worker=worker)),
        "ttft_p50": [
            telemetry.histogram_quantile(
                ttft_metric, telemetry.histogram_merged(p, "ttft_seconds", worker=worker), 0.5
            )
            for p in per_minute
        ],
        # Per minute, the mean of its engine's samples: requests waiting, and KV cache use as
        # vLLM reports it (blocks held by requests over the pool; cached but evictable is free).
        "engine_waiting": [
            telemetry.gauge_mean(p, "engine_waiting_requests", worker=worker) for p in per_minute
        ],
        "engine_running": [
            telemetry.gauge_mean(p, "engine_running_requests", worker=worker) for p in per_minute
        ],
        "kv_usage": [_kv_usage(p, worker) for p in per_minute],
    }


def _kv_usage(parsed: telemetry.Parsed, worker: str) -> float | None:
    used = telemetry.gauge_mean(parsed, "engine_kv_blocks_used", worker=worker)
    free = telemetry.gauge_mean(parsed, "engine_kv_blocks_free", worker=worker)
    if used is None or free is None or used + free <= 0:
        return None
    return used / (used + free)


def _statuses(parsed: telemetry.Parsed) -> set[str]:
    return telemetry.label_values(parsed, "requests", "status")


def _with_rate(cache: str, counts: Counts) -> dict[str, Any]:
    return {**counts, "hit_rate": hit_rate(cache, counts)}


def _summed(many: Iterable[Counts]) -> Counts:
    total = dict.fromkeys(FIELDS, 0)
    for counts in many:
        for field, value in counts.items():
            total[field] += value
    return total


def _counts(reply: dict[Any, Any]) -> Counts:
    counts = dict.fromkeys(FIELDS, 0)
    for field, value in reply.items():
        name = reply_text(field)
        # A field this version does not know (a newer worker's) must not break the dashboard.
        if name in counts:
            counts[name] = int(value)
    return counts
