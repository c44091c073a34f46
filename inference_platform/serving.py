"""From a validated chat request to a dispatched task: prompt, worker choice, payload.

This is the frontend's one place that decides how a request is served; the API view only
parses and answers, the dispatch module only moves messages.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Mapping
from typing import Any

from django.conf import settings

from inference_platform.api.chat_request import ChatRequest
from inference_platform.api.errors import ApiError
from inference_platform.dispatch import Dispatch, eligible_workers, registry, send_to_worker
from routing.model_view import ModelDirectoryError, ModelView, model_view

logger = logging.getLogger("inference_platform.serving")


def served_model() -> ModelView:
    return model_view(settings.MODEL_PATH, settings.MODEL_NAME)


def _render_prompt(view: ModelView, chat: ChatRequest) -> tuple[str, list[int]]:
    try:
        prompt = view.render_prompt(chat.messages)
    except ModelDirectoryError as exc:
        raise ApiError(503, f"The model is not available: {exc}", code="model_unavailable") from exc
    except Exception as exc:  # the template refused these messages (e.g. roles out of order)
        raise ApiError(400, f"The model's chat template refused these messages: {exc}", code="invalid_messages") from exc
    return prompt, view.encode(prompt)


async def plan_request(chat: ChatRequest, request_id: str, headers: Mapping[str, str]) -> Dispatch:
    view = served_model()
    if chat.model != view.name:
        raise ApiError(
            404, f"The model '{chat.model}' does not exist; this platform serves '{view.name}'.",
            code="model_not_found", param="model",
        )
    if chat.images:
        raise ApiError(400, "Image inputs are not supported yet.", code="unsupported_content", param="messages")
    prompt, tokens = await asyncio.to_thread(_render_prompt, view, chat)

    block_size = settings.KV_BLOCK_SIZE
    workers = await eligible_workers(view.name, block_size)
    if not workers:
        raise ApiError(
            503, f"No live worker serves '{view.name}' right now (request {request_id}).", code="no_live_worker"
        )
    names = sorted(workers)
    turn = await asyncio.to_thread(registry().next_round_robin)
    worker = names[turn % len(names)]

    payload: dict[str, Any] = {
        "request_id": request_id,
        "prompt": prompt,
        "images": [],
        "max_tokens": chat.max_tokens,
        "temperature": chat.temperature,
        "top_p": chat.top_p,
        "seed": chat.seed,
        "stop": chat.stop,
        "scope_key": None,
    }
    dispatch = Dispatch(
        request_id=request_id,
        worker=worker,
        prompt_tokens_estimate=len(tokens),
        total_blocks=math.ceil(len(tokens) / block_size),
        payload=payload,
    )
    await send_to_worker(worker, payload)
    logger.info("request %s sent to worker %s (%d prompt tokens)", request_id, worker, len(tokens))
    return dispatch
