"""The encode worker's model: the vision tower and projector alone, loaded from the checkpoint,
give the features the LLM worker computes inside the whole model (Qwen2-VL with its M-RoPE grid,
LLaVA-NeXT with its anyres tiles and newline rows), and an engine fed those features answers as
if it had encoded the image itself, without running its own tower."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from django.core.management import call_command
from PIL import Image

from routing.media.images import url_identity
from workers.demo_model import HEAVY_VISION
from workers.embedding_cache import EmbeddingCache, EmbeddingKey
from workers.engine import Engine, GenerationRequest, ImageInput, load_image_directly
from workers.kv_cache import KvPool
from workers.vision_encoder import VisionEncoder, processor_fingerprint

SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def png(width: int, height: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, "PNG")
    return buffer.getvalue()


def image_input(seed: int, width: int, height: int, **fields) -> ImageInput:
    return ImageInput(
        identity=url_identity(f"https://img.test/enc/{seed}.png"), data=png(width, height, seed), **fields
    )


def pil(image: ImageInput) -> Image.Image:
    return Image.open(io.BytesIO(image.data or b"")).convert("RGB")


def qwen_chat(user: str, images: int = 1) -> str:
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * images
    return f"{SYSTEM}<|im_start|>user\n{vision}{user}<|im_end|>\n<|im_start|>assistant\n"


def llava_chat(user: str, images: int = 1) -> str:
    return "<s>USER: " + "<image>" * images + f"\n{user} ASSISTANT:"


def fresh_engine(model, processor, name: str, load_image=load_image_directly) -> Engine:
    return Engine(
        model=model,
        processor=processor,
        model_name=name,
        device="cpu",
        kv_pool=KvPool(capacity_blocks=512, block_size=16, worker="w"),
        embedding_cache=EmbeddingCache(64 << 20),
        load_image=load_image,
    )


def computed_by_engine(engine: Engine, prompt: str, images: Sequence[ImageInput]) -> list[torch.Tensor]:
    """The features the engine computed for each image, as it cached them during a real request."""
    engine.generate(GenerationRequest(request_id="t", prompt=prompt, images=list(images), max_tokens=2))
    keys = [EmbeddingKey(None, i.identity, engine.model_name, engine.processor_fingerprint) for i in images]
    return [engine.embedding_cache.get(key) for key in keys]


def refuse_to_load(image: ImageInput, scope_key: str | None) -> Image.Image:
    raise AssertionError(f"the engine loaded image {image.identity}: it should have used the features")


@pytest.fixture(scope="module")
def qwen_encoder(demo_model_dir: Path) -> VisionEncoder:
    return VisionEncoder.load(demo_model_dir)


@pytest.fixture(scope="module")
def llava_next_dir(llava_demo_dir) -> Path:
    return llava_demo_dir("llava_next")


# --- what is loaded --------------------------------------------------------------------------------
def test_the_encoder_holds_the_vision_tower_and_projector_and_nothing_of_the_language_model(
    qwen_encoder: VisionEncoder, shared_parts
) -> None:
    model, _ = shared_parts
    names = [name for name, _ in qwen_encoder.vision_model.named_parameters()]
    tower = dict(model.model.visual.named_parameters())

    assert names and all(name.startswith("visual.") for name in names)
    assert not any("language_model" in name or "lm_head" in name for name in names)
    assert qwen_encoder.parameter_count() == sum(p.numel() for p in tower.values())
    assert all(p.device.type == "cpu" for p in qwen_encoder.vision_model.parameters())  # nothing on meta
    # the projector (Qwen's patch merger) is part of what it holds
    assert any(name.startswith("visual.merger.") for name in names)


# --- equal features, both families --------------------------------------------------------------------
@pytest.mark.parametrize("size", [(112, 84), (300, 200)])
def test_qwen_features_equal_what_the_engine_computes_with_the_same_grid(
    qwen_encoder: VisionEncoder, demo_engine, size: tuple[int, int]
) -> None:
    # given an image the LLM worker encodes inside the whole model
    engine = demo_engine()
    image = image_input(size[0], *size)
    (expected,) = computed_by_engine(engine, qwen_chat("What is it?"), [image])

    # when the encode worker encodes it alone
    encoded = qwen_encoder.encode(pil(image))

    # then the rows, the grid and the cache key's processor fingerprint are the same
    assert encoded.embedding.shape == expected.shape
    assert torch.allclose(encoded.embedding, expected, atol=1e-5, rtol=0)
    assert encoded.grid_thw == engine.layout.image_grid(pil(image))
    assert qwen_encoder.processor_fingerprint == engine.processor_fingerprint


def test_llava_next_features_with_tiles_and_newlines_equal_the_engines(llava_next_dir: Path) -> None:
    # given two images whose anyres grids differ (one tile row against two), so unpadding and the
    # newline rows differ between them
    whole = Engine.load(llava_next_dir)
    encoder = VisionEncoder.load(llava_next_dir)
    images = [image_input(1, 150, 100), image_input(2, 90, 200)]
    expected = computed_by_engine(whole, llava_chat("What differs?", images=2), images)

    for image, features in zip(images, expected, strict=True):
        encoded = encoder.encode(pil(image))
        assert encoded.grid_thw is None
        assert encoded.embedding.shape == features.shape
        assert torch.allclose(encoded.embedding, features, atol=1e-5, rtol=0)
    assert expected[0].shape[0] != expected[1].shape[0]
    assert not any("language_model" in name for name, _ in encoder.vision_model.named_parameters())
    assert (
        encoder.processor_fingerprint
        == whole.processor_fingerprint
        == processor_fingerprint(whole.image_processor)
    )


def test_llava_next_engine_fed_the_encoders_features_answers_as_it_would_itself(llava_next_dir: Path) -> None:
    whole = Engine.load(llava_next_dir)
    encoder = VisionEncoder.load(llava_next_dir)
    image = image_input(5, 150, 100)
    prompt = llava_chat("Describe it.")
    aggregated = whole.generate(
        GenerationRequest(request_id="a", prompt=prompt, images=[image], max_tokens=8)
    )

    fed = fresh_engine(whole.model, whole.processor, whole.model_name, load_image=refuse_to_load)
    # only the features travel, with the size the frontend declared
    received = ImageInput(
        identity=image.identity, width=150, height=100, embedding=encoder.encode(pil(image)).embedding
    )
    result = fed.generate(GenerationRequest(request_id="b", prompt=prompt, images=[received], max_tokens=8))

    assert result.text == aggregated.text
    assert (result.encoder_calls, result.embeddings_received) == (0, 1)


# --- the LLM worker's side ----------------------------------------------------------------------------
def test_qwen_engine_fed_the_encoders_features_never_runs_its_tower_and_answers_the_same(
    qwen_encoder: VisionEncoder, demo_engine, shared_parts
) -> None:
    model, _ = shared_parts
    image = image_input(7, 140, 112)
    prompt = qwen_chat("Which color dominates?")
    aggregated = demo_engine().generate(
        GenerationRequest(request_id="a", prompt=prompt, images=[image], max_tokens=12)
    )
    tower_calls: list[int] = []
    hook = model.model.visual.register_forward_hook(lambda *_: tower_calls.append(1))
    try:
        received = ImageInput(
            identity=image.identity,
            width=140,
            height=112,
            embedding=qwen_encoder.encode(pil(image)).embedding,
        )
        result = demo_engine(load_image=refuse_to_load).generate(
            GenerationRequest(request_id="b", prompt=prompt, images=[received], max_tokens=12)
        )
    finally:
        hook.remove()

    assert result.text == aggregated.text
    assert tower_calls == []
    assert (result.encoder_calls, result.embeddings_received, result.embedding_fallbacks) == (0, 1, 0)


def test_features_that_do_not_fit_the_image_fall_back_to_local_encoding(
    qwen_encoder: VisionEncoder, demo_engine
) -> None:
    image = image_input(8, 140, 112)
    prompt = qwen_chat("Which color dominates?")
    aggregated = demo_engine().generate(
        GenerationRequest(request_id="a", prompt=prompt, images=[image], max_tokens=8)
    )
    wrong = qwen_encoder.encode(pil(image_input(9, 300, 200))).embedding  # another image's rows
    sent = ImageInput(identity=image.identity, data=image.data, width=140, height=112, embedding=wrong)

    result = demo_engine().generate(
        GenerationRequest(request_id="b", prompt=prompt, images=[sent], max_tokens=8)
    )

    assert result.text == aggregated.text
    assert (result.encoder_calls, result.embeddings_received, result.embedding_fallbacks) == (1, 0, 1)


def test_while_features_travel_the_engine_encodes_the_image_it_keeps_and_answers_the_same(
    qwen_encoder: VisionEncoder, demo_engine, shared_parts
) -> None:
    # given a request of two images: the first's features come from an encode worker, the
    # second stays with this worker (the split), and the answer the aggregated path gives
    model, _ = shared_parts
    sent = image_input(21, 140, 112)
    kept = ImageInput(identity=image_input(22, 112, 84).identity, data=png(112, 84, 22), width=112, height=84)
    prompt = qwen_chat("Compare them.", images=2)
    aggregated = demo_engine().generate(
        GenerationRequest(request_id="a", prompt=prompt, images=[sent, kept], max_tokens=10)
    )
    features = qwen_encoder.encode(pil(sent)).embedding
    expected = ImageInput(identity=sent.identity, width=140, height=112, features_expected=True)
    tower_calls: list[int] = []
    hook = model.model.visual.register_forward_hook(lambda *_: tower_calls.append(1))

    def await_features() -> None:
        # the encode worker is slow: its features come only once the kept image is encoded
        deadline = time.monotonic() + 30
        while not tower_calls:
            assert time.monotonic() < deadline, "the engine did not encode the kept image meanwhile"
            time.sleep(0.01)
        expected.embedding = features

    # when the request waits for the first image's features
    try:
        result = demo_engine().generate(
            GenerationRequest(request_id="b", prompt=prompt, images=[expected, kept], max_tokens=10),
            await_features=await_features,
        )
    finally:
        hook.remove()

    # then the kept image was encoded during the wait, once, and the answer is the aggregated one
    assert result.text == aggregated.text
    assert tower_calls == [1]
    assert (result.encoder_calls, result.embeddings_received, result.embedding_fallbacks) == (1, 1, 0)


def test_expected_features_that_never_come_are_encoded_here_after_the_wait(demo_engine) -> None:
    # given an image whose features an encode worker was to send, and the aggregated answer
    image = image_input(23, 140, 112)
    prompt = qwen_chat("Which color dominates?")
    aggregated = demo_engine().generate(
        GenerationRequest(request_id="a", prompt=prompt, images=[image], max_tokens=8)
    )
    loaded_while_waiting: list[bool] = []
    waiting = threading.Event()

    def load(source: ImageInput, scope_key: str | None) -> Image.Image:
        loaded_while_waiting.append(waiting.is_set())
        return load_image_directly(source, scope_key)

    def await_features() -> None:  # the encoder died: nothing arrives
        waiting.set()
        time.sleep(0.2)
        waiting.clear()

    expected = ImageInput(
        identity=image.identity, data=image.data, width=140, height=112, features_expected=True
    )

    # when the wait ends without them
    result = demo_engine(load_image=load).generate(
        GenerationRequest(request_id="b", prompt=prompt, images=[expected], max_tokens=8),
        await_features=await_features,
    )

    # then the image was loaded and encoded after the wait, not during it, with the same answer
    assert result.text == aggregated.text
    assert loaded_while_waiting == [False]
    assert result.encoder_calls == 1


def test_an_llm_role_engine_drops_its_tower_and_loads_it_back_on_the_first_fallback(
    demo_model_dir: Path, demo_engine
) -> None:
    # given an engine of its own (the shared model must keep its tower)
    engine = Engine.load(demo_model_dir)
    engine.unload_vision(demo_model_dir)
    assert not engine.vision_loaded
    assert all(p.device.type == "meta" for p in engine.model.model.visual.parameters())
    loaded: list[torch.nn.Module] = []
    engine.on_vision_loaded = loaded.append

    text_only = engine.generate(
        GenerationRequest(request_id="t", prompt=qwen_chat("Hello there.", 0), images=[])
    )
    assert not engine.vision_loaded and text_only.completion_tokens > 0

    image = image_input(10, 112, 84)
    prompt = qwen_chat("What is it?")
    result = engine.generate(GenerationRequest(request_id="i", prompt=prompt, images=[image], max_tokens=8))

    assert engine.vision_loaded and loaded == [engine.model.model.visual]
    assert (
        result.text
        == demo_engine()
        .generate(GenerationRequest(request_id="r", prompt=prompt, images=[image], max_tokens=8))
        .text
    )


# --- the heavier demo tower ---------------------------------------------------------------------------
def test_the_heavy_vision_option_deepens_and_widens_only_the_tower(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    call_command("build_demo_model", str(tmp_path / "heavy"), "--heavy-vision")

    heavy = json.loads((tmp_path / "heavy" / "config.json").read_text())
    default = json.loads((demo_model_dir / "config.json").read_text())
    assert heavy["vision_config"]["depth"] == HEAVY_VISION["depth"] > default["vision_config"]["depth"]
    assert (
        heavy["vision_config"]["embed_dim"]
        == HEAVY_VISION["embed_dim"]
        > default["vision_config"]["embed_dim"]
    )
    assert heavy["text_config"] == default["text_config"]
    encoder = VisionEncoder.load(tmp_path / "heavy")
    assert encoder.encode(pil(image_input(11, 112, 84))).embedding.shape == (
        12,
        heavy["text_config"]["hidden_size"],
    )


def test_qwen3_vl_features_carry_their_deepstack_layers_as_the_engine_packs_them(
    qwen3_demo_dir: Path,
) -> None:
    # given the Qwen3-VL checkpoint, whose language model also takes DeepStack features
    whole = Engine.load(qwen3_demo_dir)
    encoder = VisionEncoder.load(qwen3_demo_dir)
    image = image_input(12, 128, 96)
    prompt = qwen_chat("What is it?")
    (expected,) = computed_by_engine(whole, prompt, [image])

    encoded = encoder.encode(pil(image))

    assert encoder.deepstack > 0
    assert encoded.embedding.shape == expected.shape
    assert expected.shape[1] == whole.model.config.text_config.hidden_size * (1 + encoder.deepstack)
    assert torch.allclose(encoded.embedding, expected, atol=1e-5, rtol=0)
    # and the engine fed them answers as it does by itself, without its tower
    aggregated = whole.generate(
        GenerationRequest(request_id="a", prompt=prompt, images=[image], max_tokens=8)
    )
    received = ImageInput(identity=image.identity, width=128, height=96, embedding=encoded.embedding)
    fed = fresh_engine(whole.model, whole.processor, whole.model_name, load_image=refuse_to_load)
    result = fed.generate(GenerationRequest(request_id="b", prompt=prompt, images=[received], max_tokens=8))
    assert result.text == aggregated.text and result.embeddings_received == 1


@pytest.mark.parametrize("role", ["encode", "llm"])
def test_run_worker_refuses_a_split_role_for_a_family_whose_tower_cannot_be_served_apart(
    tmp_path: Path, role: str
) -> None:
    from django.core.management import CommandError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mllama"}))

    with pytest.raises(CommandError, match="use --role both"):
        call_command("run_worker", "--name", "w", "--role", role, "--model-path", str(tmp_path))
