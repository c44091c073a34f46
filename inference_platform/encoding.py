"""E/PD on the frontend: which of a request's images go to an encode worker, and to which one.

With at least one live encode worker, each image the chosen LLM worker's cached prefix does not
wholly cover is encoded apart: the encode worker with the best embedding-cache affinity weighed
against the images already waiting on it (routing.encoders) gets a `workers.encode` task, and the
LLM worker's task names that encoder and those images. Without one (or if the send fails), the
request takes the aggregated path unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from inference_platform.celery import app as celery_app
from inference_platform.dispatch import eligible_encoders, worker_states
from routing.contract import EncodeTask, GenerateTask
from routing.encoders import EncoderPool, EncoderScore, cache_partition, cache_tag
from routing.models import worker_queue
from routing.redis_keys import sync_client
from routing.token_view import TokenView

logger = logging.getLogger("inference_platform.encoding")


@dataclass(frozen=True)
class EncodePlan:
    worker: str
    indices: tuple[int, ...]  # the request's images it encodes
    scores: list[EncoderScore]


def encoder_pool() -> EncoderPool:
    client, namespace = sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX
    return EncoderPool(client, namespace, pending_ttl_s=settings.EPD_ENCODE_WAIT_SECS)


def uncovered_images(view: TokenView, image_count: int, overlap_blocks: int) -> list[int]:
    """Indices of the images the LLM worker's cached prefix does not wholly cover: those it would
    otherwise have to encode itself. Without a layout (text-prefix routing) positions are unknown,
    so every image counts as uncovered."""
    if view.fallback or len(view.images) != image_count:
        return list(range(image_count))
    covered = overlap_blocks * view.block_size
    return [image.index for image in view.images if image.start + image.tokens > covered]


def _tags(task: GenerateTask, indices: list[int], session_scoped: bool) -> list[str]:
    """The encode workers' cache tags of these images (partitioned as their caches are)."""
    partition = cache_partition(session_scoped, task.scope_key, task.cache_salt)
    return [cache_tag(partition, task.images[i].identity) for i in indices]


def _candidate_images(task: GenerateTask, view: TokenView, overlap_blocks: int) -> list[int]:
    if task.processed is not None:
        return []  # the processor path sends pixel values already made: nothing to gain
    return uncovered_images(view, len(task.images), overlap_blocks)


async def plan_encoding(
    task: GenerateTask, view: TokenView, model: str, llm_worker: str, overlap_blocks: int
) -> tuple[GenerateTask, EncodePlan | None]:
    """Sends the images to encode to an encode worker and returns the LLM worker's task naming
    them; the task unchanged (aggregated path) when no encode worker is live or the send fails."""
    indices = _candidate_images(task, view, overlap_blocks)
    if not indices:
        return task, None
    encoders = await eligible_encoders(model, view.block_size)
    if not encoders:
        return task, None
    pool = encoder_pool()
    tags = _tags(task, indices, any(beat.session_scoped for beat in encoders.values()))
    choice = await asyncio.to_thread(pool.choose, encoders, tags)
    if choice is None:
        return task, None
    encode = EncodeTask(
        request_id=task.request_id,
        images=tuple(task.images[i] for i in indices),
        indices=tuple(indices),
        scope_key=task.scope_key,
        llm_worker=llm_worker,
        cache_salt=task.cache_salt,
    )
    members = [f"{task.request_id}:{i}" for i in indices]
    await asyncio.to_thread(pool.reserve, choice.worker, members)
    try:
        await asyncio.to_thread(
            celery_app.send_task,
            encode.name,
            args=[encode.to_payload()],
            queue=worker_queue(choice.worker),
            expires=settings.EPD_ENCODE_WAIT_SECS,
        )
    except Exception:  # the broker refused: the LLM worker encodes them itself, as without E/PD
        logger.exception("could not queue the encoding of request %s on %s", task.request_id, choice.worker)
        await asyncio.to_thread(pool.release, choice.worker, members)
        return task, None
    logger.info(
        "request %s: %d image(s) encoded on %s for %s (%s)",
        task.request_id,
        len(indices),
        choice.worker,
        llm_worker,
        ", ".join(f"{s.worker} cost {s.cost:g}" for s in choice.scores),
    )
    plan = EncodePlan(choice.worker, tuple(indices), choice.scores)
    named = dataclasses.replace(
        task, encoder=choice.worker, encoded_images=plan.indices, encode_wait_s=settings.EPD_ENCODE_WAIT_SECS
    )
    return named, plan


async def describe_encoding(
    task: GenerateTask, view: TokenView, model: str, llm_worker: str | None, overlap_blocks: int
) -> dict[str, Any]:
    """What `/v1/route` shows of E/PD: the mode, the images that would be encoded apart, and every
    encode worker with its affinity (cached images), load (pending images) and cost."""
    states = await worker_states(model, view.block_size, encoders=True)
    encoders = [state for state in states if state.heartbeat is not None and state.heartbeat.role == "encode"]
    eligible = [state.name for state in encoders if state.ineligible_because is None]
    indices = _candidate_images(task, view, overlap_blocks) if llm_worker else []
    tags = _tags(task, indices, any(state.heartbeat.session_scoped for state in encoders))
    pool = encoder_pool()
    scores = {s.worker: s for s in await asyncio.to_thread(pool.scores, [s.name for s in encoders], tags)}
    choice = None
    if eligible and indices:
        choice = min(eligible, key=lambda name: (scores[name].cost, name))
    return {
        "mode": "epd" if eligible else "aggregated",
        "images": indices,
        "choice": choice,
        "candidates": [
            {
                "worker": state.name,
                "eligible": state.ineligible_because is None,
                "ineligible_because": state.ineligible_because,
                **scores[state.name].to_dict(),
            }
            for state in encoders
        ],
    }
