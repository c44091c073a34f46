"""`GET /health` (liveness: the process answers) and `GET /ready` (it can serve: Redis answers
and at least one live worker takes requests for one of the models; a live fleet that is all drained is
not ready). Open to anyone: load balancers probe them, and they reveal nothing a caller could
use (counts, no names)."""

from __future__ import annotations

import asyncio

import redis
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from inference_platform.fleet_status import RETRY_AFTER_S, fleet_availability
from inference_platform.serving.frontend import frontend
from inference_platform.serving.model_pool import deployment_model_name


@require_GET
def health(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "ok"})


@require_GET
async def ready(request: HttpRequest) -> HttpResponse:
    from django.conf import settings

    from routing.state.redis_keys import async_client

    checks: dict[str, object] = {}
    try:
        async with asyncio.timeout(2.0):  # not wait_for, which loses a cancellation on 3.11
            await async_client(settings.REDIS_URL).ping()
        checks["redis"] = "ok"
    except (redis.RedisError, OSError, TimeoutError) as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
        return JsonResponse({"status": "unavailable", **checks, "live_workers": 0}, status=503)
    try:
        names = await asyncio.to_thread(_model_names)
        fleets = [await fleet_availability(name, settings.KV_BLOCK_SIZE) for name in names]
    except redis.RedisError as exc:
        checks["redis"] = f"unavailable: {type(exc).__name__}"
        return JsonResponse({"status": "unavailable", **checks, "live_workers": 0}, status=503)
    # Live and accepting apart: a drained fleet is live, and still cannot serve.
    checks["live_workers"] = sum(fleet.live for fleet in fleets)
    checks["accepting_workers"] = sum(len(fleet.accepting) for fleet in fleets)
    if not checks["accepting_workers"]:
        reason = next((fleet.summary for fleet in fleets if fleet.held_back), "no live worker")
        response = JsonResponse({"status": "unavailable", **checks, "reason": reason}, status=503)
        response["Retry-After"] = str(RETRY_AFTER_S)
        return response
    return JsonResponse({"status": "ready", **checks})


def _model_names() -> list[str]:
    """Every model a request may name: the rows', and the deployment's own."""
    return sorted({*frontend().models().rows(), deployment_model_name()})
