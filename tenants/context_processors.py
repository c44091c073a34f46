"""What every admin page needs to know about API authentication (the warning when it is off)."""

from __future__ import annotations

from django.conf import settings
from django.http import HttpRequest


def api_auth(request: HttpRequest) -> dict[str, bool]:
    return {"api_auth_off": not settings.API_AUTH_REQUIRED}
