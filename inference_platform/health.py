"""`GET /health` (liveness: the process answers) and `GET /ready` (it can serve: Redis answers
and at least one live worker takes requests for the model; a live fleet that is all drained is
not ready). Open to anyone: load balancers probe them, and they reveal nothing a caller could
use (counts, no names)."""

from __future__ import annotations

import asyncio

import redis
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from inference_platform.fleet_status import RETRY_AFTER_S, fleet_availability
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
        fleet = await fleet_availability(model.name, settings.KV_BLOCK_SIZE)
    except redis.RedisError as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
        return JsonResponse({"status": "unavailable", **checks, "live_workers": 0}, status=503)
    except ModelDirectoryError:
        return JsonResponse({"status": "unavailable", **checks, "reason": "model not loadable"}, status=503)
    # Live and accepting apart: a drained fleet is live, and still cannot serve.
    checks["live_workers"] = fleet.live
    checks["accepting_workers"] = len(fleet.accepting)
    if not fleet.accepting:
        response = JsonResponse({"status": "unavailable", **checks, "reason": fleet.summary}, status=503)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
    return JsonResponse({"status": "ready", **checks})
