"""Session scoping on a worker: KV prefix blocks stay content-based and are reused across scopes,
while the embedding cache is partitioned by scope and bypassed by a request without one."""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import redis
import torch
from PIL import Image

from routing.contract.responses import DONE, parse_stream_entries, response_key
from routing.contract.tasks import CONTRACT_VERSION
from routing.media.images import MediaPolicy, decode_image, routing_hash, url_identity
from routing.prompt.processor_view import processor_token_view
from routing.prompt.session_scope import scope_hash
from routing.prompt.token_view import ImageFacts
from workers.engine import Engine, GenerationRequest, ImageInput
from workers.runtime import WorkerRuntime

BLOCK = 16
SCOPE_SECRET = b"test-scope-secret"
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
# With this text before it, the 112x84 image (12 tokens) starts in one block and ends in the next.
BEFORE_IMAGE = "Please look at this. "


@pytest.fixture
def make_engine(demo_engine) -> Iterator:
    def make() -> Engine:
        return demo_engine()

    yield make


@pytest.fixture
def scoped_worker(make_engine, redis_client: redis.Redis, key_namespace: str) -> WorkerRuntime:
    """A worker runtime with DYN_MM_IMAGE_CACHE_SESSION_SCOPED on, answering on the real Redis."""
    return WorkerRuntime(
        name="w", engine=make_engine(), client=redis_client, namespace=key_namespace, session_scoped=True
    )


def png(width: int, height: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, "PNG")
    return buffer.getvalue()


def image_input(seed: int) -> ImageInput:
    return ImageInput(identity=url_identity(f"https://img.test/{seed}.png"), data=png(112, 84, seed))


def chat(user: str) -> str:
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    return f"{SYSTEM}<|im_start|>user\n{BEFORE_IMAGE}{vision}{user}<|im_end|>\n<|im_start|>assistant\n"


def processed_for(model_dir: Path, prompt: str, image: ImageInput) -> dict[str, Any]:
    """The frontend processor path's inputs for the task (JSON-safe, as the payload carries them)."""
    pil = decode_image(image.data or b"", MediaPolicy())
    facts = [ImageFacts(image.identity, routing_hash(image.identity), pil.width, pil.height)]
    return json.loads(
        json.dumps(processor_token_view(model_dir, prompt, [pil], facts, block_size=BLOCK).processed)
    )


def serve(
    worker: WorkerRuntime, prompt: str, image: ImageInput, scope: str | None, processed: Any = None
) -> dict[str, Any]:
    """Serves one task payload; returns its `done` event (usage and cache counters)."""
    request_id = uuid.uuid4().hex
    payload = {
        "request_id": request_id,
        "prompt": prompt,
        "images": [
            {
                "identity": image.identity,
                "url": None,
                **worker.media.put(request_id, image.data or b"").to_payload(),
            }
        ],
        "max_tokens": 6,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop": [],
        "scope_key": scope_hash(scope, SCOPE_SECRET) if scope else None,
        "processed": processed,
        "contract_version": CONTRACT_VERSION,
    }
    worker.serve(payload)
    entries = worker.client.xrange(response_key(worker.namespace, payload["request_id"]))
    events = {event.type: event.data for event in parse_stream_entries(entries)}
    assert DONE in events, events
    return events[DONE]


def image_end(engine: Engine, prompt: str, image: ImageInput) -> int:
    ids = engine.prompt_token_ids(prompt, [Image.open(io.BytesIO(image.data or b""))])
    start = ids.index(engine.image_token_id)
    end = start + ids.count(engine.image_token_id)
    assert start // BLOCK < end // BLOCK and end % BLOCK, "the image must straddle a block boundary"
    return end


@pytest.mark.parametrize(
    "frontend_processed", [False, True], ids=["worker-preprocessing", "processed-inputs"]
)
def test_a_second_scope_reuses_the_kv_prefix_but_not_the_first_scopes_embedding(
    scoped_worker: WorkerRuntime, make_engine, demo_model_dir: Path, frontend_processed: bool
) -> None:
    # given scope A served an image prompt whose image is cut by a block boundary
    image = image_input(1)
    prompts = [chat("Alpha?"), chat("Zeta?"), chat("Omega?")]
    end = image_end(scoped_worker.engine, prompts[1], image)

    def processed(prompt: str) -> Any:
        return processed_for(demo_model_dir, prompt, image) if frontend_processed else None

    serve(scoped_worker, prompts[0], image, "session-a", processed(prompts[0]))

    # when scope B sends the same image with another question, then scope A does
    other = serve(scoped_worker, prompts[1], image, "session-b", processed(prompts[1]))
    same = serve(scoped_worker, prompts[2], image, "session-a", processed(prompts[2]))

    # then B reuses A's blocks before the image's last one (content-based KV) yet encodes the
    # image itself, while A's own embedding serves A's next request
    assert other["cached_tokens"] == same["cached_tokens"] == (end // BLOCK) * BLOCK > 0
    assert (other["encoder_calls"], other["embedding_cache_hits"], other["embedding_cache_misses"]) == (
        1,
        0,
        1,
    )
    assert (same["encoder_calls"], same["embedding_cache_hits"], same["embedding_cache_misses"]) == (0, 1, 0)
    cold = make_engine().generate(GenerationRequest("cold", prompts[1], [image], max_tokens=6))
    assert other["text"] == cold.text


def test_a_request_without_a_scope_neither_reads_nor_fills_the_embedding_cache_but_reuses_kv(
    scoped_worker: WorkerRuntime,
) -> None:
    # given an unscoped embedding already cached (as a worker with scoping off would have left it)
    engine = scoped_worker.engine
    image = image_input(2)
    end = image_end(engine, chat("Zeta?"), image)
    engine.generate(GenerationRequest("seed", chat("Alpha?"), [image], max_tokens=2))
    assert len(engine.embedding_cache) == 1

    # when, with scoping on, two requests without a scope share the prefix
    first = serve(scoped_worker, chat("Beta?"), image, None)
    second = serve(scoped_worker, chat("Zeta?"), image, None)

    # then neither looked the embedding up nor stored one, and the KV prefix was still reused
    for done in (first, second):
        assert (done["encoder_calls"], done["embedding_cache_hits"], done["embedding_cache_misses"]) == (
            1,
            0,
            0,
        )
        assert done["cached_tokens"] == (end // BLOCK) * BLOCK > 0
    assert len(engine.embedding_cache) == 1
