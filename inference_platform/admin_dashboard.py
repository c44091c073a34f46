"""The operators' live dashboard in the admin: /admin/dashboard/ and the JSON it polls every 2 s.

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
from django.urls import path
from django.views.decorators.http import require_GET

from routing.cache_stats import CACHES
from routing.dashboard import DEFAULT_MINUTES, MAX_MINUTES, Snapshot, shared_reader
from routing.models import Worker
from routing.redis_keys import redact_text, redact_url, sync_client

POLL_INTERVAL_MS = 2000
CACHE_TITLES = {
    "kv": "KV prefix",
    "embedding": "Embeddings",
    "local_image": "Local images",
    "shared_image": "Shared images",
}


def deployment_snapshot(minutes: int) -> Snapshot:
    """The snapshot of this deployment: its Redis, its prefix, its worker rows."""
    reader = shared_reader(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    return reader.snapshot(Worker.objects.all(), minutes=minutes)


def _minutes(request: HttpRequest) -> int:
    try:
        minutes = int(request.GET.get("minutes", DEFAULT_MINUTES))
    except ValueError:
        return DEFAULT_MINUTES
    return min(max(minutes, 1), MAX_MINUTES)


def _read(minutes: int) -> tuple[Snapshot | None, str]:
    """The snapshot, or why there is none; never a password, even inside a driver's message."""
    try:
        return deployment_snapshot(minutes), ""
    except redis.RedisError as exc:
        return None, f"Redis unavailable: {type(exc).__name__}: {redact_text(str(exc))}"


def percent(rate: float | None) -> str:
    return "—" if rate is None else f"{rate * 100:.1f}%"


@require_GET
def dashboard_page(request: HttpRequest) -> HttpResponse:
    minutes = _minutes(request)
    snapshot, error = _read(minutes)
    context: dict[str, Any] = {
        **admin.site.each_context(request),
        "title": "Live dashboard",
        "redis_url": redact_url(settings.REDIS_URL),
        "key_prefix": settings.REDIS_KEY_PREFIX,
        "minutes": minutes,
        "poll_interval_ms": POLL_INTERVAL_MS,
        "error": error,
        "snapshot": snapshot,
        "cache_titles": CACHE_TITLES,
        # The first paint comes from the server, so the page reads right before any script runs.
        "caches": [
            {"key": cache, "title": title, "rate": percent(snapshot["caches"][cache]["hit_rate"])}
            for cache, title in CACHE_TITLES.items()
        ]
        if snapshot
        else [],
        "workers": [
            {**worker, "rates": [percent(worker["caches"][cache]["hit_rate"]) for cache in CACHES]}
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
