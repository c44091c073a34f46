"""The worker decodes an image no larger than its model keeps: a phone photo is served, not
refused, and never leaves a full-size copy in the worker's memory; token counts stay those of
the original size.
"""

from __future__ import annotations

import io

import pytest
from PIL import Image

from routing.media.images import url_identity
from routing.prompt.layouts import layout_for_model_dir
from workers.image_loader import SOURCE_SIZE, ImageLoader, ImageLoadError


def photo(width: int, height: int, fmt: str = "JPEG") -> bytes:
    image = Image.effect_noise((width // 8, height // 8), 40).convert("RGB").resize((width, height))
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return buffer.getvalue()


@pytest.fixture(scope="module")
def phone_photo() -> bytes:
    return photo(4000, 3000)  # 12 megapixels


def loader_for(model_dir, **options) -> ImageLoader:
    from workers.runtime import processor_target_size

    return ImageLoader(
        fetch=lambda url, headers: b"",
        shared_cache=None,
        max_bytes=64 << 20,
        stats=None,
        worker="w",
        target_size=processor_target_size(model_dir),
        **options,
    )


def test_a_12_megapixel_photo_is_decoded_at_the_size_the_processor_keeps(demo_model_dir, phone_photo):
    # given the demo model (Qwen2-VL: at most 200,704 pixels per image)
    layout = layout_for_model_dir(demo_model_dir)
    resized_height, resized_width = layout.resized_size(4000, 3000)
    loader = loader_for(demo_model_dir)
    # when the worker loads a 12-megapixel photo
    loaded = loader.load_bytes(url_identity("photo"), phone_photo)
    # then what it decoded, and keeps in its local cache, is the processor's size, not 12 MP
    assert loaded.image.size == (resized_width, resized_height)
    assert loaded.image.width * loaded.image.height <= 200_704
    assert loaded.image.info[SOURCE_SIZE] == (4000, 3000)
    assert loader.load_bytes(url_identity("photo"), phone_photo).image.size == (resized_width, resized_height)


def test_a_large_png_is_shrunk_before_it_is_kept(demo_model_dir):
    loader = loader_for(demo_model_dir)
    loaded = loader.load_bytes(url_identity("big.png"), photo(3000, 2000, "PNG"))
    assert loaded.image.width * loaded.image.height <= 200_704
    assert loaded.image.info[SOURCE_SIZE] == (3000, 2000)


def test_an_image_past_the_hard_pixel_cap_is_refused(demo_model_dir, phone_photo):
    loader = loader_for(demo_model_dir, max_pixels=10_000_000)
    with pytest.raises(ImageLoadError) as refused:
        loader.load_bytes(url_identity("photo"), phone_photo)
    assert refused.value.code == "image_too_many_pixels"


def test_a_small_image_is_decoded_as_it_is(demo_model_dir):
    loader = loader_for(demo_model_dir)
    loaded = loader.load_bytes(url_identity("small"), photo(320, 240, "PNG"))
    assert loaded.image.size == (320, 240)
    assert SOURCE_SIZE not in loaded.image.info


def test_the_engine_serves_a_phone_photo_with_the_token_count_of_its_original_size(
    demo_engine, demo_model_dir, phone_photo
):
    from workers.engine import GenerationRequest, ImageInput
    from workers.runtime import EngineImageLoader, processor_target_size

    # given a worker whose loader decodes reduced
    loader = EngineImageLoader(
        fetch=lambda url, headers: b"",
        shared_cache=None,
        max_bytes=64 << 20,
        stats=None,
        worker="w",
        target_size=processor_target_size(demo_model_dir),
    )
    engine = demo_engine(load_image=loader.load_for_engine)
    layout = layout_for_model_dir(demo_model_dir)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    prompt = f"<|im_start|>user\n{vision}What is it?<|im_end|>\n<|im_start|>assistant\n"
    text_only = engine.generate(
        GenerationRequest(request_id="t", prompt=prompt.replace(vision, ""), images=[], max_tokens=1)
    )
    # when it serves the photo, declared at its full size as the frontend read it
    result = engine.generate(
        GenerationRequest(
            request_id="p",
            prompt=prompt,
            images=[ImageInput(identity=url_identity("photo"), data=phone_photo, width=4000, height=3000)],
            max_tokens=2,
            temperature=0.0,
        )
    )
    # then it answers, its image counted as the router counted it (from the original size)
    image_tokens = layout.image_tokens(4000, 3000)
    vision_text_tokens = 2  # <|vision_start|> and <|vision_end|>
    assert result.prompt_tokens == text_only.prompt_tokens + image_tokens + vision_text_tokens
    assert result.completion_tokens >= 1
