"""The Django project (the design card's `platform/`): settings, URLs, ASGI, Celery, the chat API."""

from inference_platform.celery import app as celery_app

__all__ = ["celery_app"]
