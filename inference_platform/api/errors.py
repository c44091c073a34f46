"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import logging

from django.http import JsonResponse

from inference_platform.serving.errors import ApiError

__all__ = ["ApiError", "error_response"]

logger = logging.getLogger("inference_platform.api")


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
