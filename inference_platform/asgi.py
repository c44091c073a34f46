"""ASGI entry point: Django's HTTP app under Channels' protocol router.

`/v1/*` goes to `ApiHandler` (the API's views behind the API's middleware only, see
inference_platform/api/handler.py); everything else to Django's handler with the full stack."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

from channels.routing import ProtocolTypeRouter
from django.conf import settings
from django.core.asgi import get_asgi_application

from inference_platform.api.boundary import RequestBodyLimit, is_api_path

django_asgi_app = get_asgi_application()

from inference_platform.api.handler import ApiHandler  # noqa: E402 - needs the apps loaded

api_asgi_app = ApiHandler()

from inference_platform.serving.prepare import check_served_model  # noqa: E402 - needs the apps loaded

# Image settings the model's processor refuses stop the start-up here, with the reason.
check_served_model()

from django.core.exceptions import ImproperlyConfigured  # noqa: E402
from django.db import DatabaseError  # noqa: E402

from inference_platform.metrics import frontend_source  # noqa: E402  (needs the app set up)
from routing.deployment import statistics_namespace  # noqa: E402
from routing.observe import telemetry  # noqa: E402
from routing.state.redis_keys import sync_client  # noqa: E402

# This frontend's request metrics go to the deployment's Redis, where /metrics sums them, under
# its database's deployment id (so another deployment on the same Redis never adds to them).
try:
    _statistics = statistics_namespace()  # made on first use: the database must be migrated
except DatabaseError as exc:
    raise ImproperlyConfigured(
        f"the frontend cannot read its deployment id from the database ({exc}): "
        "run `manage.py migrate` before starting it (`make run` does)"
    ) from exc
telemetry.attach(sync_client(settings.REDIS_URL), _statistics, frontend_source())

if not settings.API_AUTH_REQUIRED:
    import logging

    logging.getLogger("inference_platform").warning(
        "API AUTHENTICATION IS OFF (API_AUTH_REQUIRED=0): anyone who reaches this server can call "
        "every /v1/ endpoint, the operators' ones included. Only for a local demo."
    )


async def http_app(scope, receive, send) -> None:
    handler = api_asgi_app if is_api_path(scope.get("path", "")) else django_asgi_app
    await handler(scope, receive, send)


application = ProtocolTypeRouter({"http": RequestBodyLimit(http_app, settings.API_MAX_BODY_BYTES)})

# What the start-up made (Django's and the project's modules, classes, functions, settings: ~96,000
# objects the collector tracks) lives as long as the process. Frozen, no collection walks it
# again: a full collection of a frontend just started took 28 ms of its event loop here, every
# request in flight waiting, and ~0 ms frozen (docs/decisions/2026-12-07-paced-fleet-reads.md).
gc.freeze()
