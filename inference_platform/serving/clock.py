"""What the frontend records about each chat request: status, worker, tokens, TTFT, latency;
and about every answer of the API's edge, refusals included (`http_requests`).

The view makes one `RequestClock` when the request arrives, marks the first token, and calls
`finish` exactly once, whatever the outcome; `routing.observe.telemetry` sums it across frontends.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from django.http import HttpRequest, HttpResponse

from routing.contract.tasks import DoneEvent
from routing.observe import telemetry

NO_WORKER = "none"
NO_MODEL = "none"


class RequestClock:
    def __init__(self) -> None:
        self._started = time.monotonic()
        self._first_token: float | None = None
        self._finished = False

    def first_token(self) -> None:
        if self._first_token is None:
            self._first_token = time.monotonic()

    def finish(
        self, status: int, worker: str | None, done: DoneEvent | None = None, model: str | None = None
    ) -> None:
        """Record the request once: its status, and for a served one its tokens and latencies;
        `model`: the known model it named (never a client's free text: a bounded label)."""
        if self._finished:
            return
        self._finished = True
        now = time.monotonic()
        worker, model = worker or NO_WORKER, model or NO_MODEL
        telemetry.inc("requests", labels={"status": str(status), "worker": worker, "model": model})
        if worker == NO_WORKER:
            return
        labels = {"worker": worker, "model": model}
        telemetry.observe("request_duration_seconds", now - self._started, labels=labels)
        if self._first_token is not None:
            telemetry.observe("ttft_seconds", self._first_token - self._started, labels=labels)
        if done is not None:
            telemetry.inc("prompt_tokens", done.prompt_tokens, labels=labels)
            telemetry.inc("cached_prompt_tokens", done.cached_tokens, labels=labels)
            telemetry.inc("completion_tokens", done.completion_tokens, labels=labels)


UNMATCHED = "unmatched"


def route_of(path: str) -> str:
    """The route pattern serving `path` ("unmatched" if none): a bounded label, never the path,
    which a client chooses (`/v1/models/<anything>`)."""
    from django.urls import Resolver404, resolve

    try:
        match = resolve(path)
    except Resolver404:
        return UNMATCHED
    return "/" + match.route


def handler_of(request: HttpRequest) -> str:
    """The route pattern that served the request (resolved already, but for a 404)."""
    match = getattr(request, "resolver_match", None)
    return "/" + match.route if match is not None else route_of(request.path)


def record_http_response(handler: str, status: int) -> None:
    """One answer of the API's edge (or /metrics), whoever wrote it."""
    telemetry.inc("http_requests", labels={"handler": handler, "status": str(status)})


def counts_http_responses(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """A synchronous view outside /v1/* (/metrics) counted in `http_requests` like the API."""

    @functools.wraps(view)
    def counted(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = view(request, *args, **kwargs)
        record_http_response(handler_of(request), response.status_code)
        return response

    return counted


def counts_refused_chat_requests(
    view: Callable[..., Awaitable[HttpResponse]],
) -> Callable[..., Awaitable[HttpResponse]]:
    """The chat endpoint's refusals at the edge (401 no or wrong key, 415 not JSON, 413, 405, a
    body that is not JSON) counted in `requests` as the view counts its own answers: the view
    sets `request.request_clock` once it runs, and then counts the request itself."""

    @functools.wraps(view)
    async def counted(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        response = await view(request, *args, **kwargs)
        if getattr(request, "request_clock", None) is None:
            RequestClock().finish(response.status_code, None)
        return response

    return counted
