"""The arrival gate: in which order this frontend process does the work of requests just arrived.

Under a flood the frontend's own work is the first queue a request meets. Each arrival counts
against its tenant's limits, prepares its prompt, and decides or joins the admission queue, with
a hand-over to a thread for each; those hand-overs run first come, first served. A tenant that
sends ten times what the workers can answer fills them, and a light tenant's request, or a
high-priority one, waits behind the whole flood before it even reaches the admission queue whose
order would have put it first.

So at most FRONTEND_ARRIVAL_CONCURRENCY requests do that work at once, and the others wait here,
in the admission queue's own order (routing.admission): priority band first, strictly; then
start-time fair queuing between tenants within a band, weighted by each tenant's weight (0:
arrival order); then arrival. Waiting here costs no thread and no Redis call. Bounds, as the
queue's: a request whose flow (its tenant's requests at its priority) has
ROUTER_QUEUE_MAX_TENANT_DEPTH requests waiting here already is refused at once, as is any past
ROUTER_QUEUE_MAX_DEPTH waiting here in all; a request still here after its maximum
wait is shed as one that waited in the queue (`ArrivalTimeout`). A client that goes away leaves
at once.

While the shared state cannot be reached (`bypass()`: Redis failed within its timeout), nobody
waits here: each request would only wait behind the others' Redis timeouts, one place at a time,
before failing on its own. `let_everyone_through` sends those already waiting on, holding no
place, and new arrivals pass without one, so each meets its own timeout at once, as it would
without the gate.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
import weakref
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from django.conf import settings

from routing.admission.queue import QueueFull

# Passes through the gate kept for its drain rate (a Retry-After for what it turns away).
DRAIN_WINDOW_S = 10.0


class ArrivalTimeout(Exception):
    """A request waited its whole maximum wait at the gate."""

    def __init__(self, waited_s: float, ahead: int, drain_per_s: float) -> None:
        self.waited_s = waited_s
        self.ahead = ahead
        self.drain_per_s = drain_per_s
        super().__init__(f"waited {waited_s:.1f} s at the arrival gate")


@dataclass(frozen=True)
class Bounds:
    """What the gate holds (the admission queue's own bounds): at most `max_depth` waiting in all
    and `max_flow_depth` of one flow (a tenant's requests at one priority), each for at most
    `max_wait_s`."""

    max_wait_s: float
    max_depth: int
    max_flow_depth: int


# A waiter's turn resolves to PLACED (it holds a place now) or UNPLACED (it goes on without one).
PLACED, UNPLACED = True, False


@dataclass(order=True)
class _Waiter:
    band: int  # minus the priority: the heap's smallest leaves first
    start: float  # the tenant's start tag within the band (0: arrival order)
    seq: int
    flow: tuple[str, int] = field(compare=False)  # tenant and priority
    turn: asyncio.Future[bool] = field(compare=False)


class ArrivalGate:
    """At most `width` requests at work at once; the rest wait in the queue's order (see the module).

    One per process and event loop; not thread-safe (it is only used on its loop).
    """

    def __init__(self, width: int) -> None:
        if width < 1:
            raise ValueError(f"the arrival gate lets at least one request through, not {width}")
        self.width = width
        self._working = 0
        self._heap: list[_Waiter] = []
        self._seq = itertools.count()
        self._waiting: Counter[tuple[str, int]] = Counter()  # by flow
        # Start-time fair queuing per band: each tenant's last finish tag and the band's virtual
        # time (the start tag of the last request let through); forgotten whenever none wait.
        self._finish: dict[tuple[int, str], float] = {}
        self._virtual: dict[int, float] = {}
        self._passed: deque[float] = deque()
        self.unplaced = 0  # requests let through without a place (the shared state out of reach)

    @property
    def working(self) -> int:
        """Places held now (requests at their arrival work)."""
        return self._working

    @property
    def waiting(self) -> int:
        return sum(self._waiting.values())

    def drain_per_s(self) -> float:
        """Requests let through per second lately."""
        self._trim(time.monotonic())
        return len(self._passed) / DRAIN_WINDOW_S

    @contextlib.asynccontextmanager
    async def turn(
        self,
        tenant: str,
        priority: int,
        weight: float,
        bounds: Bounds,
        on_wait: Callable[[int], None] = lambda n: None,
        bypass: Callable[[], bool] = lambda: False,
    ) -> AsyncIterator[None]:
        """Hold one of the gate's places for the block, waiting in order for it if none is free;
        QueueFull (the queue's own refusal) at once past a bound, ArrivalTimeout after
        `bounds.max_wait_s` of waiting. `on_wait(1)` when the request starts waiting,
        `on_wait(-1)` when it stops, however. While `bypass()`, the request goes on without a
        place (see the module)."""
        if self._working < self.width:
            # A free place means nobody waits alive (a place that frees goes to the first who
            # does): what the heap still holds left already.
            self._heap.clear()
            self._working += 1
            placed = PLACED
        elif bypass():
            placed = UNPLACED
        else:
            placed = await self._wait((tenant, int(priority)), weight, bounds, on_wait)
        if placed is UNPLACED:
            self.unplaced += 1
        now = time.monotonic()
        self._passed.append(now)
        self._trim(now)
        try:
            yield
        finally:
            if placed is PLACED:
                self._release()

    def let_everyone_through(self) -> None:
        """Send every waiting request on without a place (the shared state is out of reach)."""
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if not waiter.turn.done():
                waiter.turn.set_result(UNPLACED)

    async def _wait(
        self, flow: tuple[str, int], weight: float, bounds: Bounds, on_wait: Callable[[int], None]
    ) -> bool:
        """Wait for a turn: PLACED or UNPLACED."""
        if self._waiting[flow] >= bounds.max_flow_depth:
            raise QueueFull("tenant", self._waiting[flow], self.drain_per_s())
        if self.waiting >= bounds.max_depth:
            raise QueueFull("total", self.waiting, self.drain_per_s())
        tenant, priority = flow
        start = 0.0
        band = -priority
        if weight > 0:
            virtual = self._virtual.get(band, 0.0)
            start = max(virtual, self._finish.get((band, tenant), virtual))
            self._finish[(band, tenant)] = start + 1.0 / weight
        waiter = _Waiter(band, start, next(self._seq), flow, asyncio.get_running_loop().create_future())
        heapq.heappush(self._heap, waiter)
        self._waiting[flow] += 1
        started = time.monotonic()
        on_wait(1)
        try:
            # asyncio.wait, not wait_for: on Python 3.11 wait_for loses a cancellation that comes
            # as the turn is given (the place would stay taken by a request that is gone).
            done, _ = await asyncio.wait({waiter.turn}, timeout=bounds.max_wait_s)
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        finally:
            self._left(waiter)
            on_wait(-1)
        if not done:
            self._abandon(waiter)
            raise ArrivalTimeout(time.monotonic() - started, self._ahead_of(waiter), self.drain_per_s())
        return waiter.turn.result()

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiter goes: a place already handed to it passes on, else it is skipped."""
        if waiter.turn.done() and not waiter.turn.cancelled():
            if waiter.turn.result() is PLACED:
                self._release()
        else:
            waiter.turn.cancel()

    def _left(self, waiter: _Waiter) -> None:
        self._waiting[waiter.flow] -= 1
        if not self._waiting[waiter.flow]:
            del self._waiting[waiter.flow]

    def _release(self) -> None:
        """A place frees: it goes to the first waiter still there, else it is given back."""
        while self._heap:
            waiter = heapq.heappop(self._heap)
            if waiter.turn.done():  # gone (cancelled, timed out)
                continue
            self._virtual[waiter.band] = waiter.start
            waiter.turn.set_result(PLACED)
            return
        self._working -= 1
        self._finish.clear()  # nobody waits: every tenant starts afresh
        self._virtual.clear()

    def _ahead_of(self, waiter: _Waiter) -> int:
        return sum(1 for other in self._heap if other < waiter and not other.turn.done())

    def _trim(self, now: float) -> None:
        while self._passed and self._passed[0] < now - DRAIN_WINDOW_S:
            self._passed.popleft()


_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ArrivalGate] = weakref.WeakKeyDictionary()


def arrival_gate() -> ArrivalGate:
    """The running event loop's gate (one per process in a deployment), FRONTEND_ARRIVAL_CONCURRENCY
    wide."""
    loop = asyncio.get_running_loop()
    width = settings.FRONTEND_ARRIVAL_CONCURRENCY
    gate = _gates.get(loop)
    if gate is None or gate.width != width:
        gate = _gates[loop] = ArrivalGate(width)
    return gate
