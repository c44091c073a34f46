"""E/PD on the frontend: which of a request's images go to an encode worker, and to which one.

With at least one live encode worker, the images the chosen LLM worker's cached prefix does not
wholly cover are candidates: the encode worker with the best embedding-cache affinity weighed
against the images already waiting on it (routing.fleet.encoders) is chosen, then its backlog (pending
images times its measured milliseconds per image) is weighed against the LLM worker's own
(`split_images`, EPD_SPLIT / EPD_LOCAL_ENCODE_WEIGHT): the images it would make wait longer stay
on the LLM worker, which encodes them itself as in the aggregated path. The encoder gets a
`workers.encode` task for the rest, and the LLM worker's task names that encoder and those images.
Without an encoder (or if the send fails, or every image stays local), the request takes the
aggregated path unchanged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from inference_platform.serving.broker import publish_task
from inference_platform.serving.dispatch import eligible_encoders, worker_states
from inference_platform.serving.frontend import frontend
from routing.contract.tasks import EncodeTask, GenerateTask
from routing.fleet.encoders import (
    EncoderPool,
    EncoderScore,
    EncodeSplit,
    cache_partition,
    cache_tag,
    split_images,
)
from routing.models import worker_queue
from routing.prompt.token_view import TokenView

logger = logging.getLogger("inference_platform.encoding")


@dataclass(frozen=True)
class EncodePlan:
    worker: str
    indices: tuple[int, ...]  # the request's images it encodes
    scores: list[EncoderScore]
    kept_local: tuple[int, ...] = ()  # the request's images its LLM worker encodes itself
    split: EncodeSplit | None = None


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


def _split(pool: EncoderPool, choice: EncoderScore, llm_worker: str, tags: list[str]) -> EncodeSplit:
    """The chosen encoder's backlog against the LLM worker's (a pure rule, routing.fleet.encoders)."""
    encode_ms = choice.encode_ms or settings.EPD_ENCODE_MS_DEFAULT
    weight = settings.EPD_LOCAL_ENCODE_WEIGHT if settings.EPD_SPLIT else float("inf")
    return split_images(
        pool.held(choice.worker, tags),
        encoder_pending=choice.pending,
        encode_ms=encode_ms,
        local_backlog_ms=pool.local_backlog_ms(llm_worker) if settings.EPD_SPLIT else 0.0,
        local_weight=weight,
    )


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
    pool = await asyncio.to_thread(frontend().encoder_pool)
    tags = _tags(task, indices, any(beat.session_scoped for beat in encoders.values()))
    choice = await asyncio.to_thread(pool.choose, encoders, tags)
    if choice is None:
        return task, None
    chosen = next(score for score in choice.scores if score.worker == choice.worker)
    split = await asyncio.to_thread(_split, pool, chosen, llm_worker, tags)
    kept = [indices[p] for p in split.kept_local]
    if kept:
        # Counted as the LLM worker's backlog until it is expected to have encoded them.
        ready = [split.local_backlog_ms + split.local_encode_ms * (n + 1) for n in range(len(kept))]
        local_members = [f"{task.request_id}:{i}" for i in kept]
        await asyncio.to_thread(pool.keep_local, llm_worker, local_members, ready)
        logger.info(
            "request %s: image(s) %s stay on %s (encoder %s backlog %.0f ms, %s's %.0f ms)",
            task.request_id,
            ", ".join(map(str, kept)),
            llm_worker,
            choice.worker,
            split.encoder_backlog_ms,
            llm_worker,
            split.local_backlog_ms,
        )
    indices = [indices[p] for p in split.to_encoder]
    if not indices:
        return task, None  # the encoder is too busy: the aggregated path, for every image
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
        await publish_task(
            encode.name,
            [encode.to_payload()],
            queue=worker_queue(choice.worker),
            expires_s=settings.EPD_ENCODE_WAIT_SECS,
            argsrepr=repr([task.request_id]),  # not the images' references and sizes
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
    plan = EncodePlan(choice.worker, tuple(indices), choice.scores, tuple(kept), split)
    named = dataclasses.replace(
        task, encoder=choice.worker, encoded_images=plan.indices, encode_wait_s=settings.EPD_ENCODE_WAIT_SECS
    )
    return named, plan


async def describe_encoding(
    task: GenerateTask, view: TokenView, model: str, llm_worker: str | None, overlap_blocks: int
) -> dict[str, Any]:
    """What `/v1/route` shows of E/PD: the mode, the images that would be encoded apart and those
    that would stay on the LLM worker (`split`: both backlogs, per-image milliseconds, the weight),
    and every encode worker with its affinity (cached images), load (pending images, measured
    milliseconds per image) and cost."""
    states = await worker_states(model, view.block_size, encoders=True)
    encoders = [state for state in states if state.heartbeat is not None and state.heartbeat.role == "encode"]
    eligible = [state.name for state in encoders if state.ineligible_because is None]
    indices = _candidate_images(task, view, overlap_blocks) if llm_worker else []
    tags = _tags(task, indices, any(state.heartbeat.session_scoped for state in encoders))
    pool = await asyncio.to_thread(frontend().encoder_pool)
    scores = {s.worker: s for s in await asyncio.to_thread(pool.scores, [s.name for s in encoders], tags)}
    choice = None
    split: dict[str, Any] | None = None
    kept: list[int] = []
    if eligible and indices:
        choice = min(eligible, key=lambda name: (scores[name].cost, name))
        planned = await asyncio.to_thread(_split, pool, scores[choice], llm_worker, tags)
        kept = [indices[p] for p in planned.kept_local]
        indices = [indices[p] for p in planned.to_encoder]
        split = {
            **planned.to_dict(),
            "enabled": settings.EPD_SPLIT,
            "local_weight": settings.EPD_LOCAL_ENCODE_WEIGHT,
        }
        split["to_encoder"], split["kept_local"] = indices, kept
    return {
        "mode": "epd" if eligible else "aggregated",
        "images": indices,
        "kept_local": kept,
        "choice": choice,
        "split": split,
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
