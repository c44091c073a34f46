"""The operators' live dashboard in the admin: /admin/dashboard/ and the JSON it polls.

Both are staff-only through `admin.site.admin_view`; `inference_platform.urls` mounts them
under admin/ ahead of the admin's own URLs.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import redis
from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import path, reverse
from django.views.decorators.http import require_GET

from routing.deployment import deployment_id, statistics_namespace
from routing.models import Worker
from routing.observe.cache_stats import CACHES
from routing.observe.dashboard import MAX_MINUTES, WINDOWS, Snapshot, shared_reader
from routing.state.redis_keys import redact_text, redact_url, sync_client


def poll_interval_ms(minutes: int) -> int:
    """Every DASHBOARD_POLL_INTERVAL_SECS (5 s) up to an hour; then every 30 s, and a minute past six
    hours (a day's chart, 1,440 points a read, moves a pixel a minute at most), or the setting's
    interval where it is longer."""
    every = max(1, round(settings.DASHBOARD_POLL_INTERVAL_SECS * 1000))
    return every if minutes <= 60 else max(every, 30_000 if minutes <= 360 else 60_000)


DASHBOARD_DEFAULT_MINUTES = 60
CACHE_TITLES = {
    "kv": "Prefix (KV)",
    "embedding": "Embeddings (of prefix misses)",
    "local_image": "Local images",
    "shared_image": "Shared images",
}


def deployment_snapshot(minutes: int) -> Snapshot:
    """The snapshot of this deployment: its Redis, its prefix, its worker rows."""
    reader = shared_reader(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX, statistics_namespace())
    return reader.snapshot(Worker.objects.all(), minutes=minutes)


def _minutes(request: HttpRequest) -> int:
    try:
        minutes = int(request.GET.get("minutes", DASHBOARD_DEFAULT_MINUTES))
    except ValueError:
        return DASHBOARD_DEFAULT_MINUTES
    return min(max(minutes, 1), MAX_MINUTES)


def _read(minutes: int, model: str = "") -> tuple[Snapshot | None, str]:
    """The snapshot (with `model`, its workers only), or why there is none; never a password,
    even inside a driver's message."""
    try:
        return of_model(deployment_snapshot(minutes), model), ""
    except redis.RedisError as exc:
        return None, f"Redis unavailable: {type(exc).__name__}: {redact_text(str(exc))}"


def of_model(snapshot: Snapshot, model: str) -> Snapshot:
    """The snapshot with only the workers of `model` (each carries its own series); every model's
    when `model` is empty. The window's request figures stay the deployment's."""
    models = sorted({w["model"] for w in snapshot["workers"] if w["model"]})
    if model:
        snapshot = {**snapshot, "workers": [w for w in snapshot["workers"] if w["model"] == model]}
    return {**snapshot, "models": models, "model": model}


def _model(request: HttpRequest) -> str:
    return request.GET.get("model", "").strip()[:200]


def percent(rate: float | None) -> str:
    return "—" if rate is None else f"{rate * 100:.1f}%"


def window_label(minutes: int) -> str:
    if minutes % 60 == 0:
        hours = minutes // 60
        return f"{hours} hour" if hours == 1 else f"{hours} hours"
    return f"{minutes} minutes" if minutes != 1 else "1 minute"


def short_window_label(minutes: int) -> str:
    return f"{minutes // 60} h" if minutes % 60 == 0 else f"{minutes} min"


def milliseconds(seconds: float | None) -> str:
    """Whole milliseconds, but one decimal under 10 ms (an inter-token gap on a GPU)."""
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.1f} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"


def rate(value: float) -> str:
    """As dashboard.js writes it: small rates keep two significant digits."""
    if value == 0:
        return "0"
    if value < 0.01:
        return f"{value:.2g}"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


EMBEDDING_NOTE = (
    "The embedding cache is consulted only for images the prefix KV cache did not cover, so its "
    "hit rate is of prefix misses: requests whose images all came from cached prefixes leave it "
    "at — (no lookup)."
)
# (key, label, tooltip): the big numbers, in the order shown; dashboard.js formats them the same way.
NUMBERS: tuple[tuple[str, str, str], ...] = (
    ("requests", "Requests", "Chat requests answered in the window, whatever their status."),
    ("server_errors", "Server errors (5xx)", "The platform's failures, and their share of the requests."),
    (
        "client_errors",
        "Client errors (4xx)",
        "The callers' mistakes (a bad request, a wrong key: 401, not JSON: 415; 499: the client left), "
        "and their share.",
    ),
    ("rate_limited", "Rate limited (429)", "Requests over a tenant's limit, and their share."),
    ("requests_per_s", "Requests/s", ""),
    ("tokens_per_s", "Tokens/s", "Prompt and completion tokens per second."),
    ("ttft_p50", "TTFT p50", "Time to first token."),
    ("ttft_p99", "TTFT p99", "Time to first token."),
    ("latency_p50", "E2E latency p50", "From the request's arrival to its last byte."),
    ("inter_token_p50", "Inter-token p50", "Time between consecutive generated tokens."),
    ("hit_kv", "Prefix hit rate (KV)", "Prompt tokens the workers' prefix KV caches already held."),
    ("hit_embedding", "Embedding hit rate (of prefix misses)", EMBEDDING_NOTE),
    ("hit_local_image", "Local image hit rate", ""),
    ("hit_shared_image", "Shared image hit rate", ""),
    ("overlap_given_up", "Overlap given up", ""),
    ("queue_wait_p90", "Admission wait p90", "How long requests waited in the admission queue for a worker."),
    ("shed", "Shed", "Requests the admission queue turned away (full, or waited too long)."),
)
# (key, title, unit, note): the charts; dashboard.js draws each from the snapshot.
CHARTS: tuple[tuple[str, str, str, str], ...] = (
    ("cache_hit_rates", "Cache hit rates, all workers", "%", "Embeddings: of the prefix cache's misses."),
    ("per_worker:kv", "Prefix hit rate (KV) per worker", "%", "Cached over prompt tokens."),
    ("per_worker:embedding", "Embedding hit rate per worker, of prefix misses", "%", EMBEDDING_NOTE),
    ("per_worker:local_image", "Local image hit rate per worker", "%", ""),
    ("per_worker:shared_image", "Shared image hit rate per worker", "%", ""),
    ("ttft", "Time to first token", "ms", ""),
    ("latency", "End-to-end latency", "ms", "From the request's arrival at the frontend to its last byte."),
    ("inter_token", "Inter-token latency", "ms", "Time between consecutive generated tokens of a request."),
    ("throughput", "Requests and tokens", "per second", "Requests/s on the right-hand axis."),
    (
        "queue",
        "Queue depth per worker",
        "requests waiting",
        "Requests each worker's engine accepted and has not started: the mean of its samples each minute.",
    ),
    (
        "admission",
        "Admission queue",
        "requests",
        "Requests waiting for a worker in the router's queue, on average (the time they waited each "
        "minute over the minute), and those it turned away each minute.",
    ),
    ("admission_wait", "Admission queue wait", "ms", "How long requests waited in the router's queue."),
    (
        "kv_usage",
        "KV cache use per worker",
        "%",
        "The KV pool's blocks held by running requests (cached, unreferenced blocks count as free, "
        "as in vLLM's KV cache usage): the mean of its samples each minute.",
    ),
    (
        "errors",
        "Responses other than 200",
        "requests per minute",
        "5xx: the platform failed; 4xx: the client's mistake (499: it went away); 429: over a "
        "tenant's limit. The data table has each status.",
    ),
    (
        "overlap",
        "Routing: overlap given up",
        "KV blocks per minute",
        "Per minute, the cached prefix blocks the best eligible worker held, and how many of them the "
        "chosen worker lacked (traded for load or affinity): the hit rate the router gave up.",
    ),
)


def big_numbers(snapshot: Snapshot) -> list[dict[str, str]]:
    window = snapshot["window"]
    totals = window["totals"]
    given_up = totals["overlap_given_up_blocks"]
    values = {
        "requests": str(totals["requests"]),
        "server_errors": count_and_share(totals["server_errors"], totals["server_error_share"]),
        "client_errors": count_and_share(totals["client_errors"], totals["client_error_share"]),
        "rate_limited": count_and_share(totals["rate_limited"], totals["rate_limited_share"]),
        "requests_per_s": rate(totals["requests_per_s"]),
        "tokens_per_s": rate(totals["tokens_per_s"]),
        "ttft_p50": milliseconds(totals["ttft"]["p50"]),
        "ttft_p99": milliseconds(totals["ttft"]["p99"]),
        "latency_p50": milliseconds(totals["latency"]["p50"]),
        "inter_token_p50": milliseconds(totals["inter_token"]["p50"]),
        **{f"hit_{cache}": percent(window["caches"][cache]["hit_rate"]) for cache in CACHES},
        "overlap_given_up": overlap_text(given_up, totals["overlap_given_up_share"]),
        "queue_wait_p90": milliseconds(totals["queue_wait"]["p90"]),
        "shed": str(totals["shed"]),
    }
    return [{"key": key, "label": label, "value": values[key], "note": note} for key, label, note in NUMBERS]


def count_and_share(count: int, share: float | None) -> str:
    return str(count) if not count or share is None else f"{count} ({percent(share)})"


def overlap_text(given_up: int | None, share: float | None) -> str:
    if given_up is None:
        return "—"
    return f"{given_up} blocks" + ("" if share is None else f" ({percent(share)})")


def scope_text(worker: dict[str, Any]) -> str:
    if worker["session_scoped"] is None:
        return "—"
    return "scoped" if worker["session_scoped"] else "not scoped"


@require_GET
def dashboard_page(request: HttpRequest) -> HttpResponse:
    minutes, model = _minutes(request), _model(request)
    snapshot, error = _read(minutes, model)
    model_query = f"&model={quote(model)}" if model else ""
    context: dict[str, Any] = {
        **admin.site.each_context(request),
        # The charts need the width more than a dashboard page needs the models' sidebar.
        "is_nav_sidebar_enabled": False,
        "title": "Live dashboard",
        "redis_url": redact_url(settings.REDIS_URL),
        "key_prefix": settings.REDIS_KEY_PREFIX,
        # Whose figures these are: another deployment on the same Redis and prefix has its own.
        "deployment_id": deployment_id() if snapshot else "",
        "minutes": minutes,
        "window_label": window_label(minutes),
        "windows": [{"minutes": m, "label": short_window_label(m)} for m in WINDOWS],
        "model": model,
        "model_query": model_query,
        "models": snapshot["models"] if snapshot else [],
        "poll_interval_ms": poll_interval_ms(minutes),
        "error": error,
        "snapshot": snapshot,
        "dashboard_config": {
            "dataUrl": f"{reverse('admin-dashboard-data')}?minutes={minutes}{model_query}",
            "pollMs": poll_interval_ms(minutes),
            "minutes": minutes,
            "cacheTitles": CACHE_TITLES,
            "numbers": NUMBERS,
        },
        "charts": [{"key": k, "title": t, "unit": u, "note": n} for k, t, u, n in CHARTS],
        # The first paint comes from the server, so the page reads right before any script runs.
        "numbers": big_numbers(snapshot) if snapshot else [],
        "configuration": snapshot["configuration"] if snapshot else {"problems": []},
        "workers": [
            {
                **worker,
                "rates": [percent(worker["window_caches"][cache]["hit_rate"]) for cache in CACHES],
                "kv_usage_text": percent(worker["kv_usage"]),
                "scope_text": scope_text(worker),
                "shared_text": worker["shared_image_cache"] or "—",
            }
            for worker in snapshot["workers"]
        ]
        if snapshot
        else [],
    }
    return render(request, "admin/dashboard.html", context, status=200)


@require_GET
def dashboard_data(request: HttpRequest) -> JsonResponse:
    snapshot, error = _read(_minutes(request), _model(request))
    if snapshot is None:
        return JsonResponse({"error": error}, status=503)
    return JsonResponse(snapshot)


urlpatterns = [
    path("dashboard/", admin.site.admin_view(dashboard_page), name="admin-dashboard"),
    path("dashboard.json", admin.site.admin_view(dashboard_data), name="admin-dashboard-data"),
]
