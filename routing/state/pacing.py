"""Long passes over the fleet that let the event loop in: `paced(fn)` in a thread, `pause_point()`
in the pass's loops.

A frontend reads its fleet again in a thread (inference_platform.serving.dispatch) while its
event loop decides requests. CPython runs one thread's Python at a time, and a re-read of a
thousand workers holds the interpreter for 10-20 ms (their heartbeats parsed, their eligibility,
reports and the decision's packed arguments worked out). A decision whose Redis reply arrives
meanwhile waits for the interpreter: until the pass next lets it go, or for the switch interval
(5 ms) when it does not, and again at the decision's next step. In `bench/fleet.py` at 1,024
workers every decision that overlapped the working out was slower than 1.2 ms, and a fifth to a
half of those slower overlapped a re-read; with re-reads that had nothing new to parse, the p99
was about half (docs/decisions/2026-12-07-paced-fleet-reads.md).

So a paced pass sleeps PAUSE_S each time it has run SLICE_S, at the points its loops offer
(`pause_point()`): a sleeping thread holds no interpreter, and a thread waiting for it takes it.
Outside a paced pass (a request's own work, a worker process) `pause_point()` reads a
thread-local and does nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

SLICE_S = 0.0005  # a paced pass holds the interpreter about this long at a time ...
PAUSE_S = 0.00005  # ... then lets it go this long (the sleep's least: a waiting thread wakes in it)

P = ParamSpec("P")
T = TypeVar("T")

_local = threading.local()


def paced(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` as a paced pass: its `pause_point()`s pause it every SLICE_S.
    For `asyncio.to_thread(paced, fn, ...)`: a pass on the event loop's own thread would only
    sleep it."""
    outer = getattr(_local, "due", None)
    _local.due = time.perf_counter() + SLICE_S
    try:
        return fn(*args, **kwargs)
    finally:
        _local.due = outer


def pause_point() -> None:
    """In a paced pass that has run SLICE_S since it last paused: pause PAUSE_S. Elsewhere,
    nothing. Cheap enough for a loop over a fleet (~0.1 us)."""
    due = getattr(_local, "due", None)
    if due is not None and time.perf_counter() >= due:
        time.sleep(PAUSE_S)
        _local.due = time.perf_counter() + SLICE_S
