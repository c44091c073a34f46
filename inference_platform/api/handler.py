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

`asgi.py` sends `/v1/*` here and everything else (admin, dashboard, `/metrics`, static files) to
Django's handler with the full `MIDDLEWARE`.
"""

from __future__ import annotations

from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponse
from django.middleware.security import SecurityMiddleware

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
    calls (the signals, a key not yet verified, closing the response) share asgiref's one
    thread; the rest of the request's blocking work goes to the event loop's executor as before.
    """

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    def load_middleware(self, is_async: bool = False) -> None:
        if not is_async:  # an ASGIHandler always loads its chain for async
            raise ValueError("ApiHandler serves ASGI only")
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        view = convert_exception_to_response(self._get_response_async)
        self._middleware_chain = convert_exception_to_response(ApiSecurityMiddleware(view))
