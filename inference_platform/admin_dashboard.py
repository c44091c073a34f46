"""The operators' live dashboard in the admin: /admin/dashboard/ and the JSON it polls.

Both are staff-only through `admin.site.admin_view`; `inference_platform.urls` mounts them
under admin/ ahead of the admin's own URLs.
"""

from __future__ import annotations

from typing import Any

import redis
from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import path, reverse
from django.views.decorators.http import require_GET

from routing.deployment import statistics_namespace
from routing.models import Worker
from routing.observe.cache_stats import CACHES
from routing.observe.dashboard import MAX_MINUTES, WINDOWS, Snapshot, shared_reader
from routing.state.redis_keys import redact_text, redact_url, sync_client

POLL_INTERVAL_MS = 5000


def poll_interval_ms(minutes: int) -> int:
    """Every 5 s up to an hour; a day's chart (1,440 points a read) moves a pixel a minute at most."""
    return POLL_INTERVAL_MS if minutes <= 60 else 30_000 if minutes <= 360 else 60_000


DASHBOARD_DEFAULT_MINUTES = 60
CACHE_TITLES = {
    "kv": "KV prefix",
    "embedding": "Embeddings",
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


def _read(minutes: int) -> tuple[Snapshot | None, str]:
    """The snapshot, or why there is none; never a password, even inside a driver's message."""
    try:
        return deployment_snapshot(minutes), ""
    except redis.RedisError as exc:
        return None, f"Redis unavailable: {type(exc).__name__}: {redact_text(str(exc))}"


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
    return "—" if seconds is None else f"{seconds * 1000:.0f} ms"


def rate(value: float) -> str:
    """As dashboard.js writes it: small rates keep two significant digits."""
    if value == 0:
        return "0"
    if value < 0.01:
        return f"{value:.2g}"
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


# (key, label): the big numbers, in the order shown; dashboard.js formats them the same way.
NUMBERS: tuple[tuple[str, str], ...] = (
    ("requests", "Requests"),
    ("errors", "Errors"),
    ("requests_per_s", "Requests/s"),
    ("tokens_per_s", "Tokens/s"),
    ("ttft_p50", "TTFT p50"),
    ("ttft_p99", "TTFT p99"),
    ("hit_kv", "KV prefix hit rate"),
    ("hit_embedding", "Embedding hit rate"),
    ("hit_local_image", "Local image hit rate"),
    ("hit_shared_image", "Shared image hit rate"),
    ("overlap_given_up", "Overlap given up"),
)
# (key, title, unit, note): the charts; dashboard.js draws each from the snapshot.
CHARTS: tuple[tuple[str, str, str, str], ...] = (
    ("cache_hit_rates", "Cache hit rates, all workers", "%", ""),
    ("per_worker:kv", "KV prefix hit rate per worker", "%", "Cached over prompt tokens."),
    ("per_worker:embedding", "Embedding hit rate per worker", "%", ""),
    ("per_worker:local_image", "Local image hit rate per worker", "%", ""),
    ("per_worker:shared_image", "Shared image hit rate per worker", "%", ""),
    ("ttft", "Time to first token", "ms", ""),
    ("throughput", "Requests and tokens", "per second", ""),
    ("errors", "Errors by status", "requests per minute", ""),
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
        "errors": str(totals["errors"]),
        "requests_per_s": rate(totals["requests_per_s"]),
        "tokens_per_s": rate(totals["tokens_per_s"]),
        "ttft_p50": milliseconds(totals["ttft"]["p50"]),
        "ttft_p99": milliseconds(totals["ttft"]["p99"]),
        **{f"hit_{cache}": percent(window["caches"][cache]["hit_rate"]) for cache in CACHES},
        "overlap_given_up": overlap_text(given_up, totals["overlap_given_up_share"]),
    }
    return [{"key": key, "label": label, "value": values[key]} for key, label in NUMBERS]


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
    minutes = _minutes(request)
    snapshot, error = _read(minutes)
    context: dict[str, Any] = {
        **admin.site.each_context(request),
        # The charts need the width more than a dashboard page needs the models' sidebar.
        "is_nav_sidebar_enabled": False,
        "title": "Live dashboard",
        "redis_url": redact_url(settings.REDIS_URL),
        "key_prefix": settings.REDIS_KEY_PREFIX,
        "minutes": minutes,
        "window_label": window_label(minutes),
        "windows": [{"minutes": m, "label": short_window_label(m)} for m in WINDOWS],
        "poll_interval_ms": poll_interval_ms(minutes),
        "error": error,
        "snapshot": snapshot,
        "dashboard_config": {
            "dataUrl": f"{reverse('admin-dashboard-data')}?minutes={minutes}",
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
    snapshot, error = _read(_minutes(request))
    if snapshot is None:
        return JsonResponse({"error": error}, status=503)
    return JsonResponse(snapshot)


urlpatterns = [
    path("dashboard/", admin.site.admin_view(dashboard_page), name="admin-dashboard"),
    path("dashboard.json", admin.site.admin_view(dashboard_data), name="admin-dashboard-data"),
]
