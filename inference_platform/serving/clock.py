"""What the frontend records about each chat request: status, worker, tokens, TTFT, latency.

The view makes one `RequestClock` when the request arrives, marks the first token, and calls
`finish` exactly once, whatever the outcome; `routing.observe.telemetry` sums it across frontends.
"""

from __future__ import annotations

import time

from routing.contract.tasks import DoneEvent
from routing.observe import telemetry

NO_WORKER = "none"


class RequestClock:
    def __init__(self) -> None:
        self._started = time.monotonic()
        self._first_token: float | None = None
        self._finished = False

    def first_token(self) -> None:
        if self._first_token is None:
            self._first_token = time.monotonic()

    def finish(self, status: int, worker: str | None, done: DoneEvent | None = None) -> None:
        """Record the request once: its status, and for a served one its tokens and latencies."""
        if self._finished:
            return
        self._finished = True
        now = time.monotonic()
        worker = worker or NO_WORKER
        telemetry.inc("requests", labels={"status": str(status), "worker": worker})
        if worker == NO_WORKER:
            return
        labels = {"worker": worker}
        telemetry.observe("request_duration_seconds", now - self._started, labels=labels)
        if self._first_token is not None:
            telemetry.observe("ttft_seconds", self._first_token - self._started, labels=labels)
        if done is not None:
            telemetry.inc("prompt_tokens", done.prompt_tokens, labels=labels)
            telemetry.inc("cached_prompt_tokens", done.cached_tokens, labels=labels)
            telemetry.inc("completion_tokens", done.completion_tokens, labels=labels)
