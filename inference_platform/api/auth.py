"""Who is calling: the `Authorization: Bearer` key checked at the edge, once, by a decorator.

Views wrapped here find the caller in `request.caller` (a tenants.keys.Caller). Refusals are
OpenAI-style errors (401 for a missing or bad key, 403 for a tenant key on an operator
endpoint); the key itself is never logged or echoed, only its public prefix.
"""

from __future__ import annotations

import functools
import hmac
import logging
from collections.abc import Callable
from typing import Any

from asgiref.sync import iscoroutinefunction
from channels.db import database_sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from inference_platform.api.errors import ApiError, error_response
from inference_platform.serving.frontend import frontend
from tenants.keys import ANONYMOUS, Caller, KeyRefused, authenticate, averified_caller

logger = logging.getLogger("inference_platform.api")

_MISSING = (
    "You didn't provide an API key. Send it in an Authorization header: 'Authorization: Bearer sk-...'. "
    "Operators create keys in the admin or with `manage.py api_keys create`."
)


_NOT_BEARER = (
    "The Authorization header must be 'Bearer <key>' (e.g. 'Authorization: Bearer sk-...'); "
    "this one does not start with 'Bearer'."
)


def _presented_key(request: HttpRequest) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, credentials = header.partition(" ")
    if scheme.lower() != "bearer" or not credentials.strip():
        return None
    return credentials.strip()


def _missing_key_error(request: HttpRequest) -> ApiError:
    """No key found: a header that holds one without its scheme (`Authorization: sk-...`, a
    common slip) is told what the header must look like, not that no key came."""
    header = request.headers.get("Authorization", "").strip()
    if header and header.partition(" ")[0].lower() != "bearer":
        return ApiError(401, _NOT_BEARER, code="missing_api_key")  # no key in the form asked for
    return ApiError(401, _MISSING, code="missing_api_key")


def _metrics_token_matches(presented: str | None) -> bool:
    token = settings.METRICS_TOKEN
    return bool(token and presented and hmac.compare_digest(presented.encode(), token.encode()))


def identify(request: HttpRequest, *, operator: bool = False, metrics_token: bool = False) -> Caller:
    """The caller of this request, or ApiError (401/403). Synchronous: it reads the database."""
    presented = _presented_key(request)
    if metrics_token and _metrics_token_matches(presented):
        return Caller(
            tenant_id=None, tenant_name="metrics-token", key_prefix=None, staff=True, partition=None
        )
    if presented is None:
        if not settings.API_AUTH_REQUIRED:
            return ANONYMOUS
        raise _missing_key_error(request)
    try:
        caller = authenticate(presented)
    except KeyRefused as refused:
        raise ApiError(401, str(refused), code="invalid_api_key") from None
    return _allowed(request, caller, operator=operator, metrics_token=metrics_token)


async def aidentify(request: HttpRequest, *, operator: bool = False, metrics_token: bool = False) -> Caller:
    """`identify` on the event loop: a key verified lately is known there, without a thread
    (tenants.keys.averified_caller); any other is checked by `identify`, in Django's thread, its
    connections tidied around it (inference_platform.api.handler sends no request signal)."""
    presented = _presented_key(request)
    if presented is not None and not (metrics_token and _metrics_token_matches(presented)):
        caller = await averified_caller(presented, frontend().redis_lines())
        if caller is not None:
            return _allowed(request, caller, operator=operator, metrics_token=metrics_token)
    return await database_sync_to_async(identify)(request, operator=operator, metrics_token=metrics_token)


def _allowed(request: HttpRequest, caller: Caller, *, operator: bool, metrics_token: bool) -> Caller:
    """The caller, if what it asks is open to it; else the 403."""
    if operator and not caller.staff:
        raise ApiError(
            403,
            f"{request.path} is for operators: it needs a staff key"
            + (" or the metrics token." if metrics_token else "."),
            code="operator_only",
        )
    return caller


def api_key_required(
    view: Callable | None = None, *, operator: bool = False, metrics_token: bool = False
) -> Callable:
    """Decorate a view (sync or async) so it runs only for an authenticated caller."""

    def decorate(view: Callable) -> Callable:
        if iscoroutinefunction(view):

            @functools.wraps(view)
            async def async_wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
                try:
                    request.caller = await aidentify(request, operator=operator, metrics_token=metrics_token)
                except ApiError as error:
                    return _refused(error)
                return await view(request, *args, **kwargs)

            return async_wrapper

        @functools.wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                request.caller = identify(request, operator=operator, metrics_token=metrics_token)
            except ApiError as error:
                return _refused(error)
            return view(request, *args, **kwargs)

        return wrapper

    return decorate(view) if view is not None else decorate


def _refused(error: ApiError) -> HttpResponse:
    response = error_response(error)
    if error.status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="api"'
    return response
