"""`ServedRequest`: the one owner of a chat request's life in the frontend, from admission to its
last byte (as vLLM's `AsyncLLM.generate` owns a request and aborts it on cancel).

- `open`: admit (the tenant's slot), prepare (prompt, images, token view), charge the prompt's
  tokens, then decide and send (`_decide_and_send`); when no worker can take it now, it joins the
  admission queue (`_send_or_join`) and waits there between charge and decide (`_wait_in_line`):
  the worker is chosen when it leaves the queue, and a queued request holds no tenant slot. All
  of it up to the decision or the join holds a place at the process's arrival gate
  (serving.arrivals), which lets requests through in the queue's own order.
- `events()`: the worker's tokens, then its `DoneEvent`. A worker that vanishes makes the request
  move to another worker (`_migrate`), before or after its first token: after it, the new worker
  continues from the tokens already read, so the client sees one uninterrupted answer. A worker
  that finds a picture changed at its origin makes it planned again (`_replan`). Both go through
  `_decide_and_send`, the one routine that decides and sends (Dynamo's cut: `KvRouter` decides,
  this sends and follows).
- `close(status, result)`: ends the request once, whatever ended it.

What the request holds is freed in exactly one place each:
- what exists only once a worker was chosen rides the lease, released once by
  `RequestLease.arelease`, which `close` awaits: the load reservation itself, then in the same
  round trip (`_lease_end`) the worker-side cancel of a task the worker did not end, the
  liveness mark and the response stream; then the media blobs (`on_release`: their store may be
  a Redis of its own);
- what precedes the lease is freed by `close` itself (`_tenant_end`): the tenant's concurrency
  slot (with its usage), in the lease's round trip where there is a lease; and the metrics clock;
- a place in the admission queue is left by `_wait_in_line` itself, whatever ends its wait, and
  a place at the arrival gate by `_arrival`'s block.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import redis
from django.conf import settings

from inference_platform.fleet_status import no_worker_error
from inference_platform.serving.admission import (
    queue_full,
    queue_timeout,
    request_priority,
    shed,
    turns,
    waiting_here,
)
from inference_platform.serving.arrivals import ArrivalTimeout, Bounds, arrival_gate
from inference_platform.serving.chat import ChatRequest
from inference_platform.serving.clock import RequestClock
from inference_platform.serving.dispatch import (
    EligibleWorkers,
    WorkerLost,
    eligible_workers,
    follow_task,
    note_redis_failure,
    record_decision,
    redis_recently_failed,
    send_to_worker,
    state_unavailable,
)
from inference_platform.serving.encoding import plan_encoding
from inference_platform.serving.errors import ApiError
from inference_platform.serving.frontend import frontend
from inference_platform.serving.model_pool import model_not_found
from inference_platform.serving.prepare import (
    PreparedRequest,
    all_busy,
    areserve_worker,
    check_context_length,
    image_size_scope,
    prepare,
    session_scope_hash,
)
from routing.admission.queue import QueuedRequest, QueueFull, Ticket, wait_estimate_s
from routing.contract.responses import cancel_key, live_key, response_key
from routing.contract.tasks import IMAGE_CHANGED, DoneEvent, ErrorEvent, GenerateTask, TokenEvent
from routing.fleet.registry import Heartbeat
from routing.kv.decision import AllWorkersBusy, RequestsWaiting, StaleWorkers
from routing.kv.lease import RESERVED, RequestLease
from routing.media.store import MediaRef, MediaStoreError
from routing.observe import telemetry
from routing.prompt.processor_view import tensors_by_reference
from routing.state.redis_direct import Command
from tenants.keys import ANONYMOUS, Caller
from tenants.limits import LimitExceeded, exceeded_headers

logger = logging.getLogger("inference_platform.serving")

# nginx's code for a client that closed the connection before the answer: counted, never sent.
CLIENT_CLOSED = 499

# How long a worker-side cancel mark lives: far past any task's first-token timeout.
_CANCEL_TTL_S = 600

# How many times a decision reads the workers again when the operator's rows moved since its
# read (StaleWorkers) before it decides on the freshest read without the condition.
_STALE_READS_RETRIED = 2

_background: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)


class NoWorker(Exception):
    """No eligible worker is left to decide among (all gone, or all tried)."""


class ServedRequest:
    """One chat request from admission to its last byte; see the module's docstring."""

    def __init__(self, request_id: str, caller: Caller = ANONYMOUS) -> None:
        self.request_id = request_id
        self.caller = caller
        self.clock = RequestClock()  # started now: the request's latency counts from its arrival
        self.chat: ChatRequest | None = None
        self.scope_key: str | None = None
        self.prepared: PreparedRequest | None = None
        self.lease: RequestLease | None = None
        self.task: GenerateTask | None = None  # the task last sent
        self.task_id = request_id  # `<id>-m<n>` after a migration, `<id>-r1` after a replan
        self._marked_at = 0.0  # when the send last set the liveness mark (send_to_worker)
        self.migrations = 0
        self.tried: list[str] = []  # workers that had the request, in order
        self.media: list[MediaRef] = []  # every blob stored for it, freed with the lease
        self._admitted = False
        # OpenAI's `x-ratelimit-*` headers of the caller's tenant (none without per-minute
        # limits): on the answer, and on any refusal after admission.
        self.rate_limit_headers: dict[str, str] = {}
        self._replanned = False
        self._worker_ended = False  # the worker answered DONE or ERROR: nothing to cancel there
        # What reached the client already, for a migration after the first token to continue from.
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._logprobs: list[dict[str, Any]] = []
        self._continuable = True  # every token event so far said which tokens it carried
        self._continued_at_piece = 0  # token pieces (and logprob entries) read before the last
        self._continued_logprobs = 0  # continuation: what its worker's done does not repeat
        self._closed = False
        self.status: int | None = None
        self.priority: int | None = None  # as the tenant allows it (admission.request_priority)
        self._arrived = time.monotonic()  # the maximum wait for a turn counts from here
        self._waiting_since: float | None = None  # waiting for a turn (the gate's, the queue's)
        self._waited_s = 0.0
        self._wait_counted = False

    # -- what the API reports --------------------------------------------------------------

    @property
    def worker(self) -> str | None:
        return self.lease.worker if self.lease is not None else None

    @property
    def total_blocks(self) -> int:
        return self.lease.decision.total_blocks if self.lease is not None else 0

    @property
    def overlap_blocks(self) -> int:
        return self.lease.decision.overlap if self.lease is not None else 0

    # -- open --------------------------------------------------------------------------------

    async def open(self, chat: ChatRequest, headers: Mapping[str, str]) -> ServedRequest:
        """Admit, prepare, charge, decide and send; on any refusal the request is closed (its
        slot freed, its status counted) and the refusal raised as an ApiError.

        Everything up to the decision (or to joining the admission queue) is done holding a place
        at this process's arrival gate (serving.arrivals), which lets requests through in the
        queue's own order; the wait in the queue itself holds none."""
        self.chat = chat
        try:
            self.scope_key = session_scope_hash(headers, self.caller)
            self.priority = request_priority(chat.priority, headers, self.caller)
            if not self.caller.may_use(chat.model):  # as if it did not exist: a tenant sees its own
                raise model_not_found(chat.model)
            model_name, ticket = chat.model, None
            try:
                async with self._arrival(chat.model):
                    if settings.ROUTER_QUEUE_ENABLED:
                        await self._shed_if_full(chat.model)
                    await self._admit()
                    salt = self.caller.cache_salt(chat.cache_salt)
                    prepared = await asyncio.to_thread(
                        prepare, chat, salt, sizes=frontend().image_sizes(), scope_key=self.scope_key
                    )
                    self.prepared = prepared
                    model_name, view = prepared.model.name, prepared.view
                    # Unchecked: the decision checks the rows' generation itself (an empty read
                    # is checked here all the same).
                    workers = await eligible_workers(
                        model_name, view.block_size, prepared.fingerprint, checked=False
                    )
                    if not workers:
                        raise NoWorker
                    # Before the tenant is charged: a prompt no worker can hold costs its tokens nothing.
                    try:
                        check_context_length(view.prompt_tokens, chat.max_tokens, workers, view.block_size)
                    except ApiError:  # refused on what the workers say now, not on an unchecked read
                        workers = await eligible_workers(model_name, view.block_size, prepared.fingerprint)
                        if not workers:
                            raise NoWorker from None
                        check_context_length(view.prompt_tokens, chat.max_tokens, workers, view.block_size)
                    await self._charge(view.prompt_tokens)
                    if settings.ROUTER_QUEUE_ENABLED:
                        ticket = await self._send_or_join(prepared, workers)
                    else:
                        await self._send_now(prepared, workers)
                if ticket is not None:
                    await self._wait_in_line(prepared, ticket)
            except NoWorker:
                # Why none, naming the workers, with Retry-After (drained, disabled, down).
                raise await no_worker_error(model_name, self._block_size(), self.request_id) from None
            self._end_wait()
        except asyncio.CancelledError:
            await self.close(CLIENT_CLOSED)
            raise
        except Exception as exc:
            if isinstance(exc, ApiError):  # the request was counted: its refusal says what is left
                exc.headers = self.rate_limit_headers | exc.headers
            error = await self.fail(exc)
            if error is exc:
                raise
            raise error from exc
        self._log_sent()
        return self

    def _block_size(self) -> int:
        assert self.prepared is not None  # no worker is looked for before the prompt's view
        return self.prepared.view.block_size

    async def _admit(self) -> None:
        """Count the request against its tenant's limits (requests per minute, concurrency), or 429;
        keeps the `x-ratelimit-*-requests` headers (none without a requests-per-minute limit)."""
        caller = self.caller
        if caller.tenant_id is None:
            return
        if not caller.requests_per_minute and not caller.max_concurrent_requests:
            self._admitted = True  # nothing to count against: no round trip, no thread
            return
        try:
            budget = await asyncio.to_thread(
                frontend().limiter().admit,
                caller.tenant_id,
                self.request_id,
                requests_per_minute=caller.requests_per_minute,
                max_concurrent=caller.max_concurrent_requests,
            )
        except LimitExceeded as exceeded:
            raise await self._over_limit(exceeded) from None
        self._admitted = True
        if budget is not None:
            self.rate_limit_headers.update(budget.headers())

    async def _take_slot(self) -> None:
        """Take the tenant's concurrency slot again when a queued request leaves the queue (its
        requests per minute were counted on arrival), or 429."""
        caller = self.caller
        if caller.tenant_id is None or not caller.max_concurrent_requests:
            return
        try:
            await asyncio.to_thread(
                frontend().limiter().admit,
                caller.tenant_id,
                self.request_id,
                requests_per_minute=None,
                max_concurrent=caller.max_concurrent_requests,
            )
        except LimitExceeded as exceeded:
            raise await self._over_limit(exceeded) from None

    async def _free_slot(self) -> None:
        """A request that waits holds no concurrency slot of its tenant: the tenant's running
        requests are what the limit bounds, not its place in line."""
        caller = self.caller
        if caller.tenant_id is not None and caller.max_concurrent_requests:
            await asyncio.to_thread(frontend().limiter().release, caller.tenant_id, self.request_id)

    async def _charge(self, prompt_tokens: int) -> None:
        """Take the prompt's tokens from its tenant's per-minute budget, or 429; keeps the
        `x-ratelimit-*-tokens` headers (none without a prompt-tokens-per-minute limit)."""
        caller = self.caller
        if caller.tenant_id is None or not caller.prompt_tokens_per_minute:
            return
        try:
            budget = await asyncio.to_thread(
                frontend().limiter().charge_prompt_tokens,
                caller.tenant_id,
                prompt_tokens,
                limit=caller.prompt_tokens_per_minute,
            )
        except LimitExceeded as exceeded:
            raise await self._over_limit(exceeded) from None
        if budget is not None:
            self.rate_limit_headers.update(budget.headers())

    async def _over_limit(self, exceeded: LimitExceeded) -> ApiError:
        caller = self.caller
        logger.info("request %s of %s refused: over %s", self.request_id, caller.label, exceeded.limit)
        await asyncio.to_thread(_count_refusal, caller.usage_id)  # type: ignore[arg-type]
        retry_after = exceeded.retry_after_s
        headers = exceeded_headers(exceeded)
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        return ApiError(
            429,
            exceeded.describe(),
            code="rate_limit_exceeded" if retry_after is not None else "request_too_large",
            param=exceeded.limit,
            headers=headers,
        )

    # -- waiting in the admission queue -------------------------------------------------------

    async def _shed_if_full(self, model: str) -> None:
        """Refuse at once, before any preparation, a request that would find the queue full: a
        flood costs the frontend one read per request, not a prompt's preparation."""
        front = frontend()
        full = await front.admission_queue().afull_for(
            front.redis_lines(),
            model,
            self._queue_tenant,
            self.priority or 0,
            max_depth=settings.ROUTER_QUEUE_MAX_DEPTH,
            max_tenant_depth=settings.ROUTER_QUEUE_MAX_TENANT_DEPTH,
        )
        if full is not None:
            raise queue_full(model, full)

    @property
    def _queue_tenant(self) -> str:
        """The caller's tenant as the admission queue names it."""
        return "anonymous" if self.caller.tenant_id is None else str(self.caller.tenant_id)

    async def _send_now(self, prepared: PreparedRequest, workers: Mapping[str, Heartbeat]) -> None:
        """With the queue off: decide and send now, or the 503 of every worker busy (counted)."""
        try:
            await self._decide_and_send(prepared, self.request_id, workers=workers)
        except ApiError as refused:
            if refused.code == "all_workers_busy":
                telemetry.inc("requests_shed", labels={"cause": refused.code})
            raise

    @contextlib.asynccontextmanager
    async def _arrival(self, model: str) -> AsyncIterator[None]:
        """Hold a place at this process's arrival gate (serving.arrivals) for the block. While it
        waits for one, the request counts in the admission queue's depth and wait, as a request
        in line is (under the model it names, once that is known to be a model or an alias); the
        gate's refusals are the queue's (full, timed out)."""
        tenant, priority = self._queue_tenant, self.priority or 0
        # Not resolved yet: a name the client sent becomes a label only once it is known to be one.
        label = model if frontend().models().known(model) else ""

        def waiting(n: int) -> None:
            waiting_here().add(label, tenant, priority, n)
            self._note_wait(n)

        gate = arrival_gate()
        try:
            async with gate.turn(
                tenant,
                priority,
                self._queue_weight,
                Bounds(
                    settings.ROUTER_QUEUE_MAX_WAIT_SECS,
                    settings.ROUTER_QUEUE_MAX_DEPTH,
                    settings.ROUTER_QUEUE_MAX_TENANT_DEPTH,
                ),
                on_wait=waiting,
                bypass=redis_recently_failed,
            ):
                try:
                    yield
                except Exception as exc:
                    if isinstance(exc, redis.RedisError):
                        note_redis_failure()
                    if redis_recently_failed():
                        # Redis is out of reach: the others would only wait behind each one's
                        # timeout before meeting their own (serving.arrivals): none waits now.
                        gate.let_everyone_through()
                    raise
        except QueueFull as full:  # the gate's bounds are the queue's
            raise queue_full(model, full) from None
        except ArrivalTimeout as late:
            retry_after = wait_estimate_s(late.ahead, late.drain_per_s, settings.ROUTER_BUSY_RETRY_AFTER_SECS)
            raise queue_timeout(model, self.request_id, late.waited_s, retry_after) from None

    def _note_wait(self, n: int) -> None:
        """A wait for a turn (the gate's or the queue's) starts (1) or ends (-1)."""
        if n > 0:
            self._waiting_since = time.monotonic()
        elif self._waiting_since is not None:
            self._waited_s += time.monotonic() - self._waiting_since
            self._waiting_since = None

    def _end_wait(self) -> None:
        """Count the request's whole wait for its turn once, however it ended (dispatched, shed,
        abandoned), if it waited at all."""
        self._note_wait(-1)
        if self._waited_s and not self._wait_counted:
            self._wait_counted = True
            telemetry.observe(
                "admission_queue_wait_seconds",
                self._waited_s,
                # the model it was resolved to ("" if it never was: a name the client sent is no label)
                labels={
                    "model": self.prepared.model.name if self.prepared else "",
                    "priority": str(self.priority or 0),
                },
            )

    @property
    def _queue_weight(self) -> float:
        """The tenant's share within its band; 0 (arrival order) with ROUTER_QUEUE_ORDER fifo."""
        return self.caller.queue_weight if settings.ROUTER_QUEUE_ORDER == "fair" else 0.0

    async def _send_or_join(
        self, prepared: PreparedRequest, workers: Mapping[str, Heartbeat]
    ) -> Ticket | None:
        """Decide and send now if nothing of the model waits and a worker can take it (None);
        else join the admission queue (routing.admission) and hand back the place."""
        model = prepared.model.name
        queue = frontend().admission_queue()
        try:
            # Made only while none of the model's requests wait: the queue's look goes with the
            # decision, in its round trip and its atomic step.
            await self._decide_and_send(
                prepared, self.request_id, workers=workers, unless_waiting=queue.waiting_key(model)
            )
            return None
        except RequestsWaiting:
            pass
        except ApiError as refused:
            if refused.code != "all_workers_busy":
                raise
        queued = QueuedRequest(
            request_id=self.request_id,
            model=model,
            tenant=self._queue_tenant,
            priority=self.priority or 0,
            weight=self._queue_weight,
        )
        await self._free_slot()
        try:
            return await asyncio.to_thread(
                queue.join,
                queued,
                max_depth=settings.ROUTER_QUEUE_MAX_DEPTH,
                max_tenant_depth=settings.ROUTER_QUEUE_MAX_TENANT_DEPTH,
            )
        except QueueFull as full:
            raise queue_full(model, full) from None

    async def _wait_in_line(self, prepared: PreparedRequest, ticket: Ticket) -> None:
        """Wait in the admission queue, then decide and send when the request is first in line
        and a worker frees, or shed it past ROUTER_QUEUE_MAX_WAIT_SECS (counted from its
        arrival: its wait at the gate included).

        Only this frontend dispatches its own entry, and only when the queue says it is first
        (its watch, `admission.Turns`): requests of every frontend leave in one order, each once.
        The entry is left however the wait ends (dispatched, timed out, the client gone), at once.
        """
        model = prepared.model.name
        queue = frontend().admission_queue()
        tenant, priority = self._queue_tenant, self.priority or 0
        waiting_here().add(model, tenant, priority, 1)
        self._note_wait(1)
        deadline = self._arrived + settings.ROUTER_QUEUE_MAX_WAIT_SECS
        dispatched = False
        try:
            while True:
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    ahead = await asyncio.to_thread(queue.turn, ticket)
                    if ahead is None:  # swept: this frontend was taken for dead (Redis unreachable)
                        raise shed(503, f"Request {self.request_id} lost its place in line.", "queue_lost", 1)
                    retry_after = wait_estimate_s(
                        ahead, ticket.drain_per_s, settings.ROUTER_BUSY_RETRY_AFTER_SECS
                    )
                    raise queue_timeout(model, self.request_id, time.monotonic() - self._arrived, retry_after)
                if not await turns().wait(queue, model, ticket.member, left_s):
                    continue
                try:
                    # The tenant's slot is taken once a worker is reserved, before the send.
                    await self._decide_and_send(prepared, self.request_id, on_reserved=self._take_slot)
                    dispatched = True
                    return
                except ApiError as refused:
                    if refused.code != "all_workers_busy":
                        raise
        finally:
            await asyncio.shield(asyncio.to_thread(queue.leave, ticket, dispatched=dispatched))
            waiting_here().add(model, tenant, priority, -1)
            self._note_wait(-1)
            if dispatched:
                turns().notify(model)  # the next in line may find a worker too

    # -- decide and send: the one routine of the first send, a migration and a replan ---------

    async def _decide_and_send(
        self,
        prepared: PreparedRequest,
        task_id: str,
        *,
        resend: GenerateTask | None = None,
        workers: Mapping[str, Heartbeat] | None = None,
        on_reserved: Callable[[], Awaitable[None]] | None = None,
        unless_waiting: str | None = None,
    ) -> None:
        """Choose among the eligible workers not tried yet, reserve there, and send `task_id`.

        The first decision's lease becomes the request's; a later one is handed to it
        (`RequestLease.reassign`: the old worker's reservation goes, the lease lives on), so a
        send that fails leaves one lease to release, by `close`. `resend` is a task already
        built (a migration: its media are stored, its encoder chosen); else the task is built
        from `prepared`, its media stored. `workers`: the eligible workers, when just looked up.
        `on_reserved`: awaited once a worker is reserved, before anything is sent (a refusal there
        leaves the reservation to the lease, which `close` releases). `unless_waiting`: decide
        only while that key (the admission queue's) does not exist; RequestsWaiting, nothing
        reserved or sent, when it does.
        """
        view = prepared.view
        started = time.perf_counter()
        for attempt in range(_STALE_READS_RETRIED + 1):
            if workers is None:
                workers = await eligible_workers(
                    prepared.model.name, view.block_size, prepared.fingerprint, checked=attempt > 0
                )
            if self.tried:
                workers = _without(workers, self.tried)
            if not workers:
                raise NoWorker
            try:
                lease = await areserve_worker(
                    prepared,
                    workers,
                    self.scope_key,
                    self.request_id,
                    # Rows that keep moving: the last try decides on the freshest read it has.
                    conditional=attempt < _STALE_READS_RETRIED,
                    unless_waiting=unless_waiting,
                )
                break
            except AllWorkersBusy as busy:
                raise all_busy(prepared.model.name, self.request_id, busy) from busy
            except StaleWorkers:  # the operator's rows moved since the read: read them again
                workers = None
        telemetry.observe("routing_decision_seconds", time.perf_counter() - started)
        record_decision(lease.decision)
        if self.lease is None:
            self.lease = lease
            lease.on_release(self._released)
        else:
            await asyncio.to_thread(self.lease.reassign, lease.decision, lease.instance)
        self.task_id = task_id
        self.tried.append(lease.worker)
        if on_reserved is not None:
            await on_reserved()
        if resend is None:
            image_refs, video_refs, processed = await store_media(prepared, self.request_id, self.media)
            task = dataclasses.replace(
                prepared.generate_task(task_id, self.scope_key, image_refs, video_refs),
                follow_id=self.request_id,
                processed=processed,
                priority=self.priority,
            )
            # E/PD: with live encode workers, images the chosen worker's cached prefix does not
            # cover are encoded apart, and the task names them (the aggregated path when none).
            task, _ = await plan_encoding(
                task, view, prepared.model.name, lease.worker, lease.decision.overlap
            )
        else:
            task = dataclasses.replace(resend, request_id=task_id)
        self.task = task
        # Stamped at the send, for the worker's queue-time histogram (wall clocks of two hosts).
        self._marked_at = await send_to_worker(
            lease.worker, dataclasses.replace(task, dispatched_at=time.time())
        )

    # -- events --------------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[TokenEvent | DoneEvent]:
        """The answer's tokens, then its `DoneEvent` (usage counted once over every worker that
        had it); an ApiError when it fails. The request is closed when this ends, however it
        ends: a client that goes away (the generator closed or its task cancelled) cancels it."""
        assert self.lease is not None, "events() follows an opened request"
        try:
            while True:
                try:
                    async for entry in follow_task(self.lease, self.task_id, self._marked_at):
                        event = entry.event
                        if isinstance(event, TokenEvent):  # (follow_task ended prefill at the first)
                            self.clock.first_token()
                            self._note_sent(event)
                            yield event
                        elif isinstance(event, ErrorEvent):
                            self._worker_ended = True
                            if event.code == IMAGE_CHANGED:
                                self._forget_image_sizes()
                                if await self._replan():
                                    break
                            raise self._worker_error(event)
                        elif isinstance(event, DoneEvent):
                            self._worker_ended = True
                            done = self._whole(event)
                            await self.close(200, done)
                            yield done
                            return
                    else:
                        raise ApiError(
                            502, f"Request {self.request_id} ended without an answer.", code="worker_error"
                        )
                except WorkerLost as lost:
                    await self._migrate(lost)
        except (asyncio.CancelledError, GeneratorExit):
            await self.close(CLIENT_CLOSED)
            raise
        except Exception as exc:
            error = await self.fail(exc)
            if error is exc:
                raise
            raise error from exc

    def _note_sent(self, event: TokenEvent) -> None:
        self._text.append(event.text)
        self._logprobs.extend(event.logprobs or ())
        if event.token_ids is None:
            self._continuable = False  # a worker that does not say: no continuation from here
        else:
            self._token_ids.extend(event.token_ids)

    def _whole(self, done: DoneEvent) -> DoneEvent:
        """The answer over every worker that had it: after a migration mid-answer, the last
        worker's done covers only what it continued, and its prompt held the tokens before."""
        carried = len(self.task.continued_token_ids) if self.task is not None else 0
        if not carried:
            return done
        earlier_text = "".join(self._text[: self._continued_at_piece])
        return dataclasses.replace(
            done,
            text=earlier_text + done.text,
            prompt_tokens=done.prompt_tokens - carried,
            completion_tokens=done.completion_tokens + carried,
            cached_tokens=min(done.cached_tokens, done.prompt_tokens - carried),
            logprobs=None
            if done.logprobs is None
            else self._logprobs[: self._continued_logprobs] + done.logprobs,
        )

    def _worker_error(self, error: ErrorEvent) -> ApiError:
        status = int(error.status)
        message = error.message or "The worker failed."
        if status >= 500:
            message = f"{message} (request {self.request_id}, worker {self.worker})"
        param = error.param
        # A worker knows only which image it refused; the message part is the client's own words.
        images = self.chat.images if self.chat is not None else []
        if param is None and error.image_index is not None and 0 <= error.image_index < len(images):
            param = images[error.image_index].param
        return ApiError(status, message, code=error.code or "worker_error", param=param)

    # -- migration and replan ---------------------------------------------------------------

    async def _migrate(self, lost: WorkerLost) -> None:
        """Move the request to another worker after its worker vanished, or raise the loss.

        Before the first token the task is sent again as it was; after it, the new worker
        continues it (`GenerateTask.continued_token_ids`: the tokens the client already has,
        appended to the prompt; the rest of the max_tokens budget), so no token is lost or
        repeated. At most REQUEST_MIGRATION_LIMIT times.
        """
        assert self.prepared is not None and self.task is not None and self.lease is not None
        old_worker, old_task = self.lease.worker, self.task_id
        # The vanished worker's copy is told to stop (should its name come back, it finds it).
        await asyncio.shield(_cancel_task(old_task))
        if self.migrations >= settings.REQUEST_MIGRATION_LIMIT:
            raise lost.error
        resend = self.task
        if lost.after_tokens:
            if not self._continuable:
                raise lost.error
            carried = tuple(self._token_ids)
            remaining = self.prepared.chat.max_tokens - len(carried)
            if remaining <= 0:
                raise lost.error
            resend = dataclasses.replace(
                self.task,
                continued_token_ids=carried,
                max_tokens=remaining,
                # Block hashes route the prompt; the continued tokens are the worker's to hash.
            )
            self._continued_at_piece = len(self._text)
            self._continued_logprobs = len(self._logprobs)
        try:
            await self._decide_and_send(
                self.prepared, f"{self.request_id}-m{self.migrations + 1}", resend=resend
            )
        except (NoWorker, ApiError) as refused:
            if isinstance(refused, ApiError) and refused.code != "all_workers_busy":
                raise
            raise lost.error from None
        self.migrations += 1
        telemetry.inc("request_migrations", labels={"worker": self.lease.worker})
        logger.warning(
            "request %s: worker %s went away %s; migrated to %s",
            self.request_id,
            old_worker,
            f"after {len(self._token_ids)} tokens" if lost.after_tokens else "before its first token",
            self.lease.worker,
        )

    async def _replan(self) -> bool:
        """Plan the request again after a worker found one of its pictures changed at the origin
        since its size was read (a size the frontend kept): sizes read afresh, a new token view,
        decision and task `<id>-r1`. Once, and only before the first token; the tenant is not
        admitted or charged again. False where it cannot (the worker's own 409 then answers)."""
        if self._replanned or self.lease is None or self.lease.state != RESERVED or self.chat is None:
            return False
        self._replanned = True
        try:
            salt = self.caller.cache_salt(self.chat.cache_salt)
            prepared = await asyncio.to_thread(
                prepare, self.chat, salt, sizes=frontend().image_sizes(), scope_key=self.scope_key
            )
            # The worker that found the picture changed may take the new plan, too.
            self.tried = [worker for worker in self.tried if worker != self.lease.worker]
            await self._decide_and_send(prepared, f"{self.request_id}-r1")
        except (NoWorker, AllWorkersBusy):
            return False
        except ApiError as error:
            if error.code == "all_workers_busy":
                return False
            raise
        except redis.RedisError:
            raise
        except Exception:
            logger.exception("request %s: planning it again failed", self.request_id)
            return False
        self.prepared = prepared
        self._worker_ended = False  # the new task runs: until it ends, it is the worker's to stop
        telemetry.inc("request_replans", labels={"worker": self.lease.worker})
        logger.info(
            "request %s: a picture changed at its origin since its size was read;"
            " planned again and sent to worker %s",
            self.request_id,
            self.lease.worker,
        )
        return True

    def _forget_image_sizes(self) -> None:
        """Forget the sizes read by URL for this request: a worker found one changed."""
        sizes = frontend().image_sizes()
        if sizes is None or self.prepared is None or self.chat is None:
            return
        read_by_url = [image.identity for image in self.prepared.images if image.data is None]
        if read_by_url:
            salt = self.caller.cache_salt(self.chat.cache_salt)
            sizes.forget(image_size_scope(salt, self.scope_key), read_by_url)

    # -- close -------------------------------------------------------------------------------

    async def fail(self, exc: BaseException) -> ApiError:
        """Close the request on a failure and say what the client gets: an ApiError as it is,
        anything unforeseen still in the API's format (a lost Redis a 503, the rest a logged 500)."""
        error = as_api_error(exc, self.request_id)
        await self.close(error.status, error)
        return error

    async def close(self, status: int, result: DoneEvent | ApiError | None = None) -> None:
        """End the request once (later calls do nothing): its lease released (and with it what
        rides on it: load, media, liveness mark, a worker-side cancel), its status and tokens
        counted, its tenant's slot freed and usage recorded. What it writes to Redis at its end
        goes in one round trip: the load's free, then `_lease_end` and `_tenant_end`."""
        if self._closed:
            return
        self._closed = True
        self.status = status
        self._end_wait()
        done = result if isinstance(result, DoneEvent) else None
        for_tenant = await self._tenant_end(done)
        if self.lease is not None:
            outcome = "done" if done is not None else "abandoned" if status == CLIENT_CLOSED else "failed"
            if isinstance(result, ApiError):
                outcome = result.code or outcome
            along = [*self._lease_end(), *for_tenant]
            sent = True
            try:
                # False only if the lease was released already: then nothing went along.
                sent = await asyncio.shield(
                    self.lease.arelease(frontend().redis_lines(), outcome, along=along)
                )
            except redis.RedisError as exc:  # the reservation, the mark and the slot expire on their own
                note_redis_failure()
                logger.warning(
                    "could not write the end of request %s (its load on worker %s, liveness mark%s): %s",
                    self.request_id,
                    self.worker,
                    ", usage" if done is not None else "",
                    exc,
                )
            if sent:  # (or lost with the connection: never sent twice, a usage counted twice)
                for_tenant = []
            if self.prepared is not None:
                turns().notify(self.prepared.model.name)  # a request of this process may go now
        if status == CLIENT_CLOSED:
            # Said once per request, as its sending was: what became of a request cut off mid-answer.
            pieces = len(self._text)
            logger.info(
                "request %s: the client went away after %d piece%s of the answer%s",
                self.request_id,
                pieces,
                "" if pieces == 1 else "s",
                "" if self.lease is None or self._worker_ended else f"; worker {self.worker} told to stop",
            )
        model = self.prepared.model.name if self.prepared is not None else None
        self.clock.finish(status, self.worker, done, model)
        if for_tenant:
            await asyncio.shield(self._end_for_tenant(for_tenant))

    def _lease_end(self) -> list[Command]:
        """What rides on the lease and is written with its free: a cancel of the task if the
        worker did not end it (the client went away, a timeout, a failure here), set before the
        liveness mark goes, since a worker that finds the mark gone and no cancel takes its
        frontend for dead (workers.runtime says which it was); the mark; and the stream the task's
        end was read from (`follow_task` leaves a DONE's here; an ERROR's it dropped already)."""
        namespace = settings.REDIS_KEY_PREFIX
        if not self._worker_ended:
            return [_cancel_command(self.task_id), ("DEL", live_key(namespace, self.request_id))]
        return [("DEL", live_key(namespace, self.request_id), response_key(namespace, self.task_id))]

    async def _tenant_end(self, done: DoneEvent | None) -> list[Command]:
        """What the request's end writes for its tenant: its concurrency slot freed, if it took
        one (`_admit`), and what it used counted, if it was answered."""
        caller = self.caller
        if not self._admitted:
            return []
        commands: list[Command] = []
        if caller.max_concurrent_requests:
            commands.append(frontend().limiter().release_command(caller.tenant_id, self.request_id))  # type: ignore[arg-type]
        if done is not None:
            try:
                usage = await frontend().ausage()
            except Exception:  # a lost usage increment must not fail an answered request
                logger.exception("could not count the usage of request %s", self.request_id)
                return commands
            commands += usage.record_commands(
                caller.usage_id,  # type: ignore[arg-type]
                prompt=int(done.prompt_tokens),
                cached=int(done.cached_tokens),
                completion=int(done.completion_tokens),
            )
        return commands

    async def _released(self, lease: RequestLease) -> None:
        """What rides on the lease in a store of its own, freed once when it is released
        (`RequestLease.arelease`): the request's media blobs."""
        await arelease_media(self.request_id, self.media)

    async def _end_for_tenant(self, commands: list[Command]) -> None:
        """`_tenant_end`'s commands, where no lease release took them along: a request refused
        or failed before a worker was chosen (or whose lease was released already)."""
        if redis_recently_failed():
            # Redis just failed this request: the client gets its answer now, not a timeout later.
            task = asyncio.create_task(_record_end(self.caller, self.request_id, commands))
            _background.add(task)
            task.add_done_callback(_background.discard)
            return
        await _record_end(self.caller, self.request_id, commands)

    def _log_sent(self) -> None:
        assert self.prepared is not None and self.lease is not None
        decision = self.lease.decision
        logger.info(
            "request %s of %s sent to worker %s (%d prompt tokens, %d/%d blocks cached, best %d, %s)",
            self.request_id,
            self.caller.label,
            decision.worker,
            self.prepared.view.prompt_tokens,
            decision.overlap,
            decision.total_blocks,
            decision.best_overlap,
            decision.reason,
        )


def as_api_error(exc: BaseException, request_id: str) -> ApiError:
    """What a failure answers: an ApiError as it is; anything unforeseen still in the API's
    format, with the request id (a lost Redis a 503, the rest a logged 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, redis.RedisError):
        return state_unavailable(request_id, exc)
    logger.exception("request %s failed", request_id, exc_info=exc)
    return ApiError(500, f"Internal error in request {request_id}.", code="internal_error")


async def _record_end(caller: Caller, request_id: str, commands: list[Command]) -> None:
    """Free the tenant's concurrency slot and count what the request used (`commands`)."""
    try:
        await frontend().redis_lines().execute_many(*commands)
    except redis.RedisError:
        note_redis_failure()
        # The slot expires on its own; a lost usage increment must not fail an answered request.
        logger.warning("could not record the end of request %s for %s", request_id, caller.label)


def _without(workers: Mapping[str, Heartbeat], tried: list[str]) -> Mapping[str, Heartbeat]:
    """The workers but those tried, a copy (the fleet read's own mapping is shared)."""
    if isinstance(workers, EligibleWorkers):
        return workers.without(tried)
    return {name: beat for name, beat in workers.items() if name not in tried}


def _count_refusal(usage_id: str) -> None:
    """In a thread: the usage's namespace may need a database read the first time."""
    frontend().usage().refused(usage_id)


def _cancel_command(task_id: str) -> Command:
    """The mark that tells a worker to stop a task (workers.runtime looks for it)."""
    return ("SET", cancel_key(settings.REDIS_KEY_PREFIX, task_id), b"1", "EX", _CANCEL_TTL_S)


async def _cancel_task(task_id: str) -> None:
    """Ask the worker to stop a task; with Redis gone too, the worker finishes it and its stream
    expires."""
    try:
        await frontend().redis_lines().execute(*_cancel_command(task_id))
    except redis.RedisError:
        logger.warning("could not cancel request %s: Redis failed", task_id)


async def store_media(
    prepared: PreparedRequest, owner: str, stored: list[MediaRef]
) -> tuple[dict[int, MediaRef], dict[int, MediaRef], dict[str, Any] | None]:
    """Put the bytes the frontend holds (fetched images, data URLs), each video's sampled frames
    and the processor path's tensors in the side store under `owner`; every reference made is
    appended to `stored` at once (so it is released with the request, whatever fails next).
    Returns the references by image index and by video index, and the processed inputs with
    their tensors by reference."""
    held = [image for image in prepared.images if image.data is not None]
    store = frontend().media_store()

    def put_all(blobs: list[bytes]) -> list[MediaRef]:
        refs = store.put_many(owner, blobs)
        stored.extend(refs)
        return refs

    try:
        processed = prepared.processed
        if processed is not None:
            processed = await asyncio.to_thread(
                tensors_by_reference, processed, lambda blobs: [r.to_payload() for r in put_all(blobs)]
            )
        if not held and not prepared.videos:
            return {}, {}, processed
        blobs = [image.data for image in held] + [video.frames for video in prepared.videos]
        refs = await asyncio.to_thread(put_all, blobs)
    except MediaStoreError as exc:
        raise ApiError(exc.status, exc.message, code=exc.code, param="messages") from exc
    image_refs = {image.index: ref for image, ref in zip(held, refs, strict=False)}
    video_refs = {video.index: ref for video, ref in zip(prepared.videos, refs[len(held) :], strict=True)}
    return image_refs, video_refs, processed


async def arelease_media(owner: str, refs: list[MediaRef]) -> None:
    """Free a request's blobs in the side store now rather than at their TTL, from the event loop
    on its own connections to Redis."""
    if not refs:
        return
    try:
        await frontend().media_store().arelease(frontend().redis_lines(), owner, refs)
    except redis.RedisError:
        logger.warning("could not release the media of request %s (they expire)", owner)
