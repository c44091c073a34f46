"""The worker process's state (its engine, name and Redis connections) and how it serves one task.

`run_worker` builds the runtime once, before Celery starts consuming, so the model is loaded
once per process and never forked; the Celery task hands each payload to `serve`.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from routing.responses import DONE, ERROR, STARTED, TOKEN, ResponseWriter

logger = logging.getLogger("workers.runtime")

# How often a running request checks whether the frontend asked it to stop.
_CANCEL_CHECK_INTERVAL_S = 0.25


class NoRuntime(RuntimeError):
    """A task arrived in a process that `run_worker` did not set up."""


@dataclass
class WorkerRuntime:
    name: str
    engine: Any  # workers.engine.Engine; typed loosely so this module imports without torch
    client: redis.Redis
    namespace: str

    def serve(self, payload: dict[str, Any]) -> None:
        from workers.engine import GenerationRequest, ImageInput

        request_id = payload["request_id"]
        writer = ResponseWriter(self.client, self.namespace, request_id)
        if writer.cancelled():
            logger.info("request %s was cancelled before it started", request_id)
            return
        writer.send(STARTED, worker=self.name)
        try:
            request = GenerationRequest(
                request_id=request_id,
                prompt=payload["prompt"],
                images=[_image_input(ImageInput, image) for image in payload.get("images", [])],
                max_tokens=int(payload["max_tokens"]),
                temperature=float(payload["temperature"]),
                top_p=float(payload["top_p"]),
                seed=payload.get("seed"),
                stop=list(payload.get("stop") or []),
                scope_key=payload.get("scope_key"),
            )
            result = self.engine.generate(
                request,
                on_token=lambda text: writer.send(TOKEN, text=text),
                should_stop=_throttled(writer.cancelled, _CANCEL_CHECK_INTERVAL_S),
            )
        except Exception as exc:
            status = getattr(exc, "status", None)
            if isinstance(status, int) and 400 <= status < 500:
                # The request itself was bad (an image the origin refused, say): the client's error.
                writer.send(ERROR, status=status, code=getattr(exc, "code", "invalid_request"), message=str(exc))
                logger.info("request %s refused: %s", request_id, exc)
            else:
                logger.exception("request %s failed on worker %s", request_id, self.name)
                writer.send(ERROR, status=502, code="worker_error", message=f"The worker failed: {type(exc).__name__}")
            return
        writer.send(
            DONE,
            text=result.text,
            finish_reason=result.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
            cached_tokens=result.cached_tokens,
            ttft_ms=result.ttft_ms,
            prefill_ms=result.prefill_ms,
            total_ms=result.total_ms,
            encoder_calls=result.encoder_calls,
            embedding_cache_hits=result.embedding_cache_hits,
            embedding_cache_misses=result.embedding_cache_misses,
            worker=self.name,
        )


def _image_input(image_input_class, image: dict[str, Any]):
    """An ImageInput from the task payload; bytes the frontend fetched travel base64-encoded."""
    data = image.get("data_b64")
    return image_input_class(
        identity=image["identity"], url=image.get("url"), data=base64.b64decode(data) if data else None
    )


def _throttled(check, interval_s: float):
    """`check`, called at most once per interval; in between, its last answer."""
    state = {"at": 0.0, "answer": False}
    lock = threading.Lock()

    def throttled() -> bool:
        now = time.monotonic()
        with lock:
            if now - state["at"] >= interval_s:
                state["at"] = now
                state["answer"] = bool(check())
            return state["answer"]

    return throttled


_runtime: WorkerRuntime | None = None


def install_runtime(runtime: WorkerRuntime) -> None:
    global _runtime
    _runtime = runtime


def current_runtime() -> WorkerRuntime:
    if _runtime is None:
        raise NoRuntime("this process was not started by `manage.py run_worker`")
    return _runtime
