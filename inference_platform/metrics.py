"""GET /metrics: the dashboard's snapshot in Prometheus text exposition format (version 0.0.4)."""

from __future__ import annotations

from collections.abc import Iterator

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from routing.cache_stats import CACHES
from routing.dashboard import Snapshot, shared_reader
from routing.models import Worker
from routing.redis_keys import redact_text, sync_client

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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
KV_TOKEN_COUNTERS: tuple[tuple[str, str], ...] = (
    ("cached_tokens", "Prompt tokens served from the worker's prefix KV cache."),
    ("prompt_tokens", "Prompt tokens the worker processed, cached or not."),
)


@csrf_exempt  # a scraper's POST is a 405, not the CSRF failure page
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    try:
        snapshot = shared_reader(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX).snapshot(
            Worker.objects.all(), minutes=0
        )
    except redis.RedisError as exc:
        # A scrape that fails shows as `up == 0` in Prometheus, which is what an operator wants.
        return HttpResponse(
            f"redis unavailable: {redact_text(str(exc))}\n", status=503, content_type=CONTENT_TYPE
        )
    return HttpResponse(render_metrics(snapshot), content_type=CONTENT_TYPE)


def render_metrics(snapshot: Snapshot) -> str:
    return "".join(f"{line}\n" for line in _lines(snapshot))


def _lines(snapshot: Snapshot) -> Iterator[str]:
    workers = snapshot["workers"]
    yield from _family(
        "worker_info",
        "gauge",
        "Always 1; labels say what the worker serves and where.",
        (({"worker": w["name"], "model": w["model"], "device": w["device"]}, 1) for w in workers),
    )
    for name, key, help_text in WORKER_GAUGES:
        yield from _family(name, "gauge", help_text, (({"worker": w["name"]}, w[key]) for w in workers))
    for field, help_text in CACHE_COUNTERS:
        yield from _family(
            f"cache_{field}_total",
            "counter",
            help_text,
            (
                ({"worker": w["name"], "cache": cache}, w["caches"][cache][field])
                for w in workers
                for cache in CACHES
            ),
        )
    for field, help_text in KV_TOKEN_COUNTERS:
        yield from _family(
            f"kv_{field}_total",
            "counter",
            help_text,
            (({"worker": w["name"]}, w["caches"]["kv"][field]) for w in workers),
        )


def _family(
    name: str, kind: str, help_text: str, samples: Iterator[tuple[dict[str, str], float]]
) -> Iterator[str]:
    yield f"# HELP {PREFIX}{name} {_escape_help(help_text)}"
    yield f"# TYPE {PREFIX}{name} {kind}"
    for labels, value in samples:
        rendered = ",".join(f'{key}="{_escape_label(str(text))}"' for key, text in labels.items())
        yield f"{PREFIX}{name}{{{rendered}}} {_number(value)}"


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    # Booleans and counts print as integers, which Prometheus parses like any float.
    return str(int(value)) if isinstance(value, bool | int) else repr(float(value))
