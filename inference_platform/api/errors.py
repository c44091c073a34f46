"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.http import JsonResponse

logger = logging.getLogger("inference_platform.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


@dataclass
class ApiError(Exception):
    status: int
    message: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # e.g. Retry-After on a 429 or 503

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_response(error: ApiError, request_id: str | None = None) -> JsonResponse:
    level = logging.WARNING if error.status >= 500 else logging.INFO
    logger.log(
        level, "request %s failed with %s %s: %s", request_id or "-", error.status, error.code, error.message
    )
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    if request_id:
        response["X-Request-Id"] = request_id
    for name, value in error.headers.items():
        response[name] = value
    return response
