"""Sending one chat request to a worker and following its answer.

The web process never imports the worker's code: it picks a worker, sends the Celery task by
name to that worker's queue, then reads the request's response stream in Redis, watching the
worker's heartbeat so a vanished worker becomes a deliberate 502/503 and a silent one a 504.

A worker that vanishes before the request's first token costs the client nothing: the request
migrates to another eligible worker (at most REQUEST_MIGRATION_LIMIT times), under a new task id
so the dead worker's stale copy, should its name come back, finds itself cancelled.

A worker that finds one of the request's pictures changed at its origin since the frontend read
its size (`image_changed`) costs the client nothing either: before the first token the request
is planned again once, with the picture's size read afresh, under the task id `<id>-r1`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import redis
from django.conf import settings

from inference_platform.celery import app as celery_app
from inference_platform.serving.errors import ApiError
from routing.contract.responses import (
    ResponseEvent,
    cancel_key,
    live_key,
    read_response_events,
    response_key,
)
from routing.contract.tasks import (
    CONTRACT_VERSION,
    DONE,
    ERROR,
    IMAGE_CHANGED,
    ROLE_ENCODE,
    STARTED,
    TOKEN,
    ErrorEvent,
    GenerateTask,
)
from routing.fleet.registry import Heartbeat, WorkerRegistry, heartbeat_key
from routing.fleet.worker_rows import GENERATION_KEY, WorkerRow, current_generation, kept_rows
from routing.kv.affinity import SessionAffinity
from routing.kv.index import KvIndex
from routing.kv.lease import RESERVED, RequestLease
from routing.kv.load import LoadTracker
from routing.kv.router import KvRouter, RoutingDecision, WorkerReport
from routing.media.store import MediaRef, MediaStore, media_store_from_settings
from routing.models import Worker, worker_queue
from routing.observe import telemetry
from routing.state.redis_keys import async_client, redact_text, sync_client

logger = logging.getLogger("inference_platform.dispatch")

# How often the frontend looks at the worker's heartbeat while it waits for the next event.
_POLL_MS = 1000


class Dispatch:
    """A request on its way to a worker: its lease (the router's one owner of its load), and
    what the API reports about it. Migration moves the lease (`RequestLease.reassign`)."""

    def __init__(
        self,
        lease: RequestLease,
        *,
        media: list[MediaRef] | None = None,
        migrate: Callable[[Dispatch], Awaitable[bool]] | None = None,
    ) -> None:
        self.lease = lease
        self.media: list[MediaRef] = list(media or [])  # the request's blobs in the side store
        # The id the worker answers under: the request id, then `<id>-m<n>` after each migration.
        self.task_id = lease.request_id
        self.migrations = 0
        self.tried: list[str] = [lease.worker]  # workers that had the request, in order
        # Sends the request to another eligible worker (serving.py builds it); False if none is left.
        self.migrate = migrate
        # Forgets the image sizes this request was routed with (a worker found one changed).
        self.forget_image_sizes: Callable[[], None] | None = None
        # Plans the request again from its chat, sizes read afresh (serving.py builds it; it
        # clears itself, so a picture that changes twice reaches the client as a 409); False if
        # no worker can take it now.
        self.replan: Callable[[Dispatch], Awaitable[bool]] | None = None

    @property
    def request_id(self) -> str:
        return self.lease.request_id

    @property
    def worker(self) -> str:
        return self.lease.worker

    @property
    def total_blocks(self) -> int:
        return self.lease.decision.total_blocks

    @property
    def overlap_blocks(self) -> int:
        return self.lease.decision.overlap


class WorkerLost(Exception):
    """The worker vanished before the request's first token: the request may go elsewhere."""

    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def registry() -> WorkerRegistry:
    return WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)


def media_store() -> MediaStore:
    return media_store_from_settings(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX, settings)


async def release_media(dispatch: Dispatch) -> None:
    """Free the request's blobs in the side store now rather than at their TTL."""
    if not dispatch.media:
        return
    try:
        await asyncio.to_thread(media_store().release, dispatch.request_id, dispatch.media)
    except redis.RedisError:
        logger.warning("could not release the media of request %s (they expire)", dispatch.request_id)


_routers: dict[tuple[str, str], KvRouter] = {}


def router() -> KvRouter:
    """This process's KV router over the shared index, load and affinity in Redis."""
    key = (settings.REDIS_URL, settings.REDIS_KEY_PREFIX)
    kv_router = _routers.get(key)
    if kv_router is None:
        client, namespace = sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX
        kv_router = KvRouter(
            client,
            namespace,
            index=KvIndex(client, namespace),
            load=LoadTracker(client, namespace, entry_ttl_s=settings.ROUTER_LOAD_ENTRY_TTL_SECS),
            affinity=SessionAffinity(client, namespace, ttl_s=settings.ROUTER_AFFINITY_TTL_SECS),
            approximate_ttl_s=settings.ROUTER_APPROXIMATE_TTL_SECS,
            predicted_ttl_s=settings.ROUTER_PREDICTED_TTL_SECS,
        )
        _routers[key] = kv_router
    return kv_router


# Workers whose heartbeat lapsed leave the index: what they cached is gone or soon will be
# (they start from `cleared` when they come back). Swept at most this often per process.
_SWEEP_INTERVAL_S = 2.0
_last_sweep = 0.0


def _purge_lapsed(rows: list[str], alive: dict[str, Heartbeat]) -> None:
    global _last_sweep
    now = time.monotonic()
    if now - _last_sweep < _SWEEP_INTERVAL_S:
        return
    _last_sweep = now
    index = router().index
    for name in rows:
        if name not in alive and index.purge_worker(name):
            logger.info("worker %s missed its heartbeat: its blocks left the index", name)


@dataclass(frozen=True)
class WorkerState:
    name: str
    heartbeat: Heartbeat | None
    ineligible_because: str | None  # None: eligible


def _eligibility(
    enabled: bool, draining: bool, beat: Heartbeat | None, model: str, block_size: int, encoders: bool = False
) -> str | None:
    if not enabled:
        return "disabled in the admin"
    if draining:
        return "draining"
    if beat is None:
        return "no heartbeat"
    if beat.stopping:
        return "shutting down"
    if beat.contract_version != CONTRACT_VERSION:
        return f"speaks task contract v{beat.contract_version}, not v{CONTRACT_VERSION}"
    if beat.model != model:
        return f"serves {beat.model}"
    if beat.block_size != block_size:
        return f"block size {beat.block_size}, not {block_size}"
    # E/PD: encode workers take image encoding (routing.fleet.encoders), never a whole request.
    if beat.role == ROLE_ENCODE and not encoders:
        return "encode worker"
    if beat.role != ROLE_ENCODE and encoders:
        return f"{beat.role} worker, not an encoder"
    return None


async def worker_states(model: str, block_size: int, *, encoders: bool = False) -> list[WorkerState]:
    """Every registered worker with whether it may take a request for this model (or, with
    `encoders`, its images' encoding), and if not why."""
    rows, alive = await _rows_and_heartbeats()
    return [
        WorkerState(
            row.name,
            alive.get(row.name),
            _eligibility(row.enabled, row.draining, alive.get(row.name), model, block_size, encoders),
        )
        for row in rows
    ]


async def _rows_and_heartbeats() -> tuple[tuple[WorkerRow, ...], dict[str, Heartbeat]]:
    """The operator's rows (kept under their generation, routing.fleet.worker_rows) and the live
    heartbeats of their workers: one Redis round trip, and no query, while the rows kept are
    current."""
    kept = kept_rows().get()
    if kept is not None:
        alive = await asyncio.to_thread(_heartbeats_if_current, *kept)
        if alive is not None:
            return kept[1], alive
    # Read before the database: a change committed after this read moves past it, so the rows
    # read below are never kept under a generation that already knew better.
    generation = await asyncio.to_thread(
        current_generation, sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX
    )
    rows = tuple([WorkerRow(*row) async for row in Worker.objects.values_list("name", "enabled", "draining")])
    kept_rows().put(generation, rows)
    alive = await asyncio.to_thread(_heartbeats, rows)
    return rows, alive


def _heartbeats_if_current(generation: bytes, rows: tuple[WorkerRow, ...]) -> dict[str, Heartbeat] | None:
    """The heartbeats of the rows' workers, or None when the rows' generation has moved."""
    names = [row.name for row in rows]
    now, alive = registry().alive_and_get(names, GENERATION_KEY)
    if now != generation:
        return None
    _purge_lapsed(names, alive)
    return alive


def _heartbeats(rows: tuple[WorkerRow, ...]) -> dict[str, Heartbeat]:
    names = [row.name for row in rows]
    alive = registry().alive(names)
    _purge_lapsed(names, alive)
    return alive


async def eligible_workers(model: str, block_size: int) -> dict[str, Heartbeat]:
    """Workers an operator allows (enabled, not draining) that are live and serve this model."""
    return {
        state.name: state.heartbeat
        for state in await worker_states(model, block_size)
        if state.ineligible_because is None and state.heartbeat is not None
    }


async def eligible_encoders(model: str, block_size: int) -> dict[str, Heartbeat]:
    """Encode workers an operator allows that are live and serve this model (E/PD)."""
    return {
        state.name: state.heartbeat
        for state in await worker_states(model, block_size, encoders=True)
        if state.ineligible_because is None and state.heartbeat is not None
    }


def _mark_followed(follow_id: str) -> None:
    sync_client(settings.REDIS_URL).set(
        live_key(settings.REDIS_KEY_PREFIX, follow_id),
        b"1",
        px=max(1, int(settings.REQUEST_LIVENESS_TTL_SECS * 1000)),
    )


async def send_to_worker(worker: str, task: GenerateTask) -> None:
    """Put the task on the worker's own queue; it expires if nobody starts it in time."""
    if task.follow_id:  # marked before the worker can look for the mark
        try:
            await asyncio.to_thread(_mark_followed, task.follow_id)
        except redis.RedisError as exc:
            raise state_unavailable(task.follow_id, exc) from exc
    try:
        await asyncio.to_thread(
            celery_app.send_task,
            task.name,
            args=[task.to_payload()],
            # What Celery's logs and events show of the task: the request, not the payload (its
            # prompt and token ids), which Celery would otherwise render at every send.
            argsrepr=repr([task.request_id]),
            kwargsrepr="{}",
            queue=worker_queue(worker),
            expires=settings.REQUEST_FIRST_TOKEN_TIMEOUT_SECS,
        )
    except Exception as exc:  # the broker refused or is unreachable
        logger.exception("could not queue request %s for worker %s", task.request_id, worker)
        raise ApiError(
            503,
            f"Could not queue request {task.request_id} for worker {worker}: broker unavailable.",
            code="broker_unavailable",
        ) from exc


async def request_cancel(request_id: str) -> None:
    client = async_client(settings.REDIS_URL)
    await client.set(cancel_key(settings.REDIS_KEY_PREFIX, request_id), b"1", ex=600)


async def follow(dispatch: Dispatch) -> AsyncIterator[ResponseEvent]:
    """The worker's events for this request until DONE or ERROR; ApiError if the worker fails us.

    A worker that vanishes (its heartbeat lapses, or a new process took its name) before it
    starts the request gives a 503 (nothing was done; the client may retry), after it started
    a 502; a worker that stays silent past the timeouts gives a 504. In each case the worker
    is asked to stop. Before the first token the request migrates instead, where it can, and a
    worker's `image_changed` makes it planned again (`Dispatch.replan`) rather than answered.
    The request's lease is released exactly once, however this ends.
    """
    lease = dispatch.lease
    rid = dispatch.request_id
    outcome = "abandoned"  # the client went away (the generator was closed) unless set below
    try:
        while True:
            worker = dispatch.worker
            replanned = False
            try:
                async for event in _follow(dispatch):
                    if event.type == TOKEN and lease.state == RESERVED:
                        # The first token ends prefill: the request's load moves to decode.
                        await asyncio.to_thread(lease.first_token)
                    if _image_changed(event) and lease.state == RESERVED and dispatch.replan is not None:
                        replanned = await _replan(dispatch)
                        if replanned:
                            break
                    if event.type in (DONE, ERROR):
                        outcome = event.type
                    yield event
                if not replanned:
                    return
                logger.info(
                    "request %s: a picture changed at its origin since its size was read;"
                    " planned again and sent to worker %s",
                    rid,
                    dispatch.worker,
                )
            except WorkerLost as lost:
                if dispatch.migrate is None or dispatch.migrations >= settings.REQUEST_MIGRATION_LIMIT:
                    raise lost.error from None
                if not await dispatch.migrate(dispatch):
                    raise lost.error from None
                logger.warning(
                    "request %s: worker %s went away before its first token; migrated to %s",
                    rid,
                    worker,
                    dispatch.worker,
                )
    except ApiError as error:
        outcome = error.code or "failed"
        raise
    except redis.RedisError as exc:
        outcome = "state_unavailable"
        raise state_unavailable(rid, exc) from exc
    finally:
        # If Redis is gone too, the reservation expires on its own.
        try:
            await asyncio.shield(asyncio.to_thread(lease.release, outcome))
        except redis.RedisError:
            logger.warning("could not free the load of request %s on worker %s", rid, lease.worker)
        await asyncio.shield(release_media(dispatch))
        await asyncio.shield(_forget_mark(rid))


async def _replan(dispatch: Dispatch) -> bool:
    """`dispatch.replan`, where its refusals (ApiError) and a lost Redis are the answer, and
    anything unforeseen leaves the worker's own `image_changed` to be answered."""
    try:
        return await dispatch.replan(dispatch)
    except (ApiError, redis.RedisError):
        raise
    except Exception:
        logger.exception("request %s: planning it again failed", dispatch.request_id)
        return False


def _image_changed(event: ResponseEvent) -> bool:
    if event.type != ERROR:
        return False
    error = event.event
    return isinstance(error, ErrorEvent) and error.code == IMAGE_CHANGED


def lease_ttl_s() -> float:
    """How long a request's reservation outlives the last sign of its frontend (two liveness TTLs):
    the frontend renews it with its liveness mark, so a frontend that dies anywhere between the
    decision and the answer leaves no load behind for longer (workers sweep with each beat)."""
    return settings.REQUEST_LIVENESS_TTL_SECS * 2


_SCHEDULES = {"shortest_first": True, "fcfs": False}


def _says_shortest_first(schedule_policy: object) -> bool | None:
    """A heartbeat's schedule_policy as the router's load bound reads it; None for anything else
    (nothing said, a policy this frontend does not know, a malformed value), which leaves the
    policy's assumption (RoutingPolicy.shortest_first_queues)."""
    return _SCHEDULES.get(schedule_policy) if isinstance(schedule_policy, str) else None


def worker_report(beat: Heartbeat) -> WorkerReport:
    """What the router's busy check, prefill drain and load bound use of a worker's heartbeat
    (see ARCHITECTURE, "Busy")."""
    # A worker that reports nothing (an older one) has zeros here: max() with the router's own
    # reservations then uses those alone.
    return WorkerReport(
        capacity_blocks=beat.kv_capacity_blocks,
        running_and_waiting=beat.running + beat.waiting,
        kv_used_blocks=beat.kv_blocks_used,
        prefill_tokens_per_s=beat.prefill_tokens_per_s,
        shortest_first=_says_shortest_first(beat.schedule_policy),
    )


def record_decision(decision: RoutingDecision) -> None:
    """The decision's routing-quality counters: /metrics, the dashboard and routing_stats read them."""
    labels = {"worker": decision.worker}
    telemetry.inc("routing_decisions", 1, {"worker": decision.worker, "reason": decision.reason})
    telemetry.inc("routing_best_overlap_blocks", decision.best_overlap, labels)
    telemetry.inc("routing_overlap_given_up_blocks", decision.overlap_given_up, labels)


async def _forget_mark(request_id: str) -> None:
    with contextlib.suppress(redis.RedisError):  # else it expires on its own
        await async_client(settings.REDIS_URL).delete(live_key(settings.REDIS_KEY_PREFIX, request_id))


_redis_failed_at = -1e9


def note_redis_failure() -> None:
    """Remember that Redis just failed this process (see `redis_recently_failed`)."""
    global _redis_failed_at
    _redis_failed_at = time.monotonic()


def redis_recently_failed() -> bool:
    """Whether Redis failed within the last timeout: bookkeeping that would wait on it again
    (a tenant's slot, usage) is then done in the background, so a request that met a frozen
    Redis waits one timeout, not one per remaining operation."""
    return time.monotonic() - _redis_failed_at < settings.REDIS_TIMEOUT_SECS


def state_unavailable(request_id: str, exc: Exception) -> ApiError:
    """A Redis failure mid-request: the platform's shared state is out of reach."""
    note_redis_failure()
    logger.error("request %s: Redis failed: %s", request_id, redact_text(str(exc)))
    return ApiError(
        503,
        f"The platform's shared state (Redis) is unavailable; request {request_id} was not completed.",
        code="state_unavailable",
    )


async def _follow(dispatch: Dispatch) -> AsyncIterator[ResponseEvent]:
    client = async_client(settings.REDIS_URL)
    namespace = settings.REDIS_KEY_PREFIX
    rid, worker = dispatch.task_id, dispatch.worker
    last_id = "0-0"
    started = False
    started_by = ""
    produced = False  # a token reached the client: from here the request cannot move
    # Refreshed a few times per TTL while this process follows the request (see LIVE_FAMILY).
    mark, mark_ttl_ms = (
        live_key(namespace, dispatch.request_id),
        int(settings.REQUEST_LIVENESS_TTL_SECS * 1000),
    )
    marked_at = 0.0
    timeout = settings.REQUEST_FIRST_TOKEN_TIMEOUT_SECS
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() - marked_at > settings.REQUEST_LIVENESS_TTL_SECS / 4:
            await client.set(mark, b"1", px=max(1, mark_ttl_ms))
            await asyncio.to_thread(dispatch.lease.renew, lease_ttl_s())
            marked_at = time.monotonic()
        events = await read_response_events(client, namespace, rid, last_id, _POLL_MS)
        for event in events:
            last_id = event.id
            if event.type == STARTED:
                started = True
                started_by = str(event.data.get("instance") or "")
            elif event.type == TOKEN:
                started = produced = True
                timeout = settings.REQUEST_TOKEN_TIMEOUT_SECS
                deadline = time.monotonic() + timeout
            if event.type in (DONE, ERROR):
                # Read to the end: the stream has served its purpose (its TTL covers a frontend
                # that dies before getting here).
                await client.delete(response_key(namespace, rid))
                yield event
                return
            yield event
        if events:
            continue
        if time.monotonic() > deadline:
            await request_cancel(rid)
            raise ApiError(
                504,
                f"Worker {worker} did not answer request {rid} within {timeout:g} s.",
                code="worker_timeout",
            )
        raw = await client.get(heartbeat_key(namespace, worker))
        beat = Heartbeat.from_json(raw) if raw is not None else None
        # A new process under the same name is not the one the request went to, unless that
        # new process is the one that started it (it took the task from the shared queue).
        replaced = (
            beat is not None
            and bool(dispatch.lease.instance)
            and beat.instance not in (dispatch.lease.instance, started_by)
        )
        if beat is None or replaced:
            await request_cancel(rid)
            shown = dispatch.request_id
            if replaced:
                logger.warning(
                    "request %s: worker %s was replaced by a new process (instance %s, not %s)",
                    shown,
                    worker,
                    beat.instance,
                    dispatch.lease.instance,
                )
            if produced:
                raise ApiError(
                    502, f"Worker {worker} stopped while answering request {shown}.", code="worker_vanished"
                )
            if started:
                raise WorkerLost(
                    ApiError(
                        502,
                        f"Worker {worker} stopped before answering request {shown}.",
                        code="worker_vanished",
                    )
                )
            raise WorkerLost(
                ApiError(
                    503,
                    f"Worker {worker} went away before starting request {shown}; retry it.",
                    code="worker_vanished",
                )
            )
