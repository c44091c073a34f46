"""Django for `/v1/*`: the same URLs and views as the admin's, behind only the middleware an API
call needs.

Django's own middleware is written for synchronous code: under ASGI each one moves every request
to a thread and back, twice (its `process_request`, then its `process_response`). The admin's
stack (sessions, CSRF, authentication, messages, clickjacking, trailing slashes) is six of them,
twelve hand-overs between threads on every chat completion for features an API call does not
use: it carries a bearer key (checked by `api_key_required`), no cookie, no form, and its
answers are JSON or an event stream (and one page, `/v1/docs`, kept from frames). What it does
need of that stack are the security headers and the HTTPS redirect, which
`ApiSecurityMiddleware` applies on the event loop (both are header reads and writes, no I/O).

Nor does an API request hand itself to Django's thread for the request signals. Django's handler
sends `request_started` and `request_finished` through a thread, twice per request: their
receivers (Django's own: `reset_queries`, `close_old_connections`, `close_caches`) tidy the
database connections and query log of the thread they run in, asgiref's thread-sensitive one. A
chat completion with a key verified lately never uses that thread, and the two hand-overs were
~6% of its CPU in the frontend (bench/frontend_cpu.py). So `ApiHandler` sends neither signal, as
Channels' consumers send none, and the API does that tidying where its connections are: around
each database call, in the thread that makes it (`database_sync_to_async`, its synchronous views
included). The query log, kept only with DEBUG and bounded, is not emptied per API request. A
receiver connected to those signals hears of admin and dashboard requests, not of `/v1/*` ones.

`asgi.py` sends `/v1/*` here and everything else (admin, dashboard, `/metrics`, static files) to
Django's handler with the full `MIDDLEWARE`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from asgiref.sync import iscoroutinefunction
from channels.db import database_sync_to_async
from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.middleware.security import SecurityMiddleware
from django.urls import set_script_prefix

from inference_platform.serving.clock import handler_of, record_http_response


class ApiSecurityMiddleware(SecurityMiddleware):
    """Django's SecurityMiddleware (HTTPS redirect, HSTS, nosniff, referrer and opener policies)
    without the thread hops: both of its hooks only read and write headers. A page (`/v1/docs`)
    also may not be framed, as the admin's clickjacking middleware would have it."""

    async def __acall__(self, request: HttpRequest) -> HttpResponse:
        response = self.process_request(request)
        if response is None:
            response = await self.get_response(request)
        # Every answer of the API, refusals included (a wrong key is otherwise seen nowhere).
        record_http_response(handler_of(request), response.status_code)
        return self.process_response(request, response)

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        response = super().process_response(request, response)
        if response.get("Content-Type", "").startswith("text/html"):
            response.headers.setdefault("X-Frame-Options", settings.X_FRAME_OPTIONS)
        return response


class ApiHandler(ASGIHandler):
    """An ASGI handler whose middleware chain is `ApiSecurityMiddleware` alone, and that gives no
    request a thread of its own.

    Django's handler runs each request in a `ThreadSensitiveContext`: its first thread-sensitive
    hand-over (the `request_started` signal's receivers, on every request) starts a thread for
    that request alone, and the request's end joins it. That is most of what an API request
    that is refused at once costs the frontend (a thread started and joined, ~1 ms of CPU), and
    under a flood it is what the flood costs everyone else. Here the API's few thread-sensitive
    calls (a key not yet verified, a synchronous view) share asgiref's one thread; the rest of the
    request's blocking work goes to the event loop's executor as before. Nor are the request
    signals sent, through that thread or at all (see the module's docstring).
    """

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send) -> None:
        """Django's `ASGIHandler.handle` less its two hand-overs to a thread: the request is
        answered while a disconnect is listened for (a client that leaves cancels the view, as
        in Django), and no request signal is sent."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        try:
            set_script_prefix(get_script_prefix(scope))
            request, error_response = self.create_request(scope, body_file)
            if request is None:
                await self.send_response(error_response, send)
                _close(error_response)
                return
            await self._answer_unless_gone(request, receive, send)
        finally:
            body_file.close()

    async def _answer_unless_gone(self, request: HttpRequest, receive, send) -> None:
        async def answer() -> HttpResponseBase:
            response = await self.run_get_response(request)
            with contextlib.suppress(asyncio.CancelledError):  # the client left while it was sent
                await self.send_response(response, send)
            return response

        listening = asyncio.create_task(self.listen_for_disconnect(receive))
        answering = asyncio.create_task(answer())
        await asyncio.wait((listening, answering), return_when=asyncio.FIRST_COMPLETED)
        # The listener first: it raises nothing unexpected that would keep the view from its end.
        for task in (listening, answering):
            if task.done():
                with contextlib.suppress(RequestAborted):  # the client left
                    task.result()
            else:
                task.cancel()  # the view hears of it (a ServedRequest closes as CLIENT_CLOSED)
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if not answering.cancelled():
            _close(answering.result())

    def make_view_atomic(self, view: Callable) -> Callable:
        """A synchronous view of the API (`/v1/models`, `/v1/docs`) runs in Django's thread with
        that thread's connections tidied around it, as Django's request signals would: through
        `database_sync_to_async`, as the API's other database calls."""
        view = super().make_view_atomic(view)
        return view if iscoroutinefunction(view) else database_sync_to_async(view)

    def load_middleware(self, is_async: bool = False) -> None:
        if not is_async:  # an ASGIHandler always loads its chain for async
            raise ValueError("ApiHandler serves ASGI only")
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        view = convert_exception_to_response(self._get_response_async)
        self._middleware_chain = convert_exception_to_response(ApiSecurityMiddleware(view))


def _close(response: HttpResponseBase) -> None:
    """`response.close()` without its `request_finished` signal: the response's own resources
    (a file it streams) closed. The API's answers hold none today; a FileResponse would."""
    for closer in response._resource_closers:
        with contextlib.suppress(Exception):  # as Django's: one closer's failure stops no other
            closer()
    response._resource_closers.clear()
    response.closed = True
