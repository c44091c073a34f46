"""The request lease: the one owner of a routed request's life in the router.

`KvRouter.decide` reserves the request's load on its worker and hands out a lease; from then
on only the lease changes that load: `first_token` (on an event loop, `first_token_read` then
`amove_to_decode`) moves it from prefill to decode, `release` frees it exactly once, whatever
ends the request (completion, failure, cancellation, a send that failed). If the process
holding the lease dies, the reservation expires in Redis on its own (`LoadTracker`'s entry
TTL), which is the lease's expiry.

What other parts tie to a request's life rides on the lease, so it is freed with it and only
once: `attributes` carries their data (the migration attempt, the frontend's liveness mark,
the tenant whose concurrency slot the request holds) and `on_release` callbacks run once, in
the order registered, after the load is freed. On an event loop, `arelease` frees the load on
the loop's own connections and awaits a callback that is a coroutine function; `release` (in a
thread) takes only plain ones. `reassign` moves the lease to a new decision
(migration to another worker before the first token) without ending it.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from routing.kv.decision import RoutingDecision
    from routing.kv.load import LoadTracker
    from routing.state.redis_direct import AsyncDirectCommands, Command

logger = logging.getLogger("routing.kv.lease")

RESERVED, DECODING, RELEASED = "reserved", "decoding", "released"

# What rides on a lease: a plain function, or a coroutine function (`arelease` awaits it).
ReleaseCallback = Callable[["RequestLease"], None] | Callable[["RequestLease"], Awaitable[None]]


@dataclass(eq=False)
class RequestLease:
    load: LoadTracker = field(repr=False)
    request_id: str
    decision: RoutingDecision = field(repr=False)
    instance: str = ""  # the worker process (registry instance id) the request was sent to
    state: str = RESERVED
    outcome: str | None = None  # why it was released: "done", "error", "cancelled", ...
    decided_at: float = field(default_factory=time.monotonic)
    attributes: dict[str, Any] = field(default_factory=dict)
    _callbacks: list[ReleaseCallback] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def worker(self) -> str:
        return self.decision.worker

    @property
    def released(self) -> bool:
        return self.state == RELEASED

    def first_token(self) -> bool:
        """Prefill is over: the load moves to decode. True the first time, False after."""
        with self._lock:
            if self.state != RESERVED:
                return False
            self.state = DECODING
        self.load.prefill_done(self.worker, self.request_id)
        return True

    def first_token_read(self) -> bool:
        """`first_token` in two steps, for a reader of the answer's stream on an event loop: the
        lease leaves prefill here at once (True the first time, False after), and its load in
        Redis moves with the reader's next round trip (`amove_to_decode`), so that the first
        token waits for no round trip of its own."""
        with self._lock:
            if self.state != RESERVED:
                return False
            self.state = DECODING
            return True

    async def amove_to_decode(
        self, lines: AsyncDirectCommands, *, along: Sequence[Command] = ()
    ) -> list[Any]:
        """The load's move to decode after `first_token_read`, on an event loop's own connections
        (`lines`), with `along` (the caller's commands, a read of the stream, say) sent behind it
        in the same round trip: their replies. A lease released or moved to another worker
        (`reassign`) meanwhile sends `along` alone."""
        if self.state != DECODING:
            return await lines.execute_many(*along) if along else []
        return (await self.load.aprefill_done(lines, self.worker, self.request_id, along=along))[1]

    def renew(self, ttl_s: float) -> bool:
        """The frontend still follows the request: its reservation lives ttl_s more.

        Reservations are made with a short expiry (the frontend's liveness), so a frontend that
        dies anywhere between the decision and the answer leaves no load behind for long.
        """
        if self.state == RELEASED:
            return False
        return self.load.renew(self.worker, self.request_id, ttl_s)

    async def arenew(self, lines: AsyncDirectCommands, ttl_s: float) -> bool:
        """`renew` on an event loop's own connections (`lines`)."""
        if self.state == RELEASED:
            return False
        return await self.load.arenew(lines, self.worker, self.request_id, ttl_s)

    def on_release(self, callback: ReleaseCallback) -> None:
        """Run `callback(lease)` once when the lease is released (at once if it already was, and
        then only a plain callback). A coroutine function is awaited by `arelease`, and refused by
        `release`, which has no loop to await it on."""
        with self._lock:
            if self.state != RELEASED:
                self._callbacks.append(callback)
                return
        if inspect.iscoroutinefunction(callback):
            raise TypeError(f"request {self.request_id}: the lease was released; await the callback yourself")
        callback(self)

    def _end(self, outcome: str) -> list[ReleaseCallback] | None:
        """Mark the lease released; its callbacks, or None if it was already."""
        with self._lock:
            if self.state == RELEASED:
                return None
            self.state, self.outcome = RELEASED, outcome
            callbacks, self._callbacks = self._callbacks, []
            return callbacks

    def release(self, outcome: str) -> bool:
        """Free the request's load and run the release callbacks; True only the first time.

        A Redis error while freeing still ends the lease here (the entry then expires in Redis)
        and runs the callbacks; the error is raised afterwards.
        """
        if any(inspect.iscoroutinefunction(callback) for callback in self._callbacks):
            raise TypeError(f"request {self.request_id}: a callback is a coroutine; use arelease")
        callbacks = self._end(outcome)
        if callbacks is None:
            return False
        failure: Exception | None = None
        try:
            self.load.free(self.worker, self.request_id)
        except Exception as exc:  # Redis away: the reservation expires on its own
            failure = exc
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                logger.exception("a release callback of request %s failed", self.request_id)
        if failure is not None:
            raise failure
        return True

    async def arelease(
        self, lines: AsyncDirectCommands, outcome: str, *, along: Sequence[Command] = ()
    ) -> bool:
        """`release` on an event loop's own connections (`lines`), awaiting each callback that
        is a coroutine function; the same promises. `along`: what else the request's end writes
        (to `lines`' Redis), sent after the free in its round trip, and only if this call is the
        one that releases."""
        callbacks = self._end(outcome)
        if callbacks is None:
            return False
        failure: Exception | None = None
        try:
            await self.load.afree(lines, self.worker, self.request_id, along=along)
        except Exception as exc:  # Redis away: the reservation expires on its own
            failure = exc
        for callback in callbacks:
            try:
                result = callback(self)
                if inspect.isawaitable(result):
                    await result
            except Exception:
                logger.exception("a release callback of request %s failed", self.request_id)
        if failure is not None:
            raise failure
        return True

    def reassign(self, decision: RoutingDecision, instance: str = "") -> None:
        """Migration: the request now runs under `decision` (reserved by `KvRouter.decide`).

        The old worker's reservation is freed; the lease, its attributes and callbacks stay.
        """
        with self._lock:
            if self.state == RELEASED:
                raise RuntimeError(f"request {self.request_id}: a released lease cannot move")
            old = self.decision
            self.decision, self.instance, self.state = decision, instance, RESERVED
        if old.worker != decision.worker:
            self.load.free(old.worker, self.request_id)
