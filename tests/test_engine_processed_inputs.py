"""The engine served from the frontend processor's inputs: the same output, prompt, block hashes
and reuse as when it preprocesses images itself, without loading or preprocessing them."""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import redis
import torch
from PIL import Image

from routing.contract.responses import DONE, ERROR, parse_stream_entries, response_key
from routing.contract.tasks import CONTRACT_VERSION
from routing.media.images import MediaPolicy, decode_image, routing_hash, url_identity
from routing.prompt.processor_view import ProcessorView, decode_processed, processor_token_view
from routing.prompt.token_view import ImageFacts
from workers.engine import (
    Engine,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    PromptError,
    load_image_directly,
)
from workers.runtime import WorkerRuntime

BLOCK = 16
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
LONG_TEXT = " ".join(["the red apple on the table near a quiet garden"] * 4)


class CountingLoader:
    """The engine's real image loader, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, image: ImageInput, scope_key: str | None) -> Image.Image:
        self.calls += 1
        return load_image_directly(image, scope_key)


@pytest.fixture
def make_engine(demo_engine) -> Iterator:
    def make() -> tuple[Engine, CountingLoader]:
        loader = CountingLoader()
        return demo_engine(load_image=loader), loader

    yield make


@pytest.fixture
def encoder_calls(shared_parts: tuple[Any, Any]) -> Iterator[list[int]]:
    calls: list[int] = []
    handle = shared_parts[0].model.visual.register_forward_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


def png(width: int, height: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, "PNG")
    return buffer.getvalue()


def image_input(seed: int, width: int = 112, height: int = 84) -> ImageInput:
    return ImageInput(identity=url_identity(f"https://img.test/{seed}.png"), data=png(width, height, seed))


def chat(user: str, *, images: int = 0, before: str = "") -> str:
    return f"{SYSTEM}<|im_start|>user\n{before}{VISION * images}{user}<|im_end|>\n<|im_start|>assistant\n"


def frontend_view(model_dir: Path, prompt: str, images: Sequence[ImageInput]) -> ProcessorView:
    """What the frontend's processor path makes of the request (serving._processor_view)."""
    pixels = [decode_image(image.data or b"", MediaPolicy()) for image in images]
    facts = [
        ImageFacts(image.identity, routing_hash(image.identity), pil.width, pil.height)
        for image, pil in zip(images, pixels, strict=True)
    ]
    return processor_token_view(model_dir, prompt, pixels, facts, block_size=BLOCK)


def processed_inputs(view: ProcessorView) -> dict[str, Any]:
    """The processed inputs as the worker receives them: through the task's JSON, then decoded."""
    return decode_processed(json.loads(json.dumps(view.processed)))


def request(prompt: str, images: Sequence[ImageInput], **options: Any) -> GenerationRequest:
    options.setdefault("max_tokens", 8)
    return GenerationRequest(request_id="t", prompt=prompt, images=list(images), **options)


def outcome(result: GenerationResult) -> tuple[str, int, list[int], int]:
    return result.text, result.prompt_tokens, result.block_hashes, result.cached_tokens


def test_processed_inputs_give_the_output_hashes_and_reuse_of_worker_preprocessing(
    make_engine, demo_model_dir: Path
) -> None:
    # given two images of different sizes, so each takes its own rows of pixel_values
    images = [image_input(1), image_input(2, 140, 196)]
    first = chat(LONG_TEXT + " Which fruit is it?", images=2)
    second = chat(LONG_TEXT + " Where is the garden?", images=2)
    views = [frontend_view(demo_model_dir, prompt, images) for prompt in (first, second)]
    normal, normal_loader = make_engine()
    served, served_loader = make_engine()

    # when each engine serves the same two requests, one preprocessing itself, one from the frontend's inputs
    expected = [normal.generate(request(prompt, images)) for prompt in (first, second)]
    results = [
        served.generate(request(prompt, images, processed=processed_inputs(view)))
        for prompt, view in zip((first, second), views, strict=True)
    ]

    # then everything the client and the router see is the same, and the worker loaded no image
    assert [outcome(r) for r in results] == [outcome(r) for r in expected]
    assert [r.block_hashes for r in results] == [view.view.block_hashes for view in views]
    assert results[1].cached_tokens >= 3 * BLOCK
    assert (normal_loader.calls, served_loader.calls) == (4, 0)


def test_a_repeated_processed_request_reuses_its_prefix_without_reading_its_pixels(
    make_engine, demo_model_dir: Path, encoder_calls: list[int]
) -> None:
    engine, loader = make_engine()
    image = image_input(3, 224, 168)
    prompt = chat("Count the birds in the picture.", images=1, before="Look closely. ")
    processed = processed_inputs(frontend_view(demo_model_dir, prompt, [image]))
    cold = engine.generate(request(prompt, [image], processed=processed))

    # pixels that would poison the output if the image were encoded again
    poisoned = dict(processed, pixel_values=torch.full_like(processed["pixel_values"], float("nan")))
    warm = engine.generate(request(prompt, [image], processed=poisoned))

    assert cold.encoder_calls == 1 and len(encoder_calls) == 1
    assert warm.cached_tokens == min(warm.prompt_tokens // BLOCK * BLOCK, warm.prompt_tokens - 1)
    assert (warm.encoder_calls, warm.embedding_cache_hits, warm.embedding_cache_misses) == (0, 0, 0)
    assert len(encoder_calls) == 1 and loader.calls == 0
    assert warm.text == cold.text


def test_an_embedding_cached_by_worker_preprocessing_serves_processed_inputs(
    make_engine, demo_model_dir: Path
) -> None:
    # given an image encoded once the usual way, then the KV cache emptied
    engine, loader = make_engine()
    image = image_input(4)
    prompt = chat("What colour dominates?", images=1)
    cold = engine.generate(request(prompt, [image]))
    engine.clear_kv_cache()

    # when the same image arrives as processed inputs
    again = engine.generate(
        request(prompt, [image], processed=processed_inputs(frontend_view(demo_model_dir, prompt, [image])))
    )

    # then the embedding cache (same identity, same key) serves it: no encoder, same output
    assert (again.cached_tokens, again.encoder_calls, again.embedding_cache_hits) == (0, 0, 1)
    assert (again.text, loader.calls) == (cold.text, 1)


def _drop_an_image(processed: dict[str, Any], images: list[ImageInput]) -> list[ImageInput]:
    return images[:1]


def _wrong_grid(processed: dict[str, Any], images: list[ImageInput]) -> list[ImageInput]:
    grid = processed["image_grid_thw"].clone()
    grid[0, 1] += 2  # still merges by 2, but makes more tokens than the ids hold
    processed["image_grid_thw"] = grid
    return images


def _missing_pixels(processed: dict[str, Any], images: list[ImageInput]) -> list[ImageInput]:
    processed["pixel_values"] = processed["pixel_values"][:-4]
    return images


def _ids_outside_the_vocabulary(processed: dict[str, Any], images: list[ImageInput]) -> list[ImageInput]:
    processed["input_ids"] = torch.cat([processed["input_ids"], torch.tensor([[10**7]])], dim=1)
    return images


def _no_grid(processed: dict[str, Any], images: list[ImageInput]) -> list[ImageInput]:
    del processed["image_grid_thw"]
    return images


@pytest.mark.parametrize(
    "spoil",
    [_drop_an_image, _wrong_grid, _missing_pixels, _ids_outside_the_vocabulary, _no_grid],
    ids=["image-count", "grid", "pixel-rows", "vocabulary", "no-grid"],
)
def test_processed_inputs_inconsistent_with_the_images_are_refused_with_400(
    make_engine, demo_model_dir: Path, spoil
) -> None:
    engine, loader = make_engine()
    images = [image_input(5), image_input(6, 84, 112)]
    prompt = chat("Compare them.", images=2)
    processed = processed_inputs(frontend_view(demo_model_dir, prompt, images))
    sent = spoil(processed, images)

    with pytest.raises(PromptError) as refused:
        engine.generate(request(prompt, sent, processed=processed))

    assert refused.value.status == 400
    assert loader.calls == 0 and len(engine.kv_block_hashes()) == 0


# --- the worker runtime hands the task's processed inputs to the engine ----------------------------
def served_events(runtime: WorkerRuntime, payload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    runtime.serve(payload)
    entries = runtime.client.xrange(response_key(runtime.namespace, payload["request_id"]))
    return {event.type: event.data for event in parse_stream_entries(entries)}


def task_payload(
    runtime: WorkerRuntime, prompt: str, images: Sequence[ImageInput], processed: Any
) -> dict[str, Any]:
    request_id = uuid.uuid4().hex
    return {
        "request_id": request_id,
        "prompt": prompt,
        "images": [
            {"identity": i.identity, "url": None, **runtime.media.put(request_id, i.data or b"").to_payload()}
            for i in images
        ],
        "max_tokens": 6,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop": [],
        "scope_key": None,
        "processed": processed,
        "contract_version": CONTRACT_VERSION,
    }


def test_the_runtime_serves_a_task_from_its_processed_inputs_without_loading_images(
    make_engine, demo_model_dir: Path, redis_client: redis.Redis, key_namespace: str
) -> None:
    engine, loader = make_engine()
    image = image_input(7)
    prompt = chat("What is it?", images=1)
    view = frontend_view(demo_model_dir, prompt, [image])
    runtime = WorkerRuntime(name="w", engine=engine, client=redis_client, namespace=key_namespace)
    expected = make_engine()[0].generate(request(prompt, [image], max_tokens=6))

    done = served_events(runtime, task_payload(runtime, prompt, [image], view.processed))[DONE]

    assert (done["text"], done["prompt_tokens"]) == (expected.text, expected.prompt_tokens)
    assert loader.calls == 0


def test_the_runtime_answers_processed_inputs_that_do_not_decode_with_400(
    make_engine, demo_model_dir: Path, redis_client: redis.Redis, key_namespace: str
) -> None:
    engine, loader = make_engine()
    image = image_input(8)
    prompt = chat("What is it?", images=1)
    processed = frontend_view(demo_model_dir, prompt, [image]).processed
    processed["pixel_values"] = dict(processed["pixel_values"], dtype="no_such_dtype")
    runtime = WorkerRuntime(name="w", engine=engine, client=redis_client, namespace=key_namespace)

    events = served_events(runtime, task_payload(runtime, prompt, [image], processed))

    assert DONE not in events and events[ERROR]["status"] == 400
    assert loader.calls == 0
