"""Celery tasks of the worker process. They only unpack arguments: the work is in workers.runtime.

Celery's autodiscovery imports this module in every process, the web included, so the
engine (torch) is imported lazily, inside the task.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task


@shared_task(name="workers.generate", ignore_result=True)
def generate(payload: dict[str, Any]) -> None:
    from workers.runtime import current_runtime

    current_runtime().serve(payload)


@shared_task(name="workers.flush_caches", ignore_result=True)
def flush_caches(payload: dict[str, Any]) -> None:
    from workers.runtime import current_runtime

    current_runtime().flush(payload)
