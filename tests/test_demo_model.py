"""The demo checkpoint builds offline and loads back with transformers' Auto classes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from django.core.management import CommandError, call_command
from PIL import Image

from workers.demo_model import MAX_PIXELS, SPECIAL_TOKENS, VOCAB_SIZE
from workers.processors import load_processor


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "model"
    call_command("build_demo_model", str(path), "--seed", "3")
    return path


def test_auto_classes_load_the_checkpoint_offline(demo_dir: Path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    image_processor = AutoImageProcessor.from_pretrained(demo_dir)

    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    text = model.config.text_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads) == (256, 4, 4)
    assert (text.num_key_value_heads, text.vocab_size) == (2, VOCAB_SIZE)
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert model.config.vision_config.hidden_size == text.hidden_size
    assert len(tokenizer) == VOCAB_SIZE
    assert image_processor.size["longest_edge"] == MAX_PIXELS
    assert (image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size) == (
        14,
        2,
        2,
    )


def test_config_token_ids_are_the_tokenizers_ids(demo_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(demo_dir)
    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)), strict=True))

    assert config.image_token_id == ids["<|image_pad|>"]
    assert config.video_token_id == ids["<|video_pad|>"]
    assert config.vision_start_token_id == ids["<|vision_start|>"]
    assert config.vision_end_token_id == ids["<|vision_end|>"]
    assert config.text_config.eos_token_id == tokenizer.eos_token_id == ids["<|im_end|>"]
    assert config.text_config.pad_token_id == tokenizer.pad_token_id == ids["<|endoftext|>"]
    # Each special token is one token, never split into bytes.
    assert tokenizer("<|vision_start|><|image_pad|><|vision_end|>")["input_ids"] == [
        ids["<|vision_start|>"],
        ids["<|image_pad|>"],
        ids["<|vision_end|>"],
    ]


def test_chat_template_renders_an_image_message_like_qwen2_vl(demo_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_dir)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "https://example.test/cat.png"}},
                {"type": "text", "text": "What is in the picture?"},
            ],
        }
    ]

    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the picture?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert (demo_dir / "chat_template.jinja").read_text() == tokenizer.chat_template


def test_processor_without_torchvision_expands_the_image_placeholder(demo_dir: Path) -> None:
    processor = load_processor(demo_dir)
    prompt = "<|vision_start|><|image_pad|><|vision_end|>Describe it."

    encoded = processor(text=[prompt], images=[Image.new("RGB", (640, 480), "red")], return_tensors="pt")

    grid = encoded["image_grid_thw"][0].tolist()
    image_token_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    placeholders = int((encoded["input_ids"][0] == image_token_id).sum())
    assert grid[0] == 1 and grid[1] * grid[2] * 14 * 14 <= MAX_PIXELS
    assert placeholders == grid[0] * grid[1] * grid[2] // 4
    assert encoded["mm_token_type_ids"][0].sum() == placeholders


def test_weights_are_readable_by_other_users(demo_dir: Path) -> None:
    mode = stat.S_IMODE((demo_dir / "model.safetensors").stat().st_mode)
    assert mode == 0o644


def test_preprocessor_config_carries_qwen_pixel_bounds(demo_dir: Path) -> None:
    fields = json.loads((demo_dir / "preprocessor_config.json").read_text())
    assert (fields["min_pixels"], fields["max_pixels"]) == (56 * 56, 448 * 448)
    assert (fields["patch_size"], fields["merge_size"], fields["temporal_patch_size"]) == (14, 2, 2)


def test_command_refuses_to_overwrite_without_force(demo_dir: Path) -> None:
    before = (demo_dir / "model.safetensors").stat().st_mtime_ns
    with pytest.raises(CommandError, match="--force"):
        call_command("build_demo_model", str(demo_dir))
    assert (demo_dir / "model.safetensors").stat().st_mtime_ns == before


def test_the_size_option_changes_only_the_language_models_dimensions() -> None:
    from workers.demo_model import TEXT_SIZES, _demo_config

    token_ids = {token: n for n, token in enumerate(SPECIAL_TOKENS)}
    tiny = _demo_config(token_ids).to_dict()
    for size in ("small", "medium"):
        larger = _demo_config(token_ids, size=size).to_dict()
        text = larger["text_config"]
        assert {name: text[name] for name in TEXT_SIZES[size]} == TEXT_SIZES[size]
        assert text["hidden_size"] * text["num_hidden_layers"] > 256 * 4
        # the same head size, so the same rotary sections; the same vocabulary and vision tower
        assert text["hidden_size"] // text["num_attention_heads"] == 64
        assert text["rope_parameters"] == tiny["text_config"]["rope_parameters"]
        assert text["vocab_size"] == VOCAB_SIZE
        assert {k: v for k, v in larger["vision_config"].items() if k != "hidden_size"} == {
            k: v for k, v in tiny["vision_config"].items() if k != "hidden_size"
        }
        assert larger["vision_config"]["hidden_size"] == text["hidden_size"]


def test_the_command_builds_sizes_of_the_qwen2_vl_demo_only(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="--size"):
        call_command("build_demo_model", str(tmp_path / "q3"), "--family", "qwen3_vl", "--size", "small")
    assert not (tmp_path / "q3").exists()


@pytest.mark.parametrize(
    ("size", "text_dims", "billions"),
    [
        ("qwen2-vl-2b", (1536, 8960, 28, 12, 2), 1.98),
        ("qwen2-vl-7b", (3584, 18944, 28, 28, 4), 7.23),
    ],
)
def test_a_published_size_has_that_models_language_model_and_vision_tower(size, text_dims, billions) -> None:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    from workers.demo_model import _demo_config

    # given: the config of a published size (the demo tokenizer's ids)
    token_ids = {token: n for n, token in enumerate(SPECIAL_TOKENS)}
    config = _demo_config(token_ids, size=size)
    text, vision = config.text_config, config.vision_config
    # then: Qwen2-VL's published dimensions, head size 128 and M-RoPE sections over its 64 frequencies
    assert (
        text.hidden_size,
        text.intermediate_size,
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
    ) == text_dims
    assert text.hidden_size // text.num_attention_heads == 128
    assert text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert text.rope_parameters["rope_theta"] == 1_000_000.0
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.mlp_ratio) == (32, 1280, 16, 4)
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)
    assert vision.hidden_size == text.hidden_size
    assert text.vocab_size == VOCAB_SIZE
    # and: built on the meta device (no memory), the parameters of that model, the demo vocabulary's
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


def test_the_command_takes_a_published_size_but_not_a_heavier_tower_for_it(tmp_path: Path) -> None:
    with pytest.raises(CommandError, match="--heavy-vision"):
        call_command("build_demo_model", str(tmp_path / "big"), "--size", "qwen2-vl-7b", "--heavy-vision")
    assert not (tmp_path / "big").exists()
