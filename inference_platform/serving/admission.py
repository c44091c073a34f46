"""The frontend's side of the admission queue (routing.admission): which priority a request runs
at, what a shed request answers, and this process's wake-ups of its waiting requests.

A waiting request polls its place (`AdmissionQueue.turn`) with a backoff; what happens in this
process that may let the first in line go (a request dispatched or finished here) wakes the
few requests nearest the front at once, so a freed worker is taken without waiting out a poll.
Another frontend's release reaches them by their next poll (at most `HEAD_POLL_MAX_S`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from django.conf import settings

from inference_platform.serving.errors import ApiError
from routing.admission.queue import MAX_PRIORITY, QueueFull, wait_estimate_s
from routing.observe import telemetry
from tenants.keys import Caller

# The request's priority as a header, for clients that cannot add a body field.
PRIORITY_HEADER = "x-priority"

# The first in line polls from HEAD_POLL_MIN_S, doubling to HEAD_POLL_MAX_S while no worker frees;
# those behind it poll less often the further back they are (at most BEHIND_POLL_MAX_S apart).
HEAD_POLL_MIN_S = 0.01
HEAD_POLL_MAX_S = 0.2
BEHIND_POLL_S = 0.02
BEHIND_POLL_MAX_S = 2.0
# The requests this near the front wake on this process's releases.
WOKEN_AHEAD = 2


def request_priority(asked: int | None, headers: Mapping[str, str], caller: Caller) -> int:
    """The priority a request runs at: what it asks for (its `priority` field, else the
    `x-priority` header), at most its tenant's maximum; else its tenant's default. Off
    (REQUEST_PRIORITIES): every request runs at the default, whatever it asks."""
    if asked is None:
        raw = next((value for name, value in headers.items() if name.lower() == PRIORITY_HEADER), None)
        if raw is not None:
            if not raw.strip().isdigit() or int(raw) > MAX_PRIORITY:
                raise ApiError(
                    400,
                    f"The {PRIORITY_HEADER} header must be an integer from 0 to {MAX_PRIORITY}.",
                    code="invalid_value",
                    param=PRIORITY_HEADER,
                )
            asked = int(raw)
    if asked is not None and asked > caller.max_priority:
        raise ApiError(
            400,
            f"Priority {asked} is above this tenant's maximum of {caller.max_priority}.",
            code="invalid_value",
            param="priority",
        )
    if not settings.REQUEST_PRIORITIES:
        return caller.default_priority
    return caller.default_priority if asked is None else asked


def poll_interval_s(ahead: int, head_poll_s: float) -> float:
    """How long a waiting request sleeps before it looks at its place again: at most a third of
    its frontend's liveness TTL, since the polls are what renew it."""
    if ahead <= 0:
        return head_poll_s
    return min(BEHIND_POLL_S * ahead, BEHIND_POLL_MAX_S, settings.ROUTER_QUEUE_FRONTEND_TTL_SECS / 3)


def shed(status: int, message: str, code: str, retry_after_s: int) -> ApiError:
    """A request turned away by the queue, counted by cause; `Retry-After` from the drain rate."""
    telemetry.inc("requests_shed", labels={"cause": code})
    return ApiError(status, message, code=code, headers={"Retry-After": str(retry_after_s)})


def queue_full(model: str, full: QueueFull) -> ApiError:
    """A 429 when the tenant's own queued requests are the bound, else a 503."""
    retry_after = wait_estimate_s(full.depth, full.drain_per_s, settings.ROUTER_BUSY_RETRY_AFTER_SECS)
    if full.cause == "tenant":
        return shed(
            429,
            f"Too many of this tenant's requests wait for '{model}' already "
            f"(ROUTER_QUEUE_MAX_TENANT_DEPTH {settings.ROUTER_QUEUE_MAX_TENANT_DEPTH}); "
            f"retry in {retry_after} s.",
            "tenant_queue_full",
            retry_after,
        )
    return shed(
        503,
        f"Every worker serving '{model}' is busy and {full.depth} requests wait already; "
        f"retry in {retry_after} s.",
        "queue_full",
        retry_after,
    )


def queue_timeout(model: str, request_id: str, waited_s: float, retry_after_s: int) -> ApiError:
    return shed(
        503,
        f"Request {request_id} waited {waited_s:.0f} s for a worker serving '{model}' "
        f"(ROUTER_QUEUE_MAX_WAIT_SECS); retry in {retry_after_s} s.",
        "queue_timeout",
        retry_after_s,
    )


class WaitingHere:
    """This process's waiting requests by model, tenant and priority, as the
    `admission_queue_depth` gauge (every frontend's gauges add up to the queue's depth)."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str, str], int] = {}

    def add(self, model: str, tenant: str, priority: int, n: int) -> None:
        key = (model, tenant, str(priority))
        count = self._counts[key] = self._counts.get(key, 0) + n
        telemetry.set_gauge(
            "admission_queue_depth", count, labels={"model": model, "tenant": tenant, "priority": key[2]}
        )


class Wakeups:
    """This process's signal, per model, that a worker may have freed (one per event loop)."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}

    async def wait(self, model: str, timeout_s: float) -> None:
        """Until the next `notify(model)`, or `timeout_s`."""
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(model, set())
        waiting.add(woken)
        try:
            await asyncio.wait_for(woken, timeout_s)
        except TimeoutError:
            pass
        finally:
            waiting.discard(woken)

    def notify(self, model: str) -> None:
        for woken in self._waiting.pop(model, ()):
            if not woken.done() and not woken.get_loop().is_closed():
                woken.set_result(None)


_wakeups = Wakeups()
_waiting_here = WaitingHere()


def wakeups() -> Wakeups:
    return _wakeups


def waiting_here() -> WaitingHere:
    return _waiting_here
