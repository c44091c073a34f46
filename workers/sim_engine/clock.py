"""The one clock that steps every simulated engine of a process.

Each engine with work is on a heap by the time its current step ends; the clock ends that step
(its tokens appear, its blocks are cached and announced), asks the engine for its next one and
puts it back at now + the step's modelled time. One thread serves a thousand engines: an idle
engine costs nothing, and a step costs only the scheduler's bookkeeping.

Two kinds of time:
- scaled real time (`SimClock(speedup=s)`, what `run_worker --engine sim` runs): simulated time is
  wall time × s since the clock started, as Dynamo's mocker does, and a request arrives at the
  simulated time it is submitted. A busy engine's steps follow one another on the simulated
  timeline, each starting where the one before ended, and a request joins the first step that
  starts after it arrived. A step's results land no earlier than its end ÷ s of wall time, later
  if the process lags (a busy machine, a thousand engines): its tokens then reach the client late,
  but the times the engine reports (TTFT, total) are the model's, not the machine's. Real
  frontends, Celery and Redis run against it unchanged.
- virtual time (`SimClock(speedup=None)`): `run_until_idle` jumps from one step's end to the
  next, with no waiting; replays and tests, where one thread submits everything first.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from typing import Protocol


class Steppable(Protocol):
    def begin_step(self, start: float) -> float | None:
        """Plans the next step, starting at simulated time `start`: its modelled seconds (or the
        wait until work that arrives later), or None when there is nothing to do."""

    def end_step(self, end: float) -> None:
        """The planned step's results (tokens, cached blocks) land, at simulated time `end`."""


class SimClock:
    def __init__(self, speedup: float | None = 1.0) -> None:
        if speedup is not None and speedup <= 0:
            raise ValueError("speedup must be > 0 (None: virtual time)")
        self.speedup = speedup
        self._origin = time.monotonic()
        self._virtual_now = 0.0
        self._heap: list[tuple[float, int, Steppable]] = []
        self._tie = itertools.count()
        self._scheduled: set[int] = set()  # engines on the heap or being stepped
        self._stepping: dict[int, bool] = {}  # engine in a step -> woken meanwhile
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._virtual_in_step: set[int] = set()  # engines whose planned step the virtual clock ends

    @property
    def virtual(self) -> bool:
        return self.speedup is None

    def now(self) -> float:
        """Simulated seconds since the clock started."""
        if self.speedup is None:
            return self._virtual_now
        return (time.monotonic() - self._origin) * self.speedup

    def wake(self, engine: Steppable, at: float | None = None) -> None:
        """The engine has new work, which arrived at `at` (default: now): an idle engine's next
        step starts then (a busy one's at its current step's end)."""
        with self._cond:
            key = id(engine)
            if key in self._stepping:
                self._stepping[key] = True
            elif key not in self._scheduled:
                self._scheduled.add(key)
                heapq.heappush(self._heap, (self.now() if at is None else at, next(self._tie), engine))
                self._cond.notify()

    def _step(self, engine: Steppable, in_step: bool, at: float) -> float | None:
        if in_step:
            engine.end_step(at)
        return engine.begin_step(at)

    # --- virtual time ---------------------------------------------------------------------------------
    def run_next(self) -> bool:
        """Virtual time: ends the earliest step and plans that engine's next; False when no engine
        has work. A caller may submit between calls (a closed-loop client, say)."""
        if self.speedup is not None:
            raise RuntimeError("run_next is for a virtual clock")
        if not self._heap:
            return False
        due, _, engine = heapq.heappop(self._heap)
        self._virtual_now = max(self._virtual_now, due)
        key = id(engine)
        seconds = self._step(engine, key in self._virtual_in_step, self._virtual_now)
        if seconds is None:
            self._virtual_in_step.discard(key)
            self._scheduled.discard(key)
        else:
            self._virtual_in_step.add(key)
            heapq.heappush(self._heap, (self._virtual_now + seconds, next(self._tie), engine))
        return True

    def run_until_idle(self) -> float:
        """Virtual time: steps every engine until none has work; returns the simulated time then."""
        while self.run_next():
            pass
        return self._virtual_now

    # --- scaled real time -----------------------------------------------------------------------------
    def start(self) -> SimClock:
        if self.speedup is None:
            raise RuntimeError("a virtual clock is run with run_until_idle")
        self._thread = threading.Thread(target=self._run, name="sim-clock", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        in_step: set[int] = set()
        speedup = self.speedup or 1.0
        while True:
            with self._cond:
                while not self._stopped:
                    if self._heap:
                        wait = (self._heap[0][0] - self.now()) / speedup
                        if wait <= 0:
                            break
                        self._cond.wait(wait)
                    else:
                        self._cond.wait()
                if self._stopped:
                    return
                due, _, engine = heapq.heappop(self._heap)
                key = id(engine)
                self._stepping[key] = False
            # The step ends, and the next begins, at its due time however late this thread is.
            seconds = self._step(engine, key in in_step, due)
            with self._cond:
                woken = self._stepping.pop(key)
                if seconds is None and woken:  # work came while it found none: look again now
                    in_step.discard(key)
                    heapq.heappush(self._heap, (max(due, self.now()), next(self._tie), engine))
                elif seconds is None:
                    in_step.discard(key)
                    self._scheduled.discard(key)
                else:
                    in_step.add(key)
                    heapq.heappush(self._heap, (due + seconds, next(self._tie), engine))
