"""ASGI entry point: Django's HTTP app under Channels' protocol router."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

from channels.routing import ProtocolTypeRouter
from django.conf import settings
from django.core.asgi import get_asgi_application

from inference_platform.api.boundary import RequestBodyLimit

django_asgi_app = get_asgi_application()

application = ProtocolTypeRouter({"http": RequestBodyLimit(django_asgi_app, settings.API_MAX_BODY_BYTES)})
