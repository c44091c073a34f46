"""`GET /health` (liveness: the process answers) and `GET /ready` (it can serve: Redis answers
and at least one live worker serves the model). Open to anyone: load balancers probe them, and
they reveal nothing a caller could use (counts, no names)."""

from __future__ import annotations

import asyncio

import redis
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from inference_platform.serving.dispatch import eligible_workers
from inference_platform.serving.prepare import served_model
from routing.prompt.model_view import ModelDirectoryError


@require_GET
def health(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "ok"})


@require_GET
async def ready(request: HttpRequest) -> HttpResponse:
    from django.conf import settings

    from routing.state.redis_keys import async_client

    checks: dict[str, object] = {}
    try:
        await asyncio.wait_for(async_client(settings.REDIS_URL).ping(), timeout=2.0)
        checks["redis"] = "ok"
    except (redis.RedisError, OSError, TimeoutError) as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
        return JsonResponse({"status": "unavailable", **checks, "live_workers": 0}, status=503)
    try:
        model = served_model()
        live = len(await eligible_workers(model.name, settings.KV_BLOCK_SIZE))
    except redis.RedisError as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
        return JsonResponse({"status": "unavailable", **checks, "live_workers": 0}, status=503)
    except ModelDirectoryError:
        return JsonResponse({"status": "unavailable", **checks, "reason": "model not loadable"}, status=503)
    checks["live_workers"] = live
    if live == 0:
        return JsonResponse({"status": "unavailable", **checks, "reason": "no live worker"}, status=503)
    return JsonResponse({"status": "ready", **checks})
