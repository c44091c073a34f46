"""GET /metrics: the deployment's metrics for Prometheus, in its text format or OpenMetrics.

Everything comes from Redis (the dashboard's snapshot for worker state and cache counters,
`routing.observe.telemetry` for the request histograms, counters and engine gauges), so every frontend
process answers the same. prometheus_client renders it, and picks the format from the scraper's
Accept header (OpenMetrics when asked for, Prometheus text 0.0.4 otherwise).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from inference_platform.api.auth import api_key_required
from inference_platform.serving.clock import counts_http_responses
from routing.deployment import statistics_namespace
from routing.fleet.encoders import FALLBACK_CAUSES
from routing.fleet.registry import WorkerRegistry
from routing.models import Model, ModelFleet, Worker, model_fleets
from routing.observe import telemetry
from routing.observe.cache_stats import CACHES
from routing.observe.dashboard import Snapshot, shared_reader
from routing.observe.metric_catalog import CATALOG
from routing.state.redis_keys import redact_text, sync_client

PREFIX = "mmr_"

# (metric, key of the snapshot's worker entry, help); each a gauge labelled by worker.
WORKER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("worker_live", "live", "1 while the worker's heartbeat is present."),
    ("worker_enabled", "enabled", "1 if an operator allows requests to the worker."),
    ("worker_draining", "draining", "1 while the worker finishes its work and takes nothing new."),
    ("worker_stopping", "stopping", "1 once the worker process received SIGTERM."),
    ("worker_active_requests", "active_requests", "Requests dispatched to the worker and not finished."),
    (
        "worker_active_prefill_tokens",
        "active_prefill_tokens",
        "Prompt tokens of the worker's requests still waiting for their first token.",
    ),
    ("worker_active_decode_blocks", "active_decode_blocks", "KV blocks of the worker's active requests."),
    ("worker_cached_blocks", "cached_blocks", "KV blocks the router's index believes the worker holds."),
    ("worker_engine_running", "engine_running", "Requests in the worker engine's batch (heartbeat)."),
    ("worker_engine_waiting", "engine_waiting", "Requests waiting in the worker engine's queue (heartbeat)."),
    ("worker_kv_blocks_used", "kv_blocks_used", "KV pool blocks held by the engine's running requests."),
    ("worker_kv_blocks_free", "kv_blocks_free", "KV pool blocks free or evictable in the engine."),
    (
        "worker_kv_capacity_blocks",
        "capacity_blocks",
        "KV blocks the worker's prefix cache can hold (0: not reported).",
    ),
)

# Counters per worker and cache; the KV cache also counts tokens, its hit rate's measure.
CACHE_COUNTERS: tuple[tuple[str, str], ...] = (
    ("hits", "Lookups the cache answered."),
    ("misses", "Lookups the cache could not answer."),
    ("bypasses", "Requests that skipped the cache."),
    ("errors", "Cache operations that failed."),
    ("bytes", "Bytes the cache served."),
)
# E/PD, per worker (routing.fleet.encoders): gauges of the snapshot's entry, and counters with their scale
# to the exposition's units (microseconds become seconds).
ENCODER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("encoder_pending_images", "pending", "Images sent to the encode worker and not finished (its queue)."),
    ("encoder_busy_images", "busy", "Images the encode worker has taken and not finished (its load)."),
    ("encoder_cached_embeddings", "cached_entries", "Entries of the encode worker's embedding cache."),
)
ENCODER_COUNTERS: tuple[tuple[str, str, float, str], ...] = (
    (
        "epd_images_encoded",
        "images",
        1.0,
        "Images an encode worker answered for (from its cache or encoded).",
    ),
    ("epd_embedding_cache_hits", "cache_hits", 1.0, "Encode worker embedding cache hits."),
    ("epd_embedding_cache_misses", "cache_misses", 1.0, "Encode worker embedding cache misses (encoded)."),
    ("epd_encode_seconds", "encode_us", 1e-6, "Time an encode worker spent in its vision tower."),
    ("epd_put_bytes", "put_bytes", 1.0, "Feature bytes an encode worker put in the media side store."),
    ("epd_put_seconds", "put_us", 1e-6, "Time an encode worker spent putting features in the side store."),
    ("epd_features_received", "received", 1.0, "Images whose features an LLM worker received intact."),
    ("epd_received_bytes", "received_bytes", 1.0, "Feature bytes an LLM worker read from the side store."),
    ("epd_get_seconds", "get_us", 1e-6, "Time an LLM worker spent reading and checking features."),
    ("vision_tower_forwards", "tower_forwards", 1.0, "Forward passes of the worker's vision tower."),
)
KV_TOKEN_COUNTERS: tuple[tuple[str, str], ...] = (
    ("cached_tokens", "Prompt tokens served from the worker's prefix KV cache."),
    ("prompt_tokens", "Prompt tokens the worker processed, cached or not."),
)


@csrf_exempt  # a scraper's POST is a 405, not the CSRF failure page
@counts_http_responses  # a scraper with a wrong token is a 401 Prometheus shows too
@require_GET
@api_key_required(operator=True, metrics_token=True)
def metrics(request: HttpRequest) -> HttpResponse:
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    try:
        families = deployment_families()
    except redis.RedisError as exc:
        # A scrape that fails shows as `up == 0` in Prometheus, which is what an operator wants.
        return HttpResponse(
            f"redis unavailable: {redact_text(str(exc))}\n",
            status=503,
            content_type="text/plain; charset=utf-8",
        )
    return HttpResponse(encoder(_registry_of(families)), content_type=content_type)


def deployment_families() -> list[Metric]:
    client, namespace = sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX
    statistics = statistics_namespace()
    snapshot = shared_reader(client, namespace, statistics).snapshot(Worker.objects.all(), minutes=0)
    alive = WorkerRegistry(client, namespace).alive(Worker.objects.values_list("name", flat=True))
    return [
        *snapshot_families(snapshot),
        *model_families(model_fleets(Model.objects.all(), alive.values())),
        *telemetry_families(
            telemetry.read_totals(client, statistics), telemetry.read_gauges(client, statistics)
        ),
    ]


def render_metrics(families: list[Metric], accept: str = "") -> str:
    encoder, _ = choose_encoder(accept)
    return encoder(_registry_of(families)).decode()


class _Families:
    """A collector over families read once for this scrape."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _registry_of(families: list[Metric]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return registry


def snapshot_families(snapshot: Snapshot) -> Iterator[Metric]:
    workers = snapshot["workers"]
    info = GaugeMetricFamily(
        f"{PREFIX}worker_info",
        "Always 1; labels say what the worker serves and where.",
        labels=("worker", "model", "device"),
    )
    for w in workers:
        info.add_metric((w["name"], w["model"], w["device"]), 1)
    yield info
    for name, key, help_text in WORKER_GAUGES:
        family = GaugeMetricFamily(f"{PREFIX}{name}", help_text, labels=("worker",))
        for w in workers:
            family.add_metric((w["name"],), float(w[key]))
        yield family
    for field, help_text in CACHE_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}cache_{field}", help_text, labels=("worker", "cache"))
        for w in workers:
            for cache in CACHES:
                family.add_metric((w["name"], cache), w["caches"][cache][field])
        yield family
    for field, help_text in KV_TOKEN_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}kv_{field}", help_text, labels=("worker",))
        for w in workers:
            family.add_metric((w["name"],), w["caches"]["kv"][field])
        yield family
    yield from encoder_families(snapshot.get("encoders") or {"workers": []})


def model_families(fleets: dict[str, ModelFleet]) -> Iterator[Metric]:
    """Per model: its live workers, and each live worker that announces its name with another
    fingerprint (a configuration error: it gets none of the model's requests)."""
    live = GaugeMetricFamily(
        f"{PREFIX}model_live_workers", "Live workers serving the model's fingerprint.", labels=("model",)
    )
    mismatched = GaugeMetricFamily(
        f"{PREFIX}model_fingerprint_mismatch",
        "1 for each live worker announcing the model's name with another fingerprint.",
        labels=("model", "worker"),
    )
    for model, fleet in sorted(fleets.items()):
        live.add_metric((model,), len(fleet.serving))
        for beat in fleet.mismatched:
            mismatched.add_metric((model, beat.name), 1)
    yield live
    yield mismatched


def encoder_families(section: dict) -> Iterator[Metric]:
    """E/PD: encoder load and queue, embedding cache, transfer bytes and time, fallbacks by cause."""
    entries = section["workers"]
    for name, key, help_text in ENCODER_GAUGES:
        family = GaugeMetricFamily(f"{PREFIX}{name}", help_text, labels=("worker",))
        for e in entries:
            # Another role's embedding cache is its own gauge (mmr_embedding_cache_entries).
            if key != "cached_entries" or e["role"] == "encode":
                family.add_metric((e["name"],), float(e[key]))
        yield family
    for name, field, scale, help_text in ENCODER_COUNTERS:
        family = CounterMetricFamily(f"{PREFIX}{name}", help_text, labels=("worker",))
        for e in entries:
            family.add_metric((e["name"],), e["counters"][field] * scale)
        yield family
    fallbacks = CounterMetricFamily(
        f"{PREFIX}epd_fallbacks",
        "Images an LLM worker encoded itself instead of receiving their features, by cause.",
        labels=("worker", "cause"),
    )
    for e in entries:
        for cause in FALLBACK_CAUSES:
            fallbacks.add_metric((e["name"], cause), e["counters"][f"fallback_{cause}"])
    yield fallbacks


def telemetry_families(totals: telemetry.Parsed, gauges: telemetry.Parsed) -> Iterator[Metric]:
    """Every declared metric, with no sample yet if nothing recorded it (so dashboards can name it)."""
    for name, metric in CATALOG.items():
        labels = list(metric.labels)
        full = f"{PREFIX}{name}"
        if metric.kind == "counter":
            family: Metric = CounterMetricFamily(full, metric.help, labels=labels)
            for values, value in sorted(totals.get(name, telemetry.Series(metric)).values.items()):
                family.add_metric(list(values), value)
        elif metric.kind == "gauge":
            family = GaugeMetricFamily(full, metric.help, labels=labels)
            for values, value in sorted(gauges.get(name, telemetry.Series(metric)).values.items()):
                family.add_metric(list(values), value)
        else:
            family = HistogramMetricFamily(full, metric.help, labels=labels)
            series = totals.get(name, telemetry.Series(metric))
            for values, (buckets, total, _count) in sorted(series.histograms.items()):
                cumulative, running = [], 0.0
                for bound, in_bucket in zip([*metric.buckets, float("inf")], buckets, strict=True):
                    running += in_bucket
                    cumulative.append((_bound(bound), running))
                family.add_metric(list(values), cumulative, total)
        yield family


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def frontend_source() -> str:
    """How this frontend process names itself among the processes that report gauges."""
    return f"web:{socket.gethostname()}:{os.getpid()}"
