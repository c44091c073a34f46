"""The fleet as a request's sender sees it: which workers are eligible, the Celery send by task
name, and following one task's response stream.

The web process never imports the worker's code: it sends the Celery task by name to the chosen
worker's queue, then reads the task's response stream in Redis (`follow_task`), watching the
worker's heartbeat so a vanished worker becomes `WorkerLost` and a silent one a 504. What to do
about either (migrate, replan, answer) is the request's owner's call: `served.ServedRequest`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

import redis
from channels.db import database_sync_to_async
from django.conf import settings

from inference_platform.serving.broker import publish_task, push_with_state
from inference_platform.serving.errors import ApiError
from inference_platform.serving.frontend import frontend
from routing.contract.responses import (
    ResponseEvent,
    live_key,
    parse_response_read,
    read_response_events,
    response_key,
    response_read,
)
from routing.contract.tasks import (
    CONTRACT_VERSION,
    DONE,
    ENGINE_DEAD,
    ERROR,
    ROLE_ENCODE,
    STARTED,
    TOKEN,
    GenerateTask,
)
from routing.fleet.registry import Heartbeat, heartbeat_key
from routing.fleet.worker_rows import GENERATION_KEY, WorkerRow, current_generation, kept_rows
from routing.kv.decision import RoutingDecision, WorkerReport
from routing.kv.lease import RequestLease
from routing.models import Worker, worker_queue
from routing.observe import telemetry
from routing.state.pacing import paced, pause_point
from routing.state.redis_direct import Command
from routing.state.redis_keys import redact_text, sync_client

logger = logging.getLogger("inference_platform.dispatch")

T = TypeVar("T")

# How often the frontend looks at the worker's heartbeat while it waits for the next event.
_POLL_MS = 1000


def _vanished(worker: str, request_id: str, started: bool, produced: bool) -> ApiError:
    """What a request whose worker vanished is answered, should it go nowhere else."""
    if produced:
        message = f"Worker {worker} stopped while answering request {request_id}."
        return ApiError(502, message, code="worker_vanished")
    if started:
        message = f"Worker {worker} stopped before answering request {request_id}."
        return ApiError(502, message, code="worker_vanished")
    message = f"Worker {worker} went away before starting request {request_id}; retry it."
    return ApiError(503, message, code="worker_vanished")


class WorkerLost(Exception):
    """The worker vanished while it had the request: the request may go elsewhere
    (`after_tokens`: some of its tokens were read from this worker already)."""

    def __init__(self, error: ApiError, *, after_tokens: bool = False) -> None:
        super().__init__(error.message)
        self.error = error
        self.after_tokens = after_tokens


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
    index = frontend().router().index
    for name in rows:
        if name not in alive and index.purge_worker(name):
            logger.info("worker %s missed its heartbeat: its blocks left the index", name)


@dataclass(frozen=True)
class WorkerState:
    name: str
    heartbeat: Heartbeat | None
    ineligible_because: str | None  # None: eligible


def _eligibility(
    enabled: bool,
    draining: bool,
    beat: Heartbeat | None,
    model: str,
    block_size: int,
    encoders: bool = False,
    fingerprint: str = "",
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
    # Another tokenizer or template under the model's name: its prompts and block hashes are not
    # the frontend's (a worker from before fingerprints announces none, and is not held to one).
    if fingerprint and beat.fingerprint and beat.fingerprint != fingerprint:
        return f"announces {model} with fingerprint {beat.fingerprint}, not the model's {fingerprint}"
    if beat.block_size != block_size:
        return f"block size {beat.block_size}, not {block_size}"
    # E/PD: encode workers take image encoding (routing.fleet.encoders), never a whole request.
    if beat.role == ROLE_ENCODE and not encoders:
        return "encode worker"
    if beat.role != ROLE_ENCODE and encoders:
        return f"{beat.role} worker, not an encoder"
    return None


class EligibleWorkers(dict[str, Heartbeat]):
    """The workers that may take a request, by name, from one read of the fleet, with what a
    decision tells the router about them: worked out once per read (`FleetRead`), not once per
    request, which at a thousand workers cost more than the decision itself.

    `rows_generation`: (the generation key, its value) the read was made under; a reserving
    decision over these workers is conditional on it (`KvRouter.decide`'s `only_if`), so a
    decision never uses a read the operator's rows have moved past, whether or not the read was
    checked before it (`eligible_workers`' `checked`)."""

    rows_generation: tuple[str, bytes] | None = None
    # The same question's answer from the read before (`_eligible`, while a read is prepared
    # like it), whose reports this one's reuse for the workers whose beat is the same object;
    # dropped once the reports are made, or the read is prepared.
    earlier: EligibleWorkers | None = None

    def without(self, names: Collection[str]) -> EligibleWorkers:
        """These workers but `names` (those a request already tried), under the same generation."""
        kept = EligibleWorkers((name, beat) for name, beat in self.items() if name not in names)
        kept.rows_generation = self.rows_generation
        return kept

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self))

    @functools.cached_property
    def reports(self) -> Mapping[str, WorkerReport]:
        # Read-only: the router packs it once per read (routing.kv.router, `_packed`).
        earlier, self.earlier = self.earlier, None
        before = earlier.__dict__.get("reports") if earlier is not None else None
        if before is None:
            return MappingProxyType({name: worker_report(beat) for name, beat in self.items()})
        # Between two reads most beats are the same bytes, parsed once (the registry keeps their
        # parse): the report made of the same beat is the same.
        get = earlier.get
        return MappingProxyType(
            {name: before[name] if get(name) is beat else worker_report(beat) for name, beat in self.items()}
        )

    @functools.cached_property
    def approximate(self) -> frozenset[str]:
        """Workers that publish no KV events (the router credits what it sends them)."""
        return frozenset(name for name, beat in self.items() if not beat.publishes_events)

    @functools.cached_property
    def instances(self) -> dict[str, str]:
        return {name: beat.instance for name, beat in self.items()}

    def prepare(self) -> None:
        """Works out now what a decision reads, and has the router pack it (a fleet read being
        made in the background calls this, not a request)."""
        policy = frontend().policy().routing
        self.reports  # noqa: B018 (each worked out now, between pause points: routing.state.pacing)
        pause_point()
        frontend().router().pack_workers(self.names, self.reports, self.approximate, policy)
        pause_point()
        self.instances  # noqa: B018


@dataclass(eq=False)
class FleetRead:
    """One read of the fleet by this frontend: the operator's rows (under their generation) and
    the live heartbeats, and what was worked out from them, by question.

    A frontend reads a model's pool again when the rows' generation moves (checked by the
    decision itself, or with a GET for a read no decision follows: a drain or a disable still
    reaches the next request) or when the read is older
    than FLEET_VIEW_MAX_AGE_SECS; in between, a request's eligibility is a lookup, whatever the
    number of workers. A heartbeat that lapsed since the read may be chosen meanwhile: the
    request then finds the worker gone (`follow_task`) and moves on, as when it dies mid-request.
    One read per model: no other model's worker keys are read for a request.
    """

    generation: bytes
    every_row: tuple[WorkerRow, ...]  # every model's, as kept (`kept_rows`): the same object while current
    rows: tuple[WorkerRow, ...]  # the model's
    alive: dict[str, Heartbeat]
    read_at: float
    _derived: dict[Hashable, Any] = field(default_factory=dict)
    _builders: dict[Hashable, Callable[[FleetRead], Any]] = field(default_factory=dict)
    _like: FleetRead | None = None  # the read `prepare_like` works from, while it does

    def earlier(self, key: Hashable) -> Any:
        """What the read this one is being prepared like worked out for `key`, if it read the same
        rows (the same kept objects: the same workers in the same order); else None. Per worker,
        what is made of the same row and the same beat is the same, and between two reads most
        beats are the same objects (the registry parses a beat's bytes once)."""
        like = self._like
        if like is None or like.every_row is not self.every_row:
            return None
        return like._derived.get(key)

    def derived(self, key: Hashable, build: Callable[[FleetRead], T]) -> T:
        found = self._derived.get(key)
        if found is None:
            found = self._derived[key] = build(self)
            self._builders[key] = build
        return found

    def prepare_like(self, previous: FleetRead) -> None:
        """Works out what the previous read was asked, from this one (in the background, so the
        request that next asks finds it done): eligibility, reports and packed arguments, each
        worker's reused from `previous` where its row and beat are the same."""
        self._like = previous
        try:
            for key, build in list(previous._builders.items()):
                pause_point()
                found = self.derived(key, build)
                if isinstance(key, tuple) and key[0] == "eligible":  # the router packs one fleet at a time
                    found.prepare()
        finally:
            self._like = None
            for found in self._derived.values():  # no read holds on to the one before it
                if isinstance(found, EligibleWorkers):
                    found.earlier = None


_last_reads: dict[str, FleetRead] = {}  # by model


async def worker_states(
    model: str, block_size: int, *, encoders: bool = False, fingerprint: str = ""
) -> list[WorkerState]:
    """The model's registered workers with whether each may take a request for it (or, with
    `encoders`, its images' encoding), and if not why. With `fingerprint`, the model's: a worker
    announcing another is not eligible."""
    read = await _fleet_read(model)
    return read.derived(
        ("states", block_size, encoders, fingerprint),
        lambda r: _states(r, model, block_size, encoders, fingerprint),
    )


def _states(
    read: FleetRead, model: str, block_size: int, encoders: bool, fingerprint: str
) -> list[WorkerState]:
    alive = read.alive

    def state(row: WorkerRow) -> WorkerState:
        pause_point()
        beat = alive.get(row.name)
        because = _eligibility(row.enabled, row.draining, beat, model, block_size, encoders, fingerprint)
        return WorkerState(row.name, beat, because)

    before = read.earlier(("states", block_size, encoders, fingerprint))
    if before is None:
        return [state(row) for row in read.rows]
    # The same rows in the same order: a state whose beat is still the same object stands.
    return [
        kept if kept.heartbeat is alive.get(row.name) else state(row)
        for row, kept in zip(read.rows, before, strict=True)
    ]


async def _fleet_read(model: str, *, checked: bool = True) -> FleetRead:
    """This frontend's read of the model's pool, read again if the rows moved or it is too old.

    `checked=False` leaves out the rows' generation check (a GET, and a thread to make it in)
    for a caller that decides with the read: the decision checks the generation itself, in the
    same atomic step (EligibleWorkers.rows_generation), and the caller reads again when it moved.

    A read past its age but not twice its age still serves while a fresh one is made in the
    background: under load every request finds a read at hand and none pays for reading a
    thousand heartbeats; when requests are rare a read that old is not trusted, and the request
    that finds it waits for a fresh one."""
    read, kept = _last_reads.get(model), kept_rows().get()
    max_age = settings.FLEET_VIEW_MAX_AGE_SECS
    if read is not None and kept is not None and kept[1] is read.every_row:
        age = time.monotonic() - read.read_at
        if age < 2 * max_age:
            if checked:
                generation = await asyncio.to_thread(
                    current_generation, sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX
                )
            else:
                generation = read.generation
            if generation == read.generation:
                if age >= max_age:
                    _read_again_in_background(model)
                return read
    return await _read_again(model)


def forget_fleet_read() -> None:
    """The next request reads the fleet again (tests)."""
    _last_reads.clear()


async def _read_again(model: str) -> FleetRead:
    previous = _last_reads.get(model)
    generation, every, rows, alive = await _rows_and_heartbeats(model)
    read = FleetRead(generation, every, rows, alive, time.monotonic())
    if previous is not None:
        # Off the event loop: a thousand workers' eligibility and packing take milliseconds;
        # paced, so that the loop's decisions need not wait for all of it (routing.state.pacing).
        await asyncio.to_thread(paced, read.prepare_like, previous)
    _last_reads[model] = read
    return read


_readings: dict[str, asyncio.Task] = {}  # by model


def _read_again_in_background(model: str) -> None:
    loop = asyncio.get_running_loop()
    reading = _readings.get(model)
    if reading is None or reading.done() or reading.get_loop() is not loop:
        _readings[model] = loop.create_task(_read_again(model))


async def _rows_and_heartbeats(
    model: str,
) -> tuple[bytes, tuple[WorkerRow, ...], tuple[WorkerRow, ...], dict[str, Heartbeat]]:
    """The rows' generation, every operator's row (kept under their generation,
    routing.fleet.worker_rows), the model's, and the live heartbeats of the model's workers: one
    Redis round trip, and no query, while the rows kept are current; no other model's worker
    keys are read."""
    kept = kept_rows().get()
    if kept is not None:
        generation, rows = kept[0], _of_model(kept[1], model)
        alive = await asyncio.to_thread(paced, _heartbeats_if_current, generation, rows)
        if alive is not None:
            return generation, kept[1], rows, alive
    # Read before the database: a change committed after this read moves past it, so the rows
    # read below are never kept under a generation that already knew better.
    generation = await asyncio.to_thread(
        current_generation, sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX
    )
    # In Django's thread, its connections tidied around the query (the API sends no request
    # signal to do it: inference_platform.api.handler).
    every = await database_sync_to_async(_every_row)()
    kept_rows().put(generation, every)
    rows = _of_model(every, model)
    alive = await asyncio.to_thread(paced, _heartbeats, rows)
    return generation, every, rows, alive


def _every_row() -> tuple[WorkerRow, ...]:
    fields = ("name", "enabled", "draining", "model_name")
    return tuple(WorkerRow(*row) for row in Worker.objects.values_list(*fields))


def _of_model(rows: tuple[WorkerRow, ...], model: str) -> tuple[WorkerRow, ...]:
    return tuple(row for row in rows if row.may_serve(model))


def _heartbeats_if_current(generation: bytes, rows: tuple[WorkerRow, ...]) -> dict[str, Heartbeat] | None:
    """The heartbeats of the rows' workers, or None when the rows' generation has moved."""
    names = [row.name for row in rows]
    now, alive = frontend().registry().alive_and_get(names, GENERATION_KEY)
    if now != generation:
        return None
    _purge_lapsed(names, alive)
    return alive


def _heartbeats(rows: tuple[WorkerRow, ...]) -> dict[str, Heartbeat]:
    names = [row.name for row in rows]
    alive = frontend().registry().alive(names)
    _purge_lapsed(names, alive)
    return alive


async def eligible_workers(
    model: str, block_size: int, fingerprint: str = "", *, checked: bool = True
) -> EligibleWorkers:
    """Workers an operator allows (enabled, not draining) that are live and serve this model
    (with `fingerprint`: announce the model's own routing files).

    `checked=False`: for a decision over them, which checks the rows' generation itself (see
    `_fleet_read`); a read that finds none is checked all the same, since no decision follows it.
    """
    read = await _fleet_read(model, checked=checked)
    found = read.derived(
        _eligible_key(block_size, False, fingerprint),
        lambda r: _eligible(r, model, block_size, False, fingerprint),
    )
    if not found and not checked:
        return await eligible_workers(model, block_size, fingerprint)
    return found


async def eligible_encoders(model: str, block_size: int) -> EligibleWorkers:
    """Encode workers an operator allows that are live and serve this model (E/PD)."""
    read = await _fleet_read(model)
    key = _eligible_key(block_size, True, "")
    return read.derived(key, lambda r: _eligible(r, model, block_size, True, ""))


def _eligible_key(block_size: int, encoders: bool, fingerprint: str) -> tuple:
    """What a fleet read keeps `_eligible`'s answer under (FleetRead.derived)."""
    return ("encoders", block_size) if encoders else ("eligible", block_size, fingerprint)


def _eligible(
    read: FleetRead, model: str, block_size: int, encoders: bool, fingerprint: str
) -> EligibleWorkers:
    states = read.derived(
        ("states", block_size, encoders, fingerprint),
        lambda r: _states(r, model, block_size, encoders, fingerprint),
    )
    eligible = EligibleWorkers(
        (state.name, state.heartbeat)
        for state in states
        if state.ineligible_because is None and state.heartbeat is not None
    )
    eligible.rows_generation = (f"{settings.REDIS_KEY_PREFIX}{GENERATION_KEY}", read.generation)
    eligible.earlier = read.earlier(_eligible_key(block_size, encoders, fingerprint))
    return eligible


def _mark_command(follow_id: str) -> Command:
    """The command that sets the request's liveness mark, which the worker looks for, for one
    liveness TTL (set with the send, then renewed by `follow_task` a few times per TTL: see
    LIVE_FAMILY)."""
    ttl_ms = max(1, int(settings.REQUEST_LIVENESS_TTL_SECS * 1000))
    return ("SET", live_key(settings.REDIS_KEY_PREFIX, follow_id), b"1", "PX", ttl_ms)


async def _mark_followed(follow_id: str) -> None:
    await frontend().redis_lines().execute(*_mark_command(follow_id))


async def send_to_worker(worker: str, task: GenerateTask) -> float:
    """Put the task on the worker's own queue; it expires if nobody starts it in time. Returns
    when the request's liveness mark was set (`time.monotonic()`; 0.0 for a task with none), for
    `follow_task` to renew it from then on."""
    marked_at = 0.0
    message: dict[str, Any] = {
        "name": task.name,
        "args": [task.to_payload()],
        "queue": worker_queue(worker),
        "expires_s": settings.REQUEST_FIRST_TOKEN_TIMEOUT_SECS,
        # What Celery's logs and events show of the task: the request, not the payload (its
        # prompt and token ids), which Celery would otherwise render at every send.
        "argsrepr": repr([task.request_id]),
    }
    if task.follow_id:  # marked before the worker can look for the mark
        mark = _mark_command(task.follow_id)
        push = push_with_state(**message)
        try:
            if push is not None:
                # The broker is the platform's Redis: the mark and the push in one round trip (a
                # connection's commands run in order: the mark is set when the task is there).
                # (A round trip's send alone costs the frontend ~0.1 ms of CPU here.)
                await frontend().redis_lines().execute_many(mark, push)
                return time.monotonic()
            await frontend().redis_lines().execute(*mark)
        except redis.RedisError as exc:
            raise state_unavailable(task.follow_id, exc) from exc
        marked_at = time.monotonic()
    try:
        await publish_task(**message)
    except Exception as exc:  # the broker refused or is unreachable
        logger.exception("could not queue request %s for worker %s", task.request_id, worker)
        raise ApiError(
            503,
            f"Could not queue request {task.request_id} for worker {worker}: broker unavailable.",
            code="broker_unavailable",
        ) from exc
    return marked_at


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


async def follow_task(
    lease: RequestLease, task_id: str, marked_at: float = 0.0
) -> AsyncIterator[ResponseEvent]:
    """One task's events on its response stream until DONE or ERROR, keeping the request's
    liveness mark and lease reservation fresh while it waits: every quarter of the liveness TTL
    from `marked_at` (send_to_worker's answer: the send set the mark, and the decision just
    before it reserved for two TTLs, so a prompt follow renews neither again at once; 0.0 renews
    both at the start).

    A worker that vanishes (its heartbeat lapses, or a new process took its name) raises
    `WorkerLost`, saying whether a token of this task was read already; a worker that stays
    silent past the timeouts raises a 504 ApiError. The first token ends the lease's prefill here
    (its load moves to decode with the next read of the stream: the token waits for no round trip
    of its own). Nothing is released or cancelled here: the request's owner (`ServedRequest`)
    decides whether the request moves on or ends.
    """
    namespace = settings.REDIS_KEY_PREFIX
    rid, worker = task_id, lease.worker
    last_id = "0-0"
    started = False
    started_by = ""
    produced = False  # a token of this task was read
    timeout = settings.REQUEST_FIRST_TOKEN_TIMEOUT_SECS
    deadline = time.monotonic() + timeout
    to_decode = False  # the first token was read: the load's move rides with the next read
    lines = frontend().redis_lines()  # this loop's own connections: no thread hand-over
    while True:
        if time.monotonic() - marked_at > settings.REQUEST_LIVENESS_TTL_SECS / 4:
            await _mark_followed(lease.request_id)
            await lease.arenew(lines, lease_ttl_s())
            marked_at = time.monotonic()
        if to_decode:
            to_decode = False
            read = response_read(namespace, rid, last_id, _POLL_MS)
            (reply,) = await lease.amove_to_decode(lines, along=(read,))
            events = parse_response_read(reply)
        else:
            events = await read_response_events(lines, namespace, rid, last_id, _POLL_MS)
        for event in events:
            last_id = event.id
            if event.type == STARTED:
                started = True
                started_by = str(event.data.get("instance") or "")
            elif event.type == TOKEN:
                # Prefill is over: the lease says so now, its load in Redis with the next read
                # (an answer read whole, its end with it, leaves the move to the release).
                to_decode = lease.first_token_read() or to_decode
                started = produced = True
                timeout = settings.REQUEST_TOKEN_TIMEOUT_SECS
                deadline = time.monotonic() + timeout
            if event.type == ERROR and event.data.get("code") == ENGINE_DEAD:
                # The worker lost its engine under the request and is going away: as if it had
                # vanished, so the request may move on.
                await lines.execute("DEL", response_key(namespace, rid))
                lost = _vanished(worker, lease.request_id, started, produced)
                raise WorkerLost(lost, after_tokens=produced)
            if event.type in (DONE, ERROR):
                # Read to the end: the stream has served its purpose (its TTL covers a frontend
                # that dies before getting here). A DONE's goes with the request's liveness mark,
                # in its owner's round trip (`ServedRequest._lease_end`): the request ends now.
                if event.type == ERROR:
                    await lines.execute("DEL", response_key(namespace, rid))
                yield event
                return
            yield event
        if events:
            continue
        if time.monotonic() > deadline:
            raise ApiError(
                504,
                f"Worker {worker} did not answer request {rid} within {timeout:g} s.",
                code="worker_timeout",
            )
        raw = await lines.execute("GET", heartbeat_key(namespace, worker))
        beat = Heartbeat.from_json(raw) if raw is not None else None
        # A new process under the same name is not the one the request went to, unless that
        # new process is the one that started it (it took the task from the shared queue).
        replaced = (
            beat is not None and bool(lease.instance) and beat.instance not in (lease.instance, started_by)
        )
        if beat is None or replaced:
            shown = lease.request_id
            if replaced:
                logger.warning(
                    "request %s: worker %s was replaced by a new process (instance %s, not %s)",
                    shown,
                    worker,
                    beat.instance,
                    lease.instance,
                )
            raise WorkerLost(_vanished(worker, shown, started, produced), after_tokens=produced)
