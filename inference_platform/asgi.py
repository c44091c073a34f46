"""ASGI entry point: Django's HTTP app under Channels' protocol router."""

from __future__ import annotations

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

django_asgi_app = get_asgi_application()

application = ProtocolTypeRouter({"http": django_asgi_app})
