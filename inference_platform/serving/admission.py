"""The frontend's side of the admission queue (routing.admission): which priority a request runs
at, what a shed request answers, and this process's watch over the front of the queue.

One loop per model in each frontend process (`Turns`) looks at who is first in line, for all the
requests the process has waiting, in one Redis call (which also renews the process's liveness
mark and sweeps dead frontends' entries); when the first is one of its own, it wakes that request,
which decides and sends. It looks again at once when something in this process may have freed a
worker (a request dispatched or finished here), else with a backoff from HEAD_POLL_MIN_S to
HEAD_POLL_MAX_S; another frontend's release reaches it by that poll. So the queue costs Redis a
few calls per frontend per second, however many requests wait.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping

import redis
from django.conf import settings

from inference_platform.serving.errors import ApiError
from routing.admission.queue import MAX_PRIORITY, AdmissionQueue, QueueFull, wait_estimate_s
from routing.observe import telemetry
from tenants.keys import Caller

# The request's priority as a header, for clients that cannot add a body field.
PRIORITY_HEADER = "x-priority"

# The watch polls from HEAD_POLL_MIN_S, doubling to HEAD_POLL_MAX_S while the first in line stays.
HEAD_POLL_MIN_S = 0.01
HEAD_POLL_MAX_S = 0.2


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


def shed(status: int, message: str, code: str, retry_after_s: int) -> ApiError:
    """A request turned away by the queue, counted by cause; `Retry-After` from the drain rate."""
    telemetry.inc("requests_shed", labels={"cause": code})
    return ApiError(status, message, code=code, headers={"Retry-After": str(retry_after_s)})


def queue_full(model: str, full: QueueFull) -> ApiError:
    """A 429 when the tenant's own queued requests (at the request's priority) are the bound, else
    a 503."""
    retry_after = wait_estimate_s(full.depth, full.drain_per_s, settings.ROUTER_BUSY_RETRY_AFTER_SECS)
    if full.cause == "tenant":
        return shed(
            429,
            f"Too many of this tenant's requests at this priority wait for '{model}' already "
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


class Turns:
    """This process's requests waiting in the admission queue, by model and member, and the one
    watch per model that wakes the request first in line (see the module)."""

    def __init__(self) -> None:
        self._waiting: dict[str, dict[str, asyncio.Future[None]]] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._nudges: dict[str, asyncio.Event] = {}

    async def wait(self, queue: AdmissionQueue, model: str, member: str, timeout_s: float) -> bool:
        """Until `member` is first in line (True), or `timeout_s` (False)."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        waiting = self._waiting.setdefault(model, {})
        waiting[member] = turn
        watch = self._watches.get(model)
        if watch is None or watch.done() or watch.get_loop() is not loop:
            self._nudges[model] = asyncio.Event()
            self._watches[model] = loop.create_task(self._watch(queue, model))
        try:
            # asyncio.wait, not wait_for: on Python 3.11 wait_for loses a cancellation that comes
            # as the turn is set (the client's disconnect: the request would wait on unheard).
            done, _ = await asyncio.wait({turn}, timeout=timeout_s)
            return bool(done)
        finally:
            if waiting.get(member) is turn:
                del waiting[member]

    def notify(self, model: str) -> None:
        """Something here may have freed a worker of `model`: the watch looks again now."""
        nudge = self._nudges.get(model)
        if nudge is not None:
            nudge.set()

    async def _watch(self, queue: AdmissionQueue, model: str) -> None:
        poll_s, last_first = HEAD_POLL_MIN_S, None
        nudge = self._nudges[model]
        while self._waiting.get(model):
            try:
                front = await asyncio.to_thread(queue.front, model, 1)
            except redis.RedisError:
                front = []  # the waiting requests time out if Redis stays away
            first = front[0] if front else None
            turn = self._waiting.get(model, {}).get(first) if first is not None else None
            if turn is not None and not turn.done():
                turn.set_result(None)
            poll_s = HEAD_POLL_MIN_S if first != last_first else min(poll_s * 2, HEAD_POLL_MAX_S)
            last_first = first
            nudge.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(poll_s):  # not wait_for: see `wait`
                    await nudge.wait()


_turns = Turns()
_waiting_here = WaitingHere()


def turns() -> Turns:
    return _turns


def waiting_here() -> WaitingHere:
    return _waiting_here
