"""routing.prompt.layouts against transformers' own image processors, run offline.

For each family the oracle is the processor built from a checkpoint directory with the published
settings (tests/model_configs.py). Two kinds of check per family:
- 1,000+ seeded random sizes from 1x1 to 8000x8000 (plus extremes and sizes at the aspect-ratio
  bound) through the processor's own size logic, which needs no pixels: Qwen's
  `get_number_of_image_patches` // merge², LLaVA's `_get_num_multimodal_tokens`;
- 25 real (random-pixel) images per family, small to medium, through the full processor:
  Qwen's `image_grid_thw`, LLaVA's expanded `<image>` tokens in `input_ids`.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoImageProcessor, LlavaNextProcessor, LlavaProcessor, PreTrainedTokenizerFast
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from routing.prompt.layouts import (
    ImageSizeRefused,
    LlavaNextLayout,
    QwenVLLayout,
    layout_for_config,
    layout_for_model_dir,
)
from tests import model_configs

QWEN_FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
LLAVA_FAMILIES = ["llava", "llava_next"]
LLAVA_PROCESSORS = {"llava": LlavaProcessor, "llava_next": LlavaNextProcessor}

EXTREME_SIZES = [
    (1, 1),
    (8000, 8000),
    (1, 8000),
    (8000, 1),
    (1, 200),
    (200, 1),
    (1, 201),
    (201, 1),
    (40, 8000),
    (39, 8000),
    (8000, 40),
    (8000, 39),
    (7, 1400),
    (7, 1401),
    (5, 999),
    (1000, 3),
    (28, 28),
    (27, 29),
    (55, 57),
    (3584, 3584),
    (3585, 3583),
    (336, 672),
    (672, 336),
    (1008, 336),
    (4096, 4096),
]


def random_sizes(seed: int, count: int, low: int = 1, high: int = 8000) -> list[tuple[int, int]]:
    """Sides drawn log-uniformly, so tiny, huge and very elongated images all come up."""
    rng = random.Random(seed)
    span = (np.log(low), np.log(high))

    def side() -> int:
        return max(low, min(high, round(float(np.exp(rng.uniform(*span))))))

    return [(side(), side()) for _ in range(count)]


def real_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


def llava_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer that knows `<image>`: enough for the processor to expand placeholders."""
    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<image>": 1, "describe": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", extra_special_tokens=["<image>"]
    )


def llava_processor_from_dir(model_type: str, directory: Path, tokenizer: PreTrainedTokenizerFast) -> Any:
    settings = json.loads((directory / "processor_config.json").read_text())
    settings.pop("processor_class", None)
    image_processor = AutoImageProcessor.from_pretrained(directory)
    return LLAVA_PROCESSORS[model_type](image_processor=image_processor, tokenizer=tokenizer, **settings)


def expanded_image_tokens(processor: Any, image: Image.Image) -> int:
    inputs = processor(text="describe <image>", images=image)
    return list(inputs["input_ids"][0]).count(processor.image_token_id)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        model_type: model_configs.write_family_dir(root / model_type, model_type)
        for model_type in model_configs.FAMILIES
    }


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return llava_tokenizer()


@pytest.mark.parametrize("model_type", QWEN_FAMILIES)
def test_qwen_counts_equal_the_processor_size_logic_on_random_and_extreme_sizes(
    model_type: str, family_dirs: dict[str, Path]
) -> None:
    # given
    directory = family_dirs[model_type]
    processor = AutoImageProcessor.from_pretrained(directory)
    layout = layout_for_model_dir(directory)
    assert isinstance(layout, QwenVLLayout)
    sizes = EXTREME_SIZES + random_sizes(seed=len(model_type), count=1000)
    refused = 0

    for width, height in sizes:
        # when
        try:
            patches = processor.get_number_of_image_patches(height, width)
        except ValueError:
            # then: what the processor refuses, the layout refuses
            with pytest.raises(ImageSizeRefused):
                layout.image_tokens(width, height)
            refused += 1
            continue
        # then
        assert layout.image_tokens(width, height) == patches // processor.merge_size**2, (width, height)
        _, grid_h, grid_w = layout.grid_thw(width, height)
        assert grid_h * grid_w == patches, (width, height)

    assert 10 < refused < len(sizes) // 2  # both outcomes were exercised


@pytest.mark.parametrize("model_type", QWEN_FAMILIES)
def test_qwen_grid_equals_the_processor_output_on_real_images(
    model_type: str, family_dirs: dict[str, Path]
) -> None:
    # given
    directory = family_dirs[model_type]
    processor = AutoImageProcessor.from_pretrained(directory)
    layout = layout_for_model_dir(directory)
    assert isinstance(layout, QwenVLLayout)
    sizes = [(1, 1), (3, 600), (1, 150), *random_sizes(seed=7, count=22, high=900)]
    sizes = [(w, h) for w, h in sizes if max(w, h) / min(w, h) <= 200]

    for index, (width, height) in enumerate(sizes):
        # when
        outputs = processor(real_image(width, height, seed=index), return_tensors="np")
        # then
        grid = tuple(int(v) for v in outputs["image_grid_thw"][0])
        assert layout.grid_thw(width, height) == grid, (width, height)
        assert layout.image_tokens(width, height) == np.prod(grid) // processor.merge_size**2


@pytest.mark.parametrize("model_type", QWEN_FAMILIES)
def test_an_image_the_qwen_processor_refuses_is_refused_by_the_layout(
    model_type: str, family_dirs: dict[str, Path]
) -> None:
    # given
    processor = AutoImageProcessor.from_pretrained(family_dirs[model_type])
    layout = layout_for_model_dir(family_dirs[model_type])
    assert layout is not None
    for width, height in [(1, 201), (402, 2)]:
        with pytest.raises(ValueError, match="aspect ratio"):
            processor(real_image(width, height, seed=0))
        # when / then
        with pytest.raises(ImageSizeRefused, match=rf"{width}x{height} has an aspect ratio .* over 200"):
            layout.image_tokens(width, height)


@pytest.mark.parametrize("model_type", LLAVA_FAMILIES)
def test_llava_counts_equal_the_processor_size_logic_on_random_and_extreme_sizes(
    model_type: str, family_dirs: dict[str, Path], tokenizer: PreTrainedTokenizerFast
) -> None:
    # given
    processor = llava_processor_from_dir(model_type, family_dirs[model_type], tokenizer)
    layout = layout_for_model_dir(family_dirs[model_type])
    assert layout is not None
    sizes = EXTREME_SIZES + random_sizes(seed=11, count=1000)

    # when
    expected = processor._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in sizes])
    # then
    assert [layout.image_tokens(w, h) for w, h in sizes] == expected["num_image_tokens"]


@pytest.mark.parametrize("model_type", LLAVA_FAMILIES)
def test_llava_counts_equal_the_placeholders_the_processor_expands_on_real_images(
    model_type: str, family_dirs: dict[str, Path], tokenizer: PreTrainedTokenizerFast
) -> None:
    # given
    processor = llava_processor_from_dir(model_type, family_dirs[model_type], tokenizer)
    layout = layout_for_model_dir(family_dirs[model_type])
    assert layout is not None and layout.placeholder_token == processor.image_token
    # LLaVA-1.5 resizes the short side to 336, so very elongated images become huge arrays: those
    # stay with the size-logic test above, and the random sample here keeps ratios under 30.
    sample = [(w, h) for w, h in random_sizes(seed=5, count=60, high=1100) if max(w, h) / min(w, h) < 30]
    sizes = [(1, 1), (30, 900), (900, 30), (336, 672), (1008, 336), *sample[:20]]

    for index, (width, height) in enumerate(sizes):
        # when
        expanded = expanded_image_tokens(processor, real_image(width, height, seed=index))
        # then
        assert layout.image_tokens(width, height) == expanded, (width, height)


def test_llava_1_5_gives_576_tokens_whatever_the_size(family_dirs: dict[str, Path]) -> None:
    layout = layout_for_model_dir(family_dirs["llava"])
    assert layout is not None
    assert {layout.image_tokens(w, h) for w, h in EXTREME_SIZES} == {576}


def test_llava_next_varies_with_the_best_fit_pinpoint(family_dirs: dict[str, Path]) -> None:
    layout = layout_for_model_dir(family_dirs["llava_next"])
    assert isinstance(layout, LlavaNextLayout)
    # A square image fills the 672x672 grid: 48x48 features, 48 newlines, 576 base.
    assert layout.image_tokens(1000, 1000) == 48 * 48 + 48 + 576
    # A wide image picks 336x1008 (h x w) and keeps only the rows it covers.
    assert layout.best_resolution(1000, 300) == (336, 1008)


def test_qwen_max_pixels_override_changes_the_count_as_it_changes_the_processor(tmp_path: Path) -> None:
    # given
    published = model_configs.write_family_dir(tmp_path / "published", "qwen2_vl")
    capped = model_configs.write_family_dir(
        tmp_path / "capped", "qwen2_vl", max_pixels=200_704, min_pixels=50_000
    )
    image = real_image(1200, 800, seed=1)

    for directory in (published, capped):
        # when
        layout = layout_for_model_dir(directory)
        grid = AutoImageProcessor.from_pretrained(directory)(image, return_tensors="np")["image_grid_thw"][0]
        # then
        assert isinstance(layout, QwenVLLayout)
        assert layout.grid_thw(1200, 800) == tuple(int(v) for v in grid)

    published_layout, capped_layout = layout_for_model_dir(published), layout_for_model_dir(capped)
    assert published_layout is not None and capped_layout is not None
    # 1204x812 -> 43x29 merged patches; capped: beta = sqrt(960000 / 200704), 532x364 -> 19x13
    assert published_layout.image_tokens(1200, 800) == 1247
    assert capped_layout.image_tokens(1200, 800) == 247
    # and min_pixels scales a tiny image up to at least that many pixels
    assert (
        capped_layout.image_tokens(10, 10)
        == AutoImageProcessor.from_pretrained(capped).get_number_of_image_patches(10, 10) // 4
    )


def test_qwen_size_form_overrides_like_min_and_max_pixels(tmp_path: Path) -> None:
    # given: the transformers 5 form, size.shortest_edge / longest_edge, with no min/max_pixels
    directory = model_configs.write_model_dir(
        tmp_path,
        model_configs.qwen2_vl_config(),
        {
            "size": {"shortest_edge": 100_000, "longest_edge": 300_000},
            "patch_size": 14,
            "merge_size": 2,
            "image_processor_type": "Qwen2VLImageProcessor",
        },
    )
    processor = AutoImageProcessor.from_pretrained(directory)
    layout = layout_for_model_dir(directory)
    assert layout is not None
    for width, height in [(20, 20), (640, 480), (3000, 2000)]:
        assert layout.image_tokens(width, height) == processor.get_number_of_image_patches(height, width) // 4


def test_llava_next_pinpoint_override_changes_the_count_as_it_changes_the_processor(
    tmp_path: Path, tokenizer: PreTrainedTokenizerFast
) -> None:
    # given
    pinpoints = [[336, 336], [336, 1344], [1344, 336], [672, 1008]]
    default_dir = model_configs.write_family_dir(tmp_path / "default", "llava_next")
    custom_dir = model_configs.write_family_dir(
        tmp_path / "custom", "llava_next", image_grid_pinpoints=pinpoints
    )
    image = real_image(1300, 320, seed=2)

    counts = []
    for directory in (default_dir, custom_dir):
        # when
        processor = llava_processor_from_dir("llava_next", directory, tokenizer)
        layout = layout_for_model_dir(directory)
        assert layout is not None
        # then
        assert layout.image_tokens(1300, 320) == expanded_image_tokens(processor, image)
        counts.append(layout.image_tokens(1300, 320))
    assert counts[0] != counts[1]


def test_llava_feature_count_follows_the_vision_tower_and_select_strategy() -> None:
    config = model_configs.llava_config()
    config["vision_config"] = {"model_type": "clip_vision_model", "image_size": 448, "patch_size": 14}
    preprocessor = model_configs.llava_preprocessor(crop_size={"height": 448, "width": 448})

    layout = layout_for_config(config, preprocessor)
    full = layout_for_config({**config, "vision_feature_select_strategy": "full"}, preprocessor)

    assert layout is not None and full is not None
    assert layout.image_tokens(10, 10) == 32 * 32  # CLS dropped
    assert full.image_tokens(10, 10) == 32 * 32 + 1  # CLS kept


def test_layout_reads_the_processor_config_that_transformers_5_saves(
    tmp_path: Path, family_dirs: dict[str, Path], tokenizer: PreTrainedTokenizerFast
) -> None:
    # given: a processor saved by transformers, image settings nested in processor_config.json
    pinpoints = [[336, 336], [672, 1344], [1344, 672]]
    image_processor = AutoImageProcessor.from_pretrained(
        family_dirs["llava_next"], image_grid_pinpoints=pinpoints
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "processor_config.json").read_text())
    assert saved["image_processor"]["image_grid_pinpoints"] == pinpoints
    # a stale preprocessor_config.json beside it must lose, as it does for transformers
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(model_configs.llava_next_preprocessor()))
    (tmp_path / "config.json").write_text(json.dumps(model_configs.llava_next_config()))

    # when
    layout = layout_for_model_dir(tmp_path)

    # then
    assert layout is not None
    for width, height in [(700, 1300), (1400, 700), (50, 60)]:
        image = real_image(width, height, seed=3)
        assert layout.image_tokens(width, height) == expanded_image_tokens(processor, image)


def test_qwen_without_a_preprocessor_config_uses_the_processor_class_defaults() -> None:
    layout = layout_for_config(model_configs.qwen2_vl_config(), None)
    processor = Qwen2VLImageProcessorPil()

    assert isinstance(layout, QwenVLLayout)
    for width, height in random_sizes(seed=3, count=50):
        try:
            expected = processor.get_number_of_image_patches(height, width) // 4
        except ValueError:
            continue
        assert layout.image_tokens(width, height) == expected


def test_qwen3_vl_without_a_preprocessor_config_uses_its_published_settings() -> None:
    default = layout_for_config(model_configs.qwen3_vl_config(), None)
    published = layout_for_config(model_configs.qwen3_vl_config(), model_configs.qwen3_vl_preprocessor())

    assert default == published
    assert isinstance(default, QwenVLLayout) and default.patch_size * default.merge_size == 32
    assert default.placeholder_token == "<|image_pad|>"


def test_an_unknown_model_type_gives_no_layout(tmp_path: Path) -> None:
    assert layout_for_config({"model_type": "idefics3"}, {"size": {"longest_edge": 1456}}) is None
    assert layout_for_config({"architectures": ["Qwen2VLForConditionalGeneration"]}, None) is None
    directory = model_configs.write_model_dir(tmp_path, {"model_type": "llama"})
    assert layout_for_model_dir(directory) is None


@pytest.mark.parametrize("model_type", [*QWEN_FAMILIES, *LLAVA_FAMILIES])
def test_a_side_under_one_pixel_is_refused(model_type: str, family_dirs: dict[str, Path]) -> None:
    layout = layout_for_model_dir(family_dirs[model_type])
    assert layout is not None
    for width, height in [(0, 10), (10, 0), (-5, 5)]:
        with pytest.raises(ImageSizeRefused, match=rf"{width}x{height} has a side under 1 pixel"):
            layout.image_tokens(width, height)
