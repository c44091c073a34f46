"""The engine on tiny LLaVA-1.5 and LLaVA-NeXT checkpoints: the processor's prompt, transformers'
output, prefix and embedding reuse without the vision tower, and the router's block hashes."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import redis
import torch
from PIL import Image

from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.media.images import MediaPolicy, decode_image, routing_hash, url_identity
from routing.prompt.layouts import LlavaLayout, LlavaNextLayout, layout_for_model_dir
from routing.prompt.model_view import model_view
from routing.prompt.processor_view import decode_processed, processor_token_view
from routing.prompt.token_view import ImageFacts, build_token_view
from workers.embedding_cache import EmbeddingCache
from workers.engine import (
    Engine,
    GenerationRequest,
    GenerationResult,
    ImageInput,
    PromptError,
    load_image_directly,
)
from workers.kv_cache import KvPool

BLOCK = 16
FAMILIES = ["llava", "llava_next"]
LONG_TEXT = " ".join(["the red apple on the table near a quiet garden"] * 4)


@pytest.fixture(scope="module")
def checkpoints(llava_demo_dir) -> dict[str, Path]:
    return {family: llava_demo_dir(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, Path]) -> dict[str, Engine]:
    # Through Engine.load, as a worker process loads its checkpoint directory.
    return {family: Engine.load(path) for family, path in checkpoints.items()}


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> str:
    return request.param


class CountingLoader:
    """The engine's real image loader, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, image: ImageInput, scope_key: str | None) -> Image.Image:
        self.calls += 1
        return load_image_directly(image, scope_key)


@pytest.fixture
def make_engine(loaded: dict[str, Engine], family: str) -> Iterator:
    """A fresh engine (empty caches) around the family's loaded model and processor."""
    parts = loaded[family]

    def make(publish_events: Any = None, loader: CountingLoader | None = None) -> Engine:
        return Engine(
            model=parts.model,
            processor=parts.processor,
            model_name=family,
            device="cpu",
            kv_pool=KvPool(
                capacity_blocks=512, block_size=BLOCK, worker="llava-w", publish_events=publish_events
            ),
            embedding_cache=EmbeddingCache(64 << 20),
            load_image=loader or load_image_directly,
        )

    yield make


@pytest.fixture
def vision_calls(loaded: dict[str, Engine], family: str) -> Iterator[list[int]]:
    calls: list[int] = []
    handle = loaded[family].model.model.vision_tower.register_forward_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


@pytest.fixture
def first_token_logits(loaded: dict[str, Engine], family: str) -> Iterator:
    """Runs a one-token request; returns its result and its prefill's last-position logits."""
    seen: list[torch.Tensor] = []
    head = loaded[family].model.lm_head
    handle = head.register_forward_hook(lambda _m, _i, output: seen.append(output[0, -1].clone()))

    def run(
        engine: Engine, prompt: str, images: Sequence[ImageInput]
    ) -> tuple[GenerationResult, torch.Tensor]:
        seen.clear()
        result = engine.generate(request(prompt, images, max_tokens=1))
        return result, seen[0]

    yield run
    handle.remove()


def png(width: int, height: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, "PNG")
    return buffer.getvalue()


def image_input(seed: int, width: int = 150, height: int = 100) -> ImageInput:
    return ImageInput(
        identity=url_identity(f"https://img.test/llava/{seed}.png"), data=png(width, height, seed)
    )


def pil(image: ImageInput) -> Image.Image:
    return Image.open(io.BytesIO(image.data or b""))


def chat(user: str, *, images: int = 0, before: str = "", between: str = "\n") -> str:
    """What the checkpoint's LLaVA-1.5 chat template renders for one user turn."""
    return f"<s>USER: {before}" + "<image>" * images + f"{between}{user} ASSISTANT:"


def request(prompt: str, images: Sequence[ImageInput] = (), **options: Any) -> GenerationRequest:
    options.setdefault("max_tokens", 8)
    return GenerationRequest(request_id="t", prompt=prompt, images=list(images), **options)


def image_span(engine: Engine, prompt: str, images: Sequence[ImageInput]) -> tuple[int, int]:
    ids = engine.prompt_token_ids(prompt, [pil(image) for image in images])
    start = ids.index(engine.image_token_id)
    return start, start + ids.count(engine.image_token_id)


# --- the checkpoint, its prompt and the cold path against transformers itself --------------------
def test_both_families_load_through_engine_load_with_their_own_processor(
    loaded: dict[str, Engine], checkpoints: dict[str, Path]
) -> None:
    assert loaded["llava"].model_type == "llava"
    assert type(loaded["llava"].processor).__name__ == "LlavaProcessor"
    assert type(loaded["llava_next"].processor).__name__ == "LlavaNextProcessor"
    assert isinstance(layout_for_model_dir(checkpoints["llava"]), LlavaLayout)
    assert isinstance(layout_for_model_dir(checkpoints["llava_next"]), LlavaNextLayout)
    assert not loaded["llava"].uses_mrope and not loaded["llava_next"].uses_mrope


def test_prompt_ids_are_the_processors_and_cold_output_is_transformers_generate(make_engine) -> None:
    engine = make_engine()
    images = [image_input(1), image_input(2, 90, 200)]
    prompt = chat("What differs?", images=2, between=" and ")
    encoded = engine.processor(text=[prompt], images=[pil(i) for i in images], return_tensors="pt")

    result = engine.generate(request(prompt, images, max_tokens=10))

    assert engine.prompt_token_ids(prompt, [pil(i) for i in images]) == encoded["input_ids"][0].tolist()
    with torch.inference_mode():
        reference = engine.model.generate(**encoded, max_new_tokens=10, do_sample=False)
    expected = engine.tokenizer.decode(
        reference[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert result.text == expected
    assert result.prompt_tokens == encoded["input_ids"].shape[1]
    assert (result.cached_tokens, result.encoder_calls) == (0, 2)


# --- prefix reuse changes nothing --------------------------------------------------------------------
def test_output_with_a_prefix_hit_equals_a_cold_engines_and_transformers(
    make_engine, first_token_logits, vision_calls
) -> None:
    # given a prompt whose image lies wholly inside the shared prefix
    image = image_input(3)
    first = chat(LONG_TEXT + " Which fruit is it?", images=1)
    second = chat(LONG_TEXT + " Where is the garden?", images=1)
    warm = make_engine()
    _, end = image_span(warm, second, [image])
    pair = [warm.prompt_token_ids(p, [pil(image)]) for p in (first, second)]
    shared = next(n for n, (a, b) in enumerate(zip(*pair, strict=False)) if a != b)
    warm.generate(request(first, [image]))
    calls_before = len(vision_calls)

    # when the second prompt runs warm and cold
    hit, hit_logits = first_token_logits(warm, second, [image])
    hit_text = warm.generate(request(second, [image], max_tokens=12)).text
    cold, cold_logits = first_token_logits(make_engine(), second, [image])
    cold_text = make_engine().generate(request(second, [image], max_tokens=12)).text

    # then the warm run reused the shared full blocks, never ran the tower, and agrees exactly
    assert hit.cached_tokens == (shared // BLOCK) * BLOCK > end
    assert (hit.encoder_calls, cold.cached_tokens, cold.encoder_calls) == (0, 0, 1)
    assert len(vision_calls) == calls_before + 2  # the two cold engines only
    # With random weights text barely depends on positions; the logits show an off-by-one.
    assert torch.allclose(hit_logits, cold_logits, rtol=0, atol=1e-4)
    assert hit_text == cold_text
    encoded = warm.processor(text=[second], images=[pil(image)], return_tensors="pt")
    with torch.inference_mode():
        reference = warm.model.generate(**encoded, max_new_tokens=12, do_sample=False)
    assert hit_text == warm.tokenizer.decode(
        reference[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True
    )


def test_repeated_image_prompt_reuses_its_blocks_without_the_vision_tower(make_engine, vision_calls) -> None:
    engine = make_engine()
    image = image_input(4, 224, 168)
    prompt = chat("Count the birds in the picture.", images=1, before="Look closely. ")

    cold = engine.generate(request(prompt, [image]))
    calls_after_cold = len(vision_calls)
    warm = engine.generate(request(prompt, [image]))

    assert (cold.encoder_calls, calls_after_cold) == (1, 1)
    # Every full block is reused except that the last prompt token always runs.
    assert warm.cached_tokens >= (warm.prompt_tokens // BLOCK) * BLOCK - 1
    assert warm.cached_tokens > warm.prompt_tokens - BLOCK - 1
    assert len(vision_calls) == 1 and warm.encoder_calls == 0
    assert warm.embedding_cache_hits == warm.embedding_cache_misses == 0  # not even looked up
    assert warm.text == cold.text


def test_an_image_cut_by_the_prefix_boundary_comes_from_the_embedding_cache(
    make_engine, first_token_logits, vision_calls
) -> None:
    # given two prompts that differ right after an image ending inside a block
    image = image_input(5)
    before = "Please look at this. "
    first = chat("Alpha?", images=1, before=before, between=" ")
    second = chat("Zeta?", images=1, before=before, between=" ")
    engine = make_engine()
    start, end = image_span(engine, second, [image])
    assert start // BLOCK < end // BLOCK and end % BLOCK, "the image must straddle a block boundary"
    engine.generate(request(first, [image], max_tokens=1))

    # when the second prompt reuses the blocks before the image's last one
    result, logits = first_token_logits(engine, second, [image])
    _, cold_logits = first_token_logits(make_engine(), second, [image])

    # then the image's rows past the boundary come from the cached embedding, not the tower
    assert result.cached_tokens == (end // BLOCK) * BLOCK
    assert (result.encoder_calls, result.embedding_cache_hits) == (0, 1)
    assert len(vision_calls) == 2  # the first request and the cold engine
    assert torch.allclose(logits, cold_logits, rtol=0, atol=1e-4)


# --- the router's view is the worker's --------------------------------------------------------------
def test_block_hashes_and_published_blocks_equal_the_routers_token_view(
    make_engine, checkpoints: dict[str, Path], family: str, redis_client: redis.Redis, key_namespace: str
) -> None:
    # given the worker publishing its KV events into the real index
    index = KvIndex(redis_client, key_namespace)
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)
    engine = make_engine(publish_events=publisher.publish)
    images = [image_input(6, 300, 120), image_input(7, 64, 64)]
    prompt = chat("Compare them.", images=2, between=" then ")

    # when it serves the request
    result = engine.generate(request(prompt, images, max_tokens=2))

    # then the router's view of the same request (its tokenizer, this family's layout) matches
    router_model = model_view(checkpoints[family])
    facts = [
        ImageFacts(image.identity, routing_hash(image.identity), pil(image).width, pil(image).height)
        for image in images
    ]
    view = build_token_view(
        router_model.encode(prompt),
        facts,
        layout=router_model.image_layout,
        placeholder_id=router_model.image_placeholder_id,
        block_size=BLOCK,
        model_type=family,
    )
    assert view.fallback is None
    assert view.tokens == engine.prompt_token_ids(prompt, [pil(image) for image in images])
    assert result.block_hashes == view.block_hashes
    assert index.overlaps(view.block_hashes, ["llava-w"]) == {"llava-w": len(view.block_hashes)}
    assert index.worker_blocks("llava-w") == engine.kv_block_hashes() == set(view.block_hashes)


def test_another_image_of_the_same_size_shares_no_block_from_its_start(make_engine) -> None:
    engine = make_engine()
    prompt = chat("Describe it.", images=1)
    start, _ = image_span(engine, prompt, [image_input(8)])

    one = engine.generate(request(prompt, [image_input(8)], max_tokens=1))
    other = engine.generate(request(prompt, [image_input(9)], max_tokens=1))

    assert other.cached_tokens == (start // BLOCK) * BLOCK
    assert other.encoder_calls == 1
    assert one.block_hashes[start // BLOCK :] != other.block_hashes[start // BLOCK :]


# --- the frontend processor's inputs ----------------------------------------------------------------
def frontend_processed(model_dir: Path, prompt: str, images: Sequence[ImageInput]) -> tuple[Any, dict]:
    """The frontend's processor view of the request and its processed inputs, through JSON."""
    pixels = [decode_image(image.data or b"", MediaPolicy()) for image in images]
    facts = [
        ImageFacts(image.identity, routing_hash(image.identity), p.width, p.height)
        for image, p in zip(images, pixels, strict=True)
    ]
    view = processor_token_view(model_dir, prompt, pixels, facts, block_size=BLOCK)
    return view.view, decode_processed(json.loads(json.dumps(view.processed)))


def test_processed_inputs_give_the_same_prompt_hashes_and_output_without_loading_images(
    make_engine, checkpoints: dict[str, Path], family: str
) -> None:
    # given adjacent images, whose placeholder tokens form one run
    images = [image_input(10, 200, 90), image_input(11, 100, 100)]
    prompt = chat("Which is brighter?", images=2, between="")
    view, processed = frontend_processed(checkpoints[family], prompt, images)
    loader = CountingLoader()
    engine = make_engine(loader=loader)

    # when the worker takes the frontend's inputs, then the same request without them
    from_frontend = engine.generate(request(prompt, images, processed=processed))
    loads_from_frontend = loader.calls
    engine.clear_kv_cache()
    engine.embedding_cache.clear()
    own = engine.generate(request(prompt, images))

    # then nothing differs, and the images were neither loaded nor preprocessed by the worker
    assert from_frontend.block_hashes == own.block_hashes == view.block_hashes
    assert (from_frontend.text, from_frontend.prompt_tokens) == (own.text, own.prompt_tokens)
    assert (from_frontend.encoder_calls, loads_from_frontend, loader.calls) == (2, 0, len(images))


def test_processed_inputs_for_fewer_images_than_their_tokens_are_refused(
    make_engine, checkpoints: dict[str, Path], family: str
) -> None:
    images = [image_input(12), image_input(13)]
    prompt = chat("Two?", images=2)
    _, processed = frontend_processed(checkpoints[family], prompt, images)

    with pytest.raises(PromptError) as refused:
        make_engine().generate(request(prompt, images[:1], processed=processed))

    assert refused.value.status == 400
