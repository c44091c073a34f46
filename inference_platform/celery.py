"""The Celery app: Redis broker, JSON only, configured from Django settings (CELERY_*)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")

app = Celery("inference_platform")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

# The task names the web process dispatches by (it never imports the worker's code) are in
# routing.contract.tasks, with the payloads.
