"""Celery tasks of the worker process. They only unpack arguments: the work is in workers.runtime.

The names and payloads are routing.contract.tasks's (`GenerateTask`, `FlushCachesTask`); the
runtime checks a payload's contract version before it reads anything else.

Celery's autodiscovery imports this module in every process, the web included, so the
engine (torch) is imported lazily, inside the task.
"""

from __future__ import annotations

from typing import Any

from celery import shared_task

from routing.contract.tasks import ENCODE_TASK, FLUSH_CACHES_TASK, GENERATE_TASK


def _queue(task: Any) -> str | None:
    """The queue the task came from: a process of many simulated workers serves several."""
    return (task.request.delivery_info or {}).get("routing_key")


@shared_task(name=GENERATE_TASK, ignore_result=True, bind=True)
def generate(self, payload: dict[str, Any]) -> None:
    from workers.runtime import current_runtime

    current_runtime(_queue(self)).serve(payload)


@shared_task(name=FLUSH_CACHES_TASK, ignore_result=True, bind=True)
def flush_caches(self, payload: dict[str, Any]) -> None:
    from workers.runtime import current_runtime

    current_runtime(_queue(self)).flush(payload)


@shared_task(name=ENCODE_TASK, ignore_result=True, bind=True)
def encode(self, payload: dict[str, Any]) -> None:
    from workers.runtime import current_runtime

    current_runtime(_queue(self)).serve_encode(payload)
