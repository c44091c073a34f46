"""A request's refusal or failure as the client will see it: status, OpenAI error fields, headers.

Raised anywhere beneath the HTTP API (serving, preparation, the API's own parsing); the API
turns it into OpenAI's format (`inference_platform.api.errors.error_response`). No Django here,
so the serving pipeline can raise it without importing the HTTP layer above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
