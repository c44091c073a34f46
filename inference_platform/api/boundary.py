"""The API's edge: what a `/v1/*` request must be before any view looks at it.

Two layers, because the body limit must hold while the body is read and Django reads the whole
body before any view or middleware runs:
- `RequestBodyLimit` (ASGI) refuses a `/v1/*` body over `API_MAX_BODY_BYTES` from its declared
  length, or as soon as the bytes received cross it, without reading the rest;
- `json_endpoint` (a view decorator) checks the method (405), the content type (415: only
  `application/json`, so a browser's cross-site "simple" POST cannot start a generation here),
  the size again (413, for clients that bypass the ASGI layer) and the JSON itself (400, nesting
  bounded), and hands the view a parsed object.
Every refusal is in OpenAI's error format.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse

from inference_platform.api.chat_request import parse_json_body
from inference_platform.api.errors import ApiError, error_response
from inference_platform.serving.clock import record_http_response, route_of

logger = logging.getLogger("inference_platform.api")

API_PREFIX = "/v1"
JSON_CONTENT_TYPE = "application/json"


def is_api_path(path: str) -> bool:
    return path == API_PREFIX or path.startswith(API_PREFIX + "/")


def body_too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is over the {limit}-byte limit. Send large images by URL, or smaller.",
        code="request_too_large",
    )


# --- the ASGI layer --------------------------------------------------------------------------------
class RequestBodyLimit:
    """ASGI middleware: a `/v1/*` request body is read into memory only up to the limit."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit_bytes: int) -> None:
        self.app = app
        self.limit = limit_bytes

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] != "http" or not is_api_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared is not None and declared > self.limit:
            await self._refuse(send, scope["path"])
            return
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            received += len(message.get("body", b""))
            if received > self.limit:
                await self._refuse(send, scope["path"])
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then the client's disconnect, as Django listens for it

        await self.app(scope, replay, send)

    async def _refuse(self, send, path: str) -> None:
        record_http_response(route_of(path), 413)  # refused before Django sees it: counted here
        error = body_too_large(self.limit)
        logger.info("request refused with 413: body over %d bytes", self.limit)
        body = json.dumps(error.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


def _declared_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


# --- the view layer --------------------------------------------------------------------------------
def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


JsonView = Callable[[HttpRequest, dict[str, Any], str], Awaitable[HttpResponse]]


def json_endpoint(view: JsonView) -> Callable[[HttpRequest], Awaitable[HttpResponse]]:
    """A POST endpoint taking a JSON object: the view gets (request, body, request_id)."""

    @functools.wraps(view)
    async def endpoint(request: HttpRequest) -> HttpResponse:
        request_id = new_request_id()
        try:
            if request.method != "POST":
                response = error_response(
                    ApiError(405, f"Use POST for {request.path}.", code="method_not_allowed"), request_id
                )
                response["Allow"] = "POST"
                return response
            if request.content_type != JSON_CONTENT_TYPE:
                shown = request.content_type or "none"
                raise ApiError(
                    415,
                    f"The request body must be {JSON_CONTENT_TYPE}; got {shown}.",
                    code="unsupported_media_type",
                )
            try:
                raw = request.body
            except RequestDataTooBig:
                raise body_too_large(settings.API_MAX_BODY_BYTES) from None
            body = parse_json_body(raw)
        except ApiError as error:
            return error_response(error, request_id)
        return await view(request, body, request_id)

    endpoint.csrf_exempt = True  # an API called with JSON bodies, never from a browser form
    return endpoint


def only_get(view: Callable[[HttpRequest], HttpResponse]) -> Callable[[HttpRequest], HttpResponse]:
    """A read-only API endpoint: any other method is a 405 in the API's format."""

    @functools.wraps(view)
    def endpoint(request: HttpRequest) -> HttpResponse:
        if request.method not in ("GET", "HEAD"):
            response = error_response(
                ApiError(405, f"Use GET for {request.path}.", code="method_not_allowed"), new_request_id()
            )
            response["Allow"] = "GET, HEAD"
            return response
        return view(request)

    endpoint.csrf_exempt = True
    return endpoint
