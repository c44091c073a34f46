"""The processor token view: routing on the model's own processor output, for families the registry lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image

from routing.media.images import pixel_identity, routing_hash
from routing.prompt.layouts import layout_for_model_dir
from routing.prompt.model_view import model_view
from routing.prompt.processor_view import (
    UnsupportedProcessorLayout,
    decode_processed,
    image_spans,
    processor_for,
    processor_token_view,
)
from routing.prompt.token_view import ImageFacts, build_token_view

os.environ["HF_HUB_OFFLINE"] = "1"

BLOCK_SIZE = 8
GEMMA3_SPECIAL_TOKENS = (
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
GEMMA3_IMAGE_TOKENS = 16  # the processor's image_seq_length: small, so the test stays fast
# Gemma 3's chat template, reduced to what these tests send (text and image parts).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def two_image_messages(
    first: str = "Here is the first picture:", between: str = "and the second one:"
) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": first},
                {"type": "image"},
                {"type": "text", "text": between},
                {"type": "image"},
                {"type": "text", "text": "Which one is redder?"},
            ],
        }
    ]


def facts_of(images: list[Image.Image]) -> list[ImageFacts]:
    facts = []
    for image in images:
        identity = pixel_identity(image)
        facts.append(ImageFacts(identity, routing_hash(identity), image.width, image.height))
    return facts


def build_gemma3_checkpoint(path: Path) -> None:
    """A Gemma 3 checkpoint without weights: config, a locally trained tokenizer, the processor configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=list(GEMMA3_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["Here is the first picture and the second one: which one is redder, the cat or the dog?"] * 50
    backend.train_from_iterator(corpus, trainer=trainer)
    ids = {token: backend.token_to_id(token) for token in GEMMA3_SPECIAL_TOKENS}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        # Gemma3Processor reads these three off the tokenizer.
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    processor = Gemma3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=GEMMA3_CHAT_TEMPLATE,
        image_seq_length=GEMMA3_IMAGE_TOKENS,
    )
    processor.save_pretrained(path)
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": GEMMA3_IMAGE_TOKENS,
        "text_config": {"model_type": "gemma3_text", "vocab_size": 400},
        "vision_config": {"model_type": "siglip_vision_model", "image_size": 64, "patch_size": 16},
    }
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "gemma3-tiny"
    path.mkdir()
    build_gemma3_checkpoint(path)
    return path


def gemma3_token_ids(gemma3_dir: Path) -> tuple[int, int, int]:
    config = json.loads((gemma3_dir / "config.json").read_text())
    return config["image_token_index"], config["boi_token_index"], config["eoi_token_index"]


def test_qwen2_vl_processor_view_equals_the_registry_view_and_its_hashes(demo_model_dir):
    # given
    model = model_view(demo_model_dir)
    prompt = model.render_prompt(two_image_messages())
    images = [Image.new("RGB", (640, 480), (200, 30, 30)), Image.new("RGB", (123, 457), (10, 200, 10))]
    facts = facts_of(images)

    # when
    registry = build_token_view(
        model.encode(prompt),
        facts,
        layout=model.image_layout,
        placeholder_id=model.image_placeholder_id,
        block_size=BLOCK_SIZE,
        model_type=model.model_type,
    )
    processed = processor_token_view(demo_model_dir, prompt, images, facts, block_size=BLOCK_SIZE)

    # then
    assert registry.fallback is None and processed.view.fallback is None
    assert processed.view.tokens == registry.tokens
    assert [(i.start, i.tokens) for i in processed.view.images] == [
        (i.start, i.tokens) for i in registry.images
    ]
    assert [i.identity for i in processed.view.images] == [f.identity for f in facts]
    assert processed.view.block_hashes == registry.block_hashes
    assert processed.view.prompt_tokens == registry.prompt_tokens


def test_qwen2_vl_processed_inputs_round_trip_through_json_to_the_processors_tensors(demo_model_dir):
    import torch

    model = model_view(demo_model_dir)
    prompt = model.render_prompt(two_image_messages())
    images = [
        Image.effect_mandelbrot((96, 64), (-2, -1, 1, 1), 50).convert("RGB"),
        Image.new("RGB", (70, 200)),
    ]
    processed = processor_token_view(demo_model_dir, prompt, images, facts_of(images), block_size=BLOCK_SIZE)

    expected = processor_for(demo_model_dir)(text=[prompt], images=images, return_tensors="pt")
    decoded = decode_processed(json.loads(json.dumps(processed.processed)))

    assert set(decoded) == set(expected)
    for key, tensor in expected.items():
        assert decoded[key].dtype == tensor.dtype, key
        assert torch.equal(decoded[key], tensor), key
    assert processed.processed["input_ids"] == processed.view.tokens
    assert processed.processed["pixel_values"]["dtype"] == "float32"
    assert processed.processed["image_grid_thw"]["values"] == expected["image_grid_thw"].tolist()


def test_gemma3_outside_the_registry_falls_back_to_text_while_the_processor_view_is_exact(gemma3_dir):
    # given
    soft, begin, end = gemma3_token_ids(gemma3_dir)
    model = model_view(gemma3_dir)
    prompt = model.render_prompt(two_image_messages())
    images = [Image.new("RGB", (300, 200), (200, 30, 30)), Image.new("RGB", (50, 90), (0, 0, 255))]
    facts = facts_of(images)

    # when
    registry = build_token_view(
        model.encode(prompt),
        facts,
        layout=model.image_layout,
        placeholder_id=model.image_placeholder_id,
        block_size=BLOCK_SIZE,
        model_type=model.model_type,
    )
    view = processor_token_view(gemma3_dir, prompt, images, facts, block_size=BLOCK_SIZE).view

    # then
    assert layout_for_model_dir(gemma3_dir) is None
    assert registry.fallback and "gemma3" in registry.fallback
    expected_ids = processor_for(gemma3_dir)(text=[prompt], images=images, return_tensors="pt")["input_ids"]
    assert view.fallback is None
    assert view.tokens == expected_ids[0].tolist()
    assert len(view.tokens) > len(registry.tokens)
    for image in view.images:
        assert image.tokens == GEMMA3_IMAGE_TOKENS
        assert view.tokens[image.start : image.start + image.tokens] == [soft] * GEMMA3_IMAGE_TOKENS
        assert view.tokens[image.start - 1] == begin and view.tokens[image.start + image.tokens] == end


def test_gemma3_pan_and_scan_crops_of_one_image_make_one_span_from_first_to_last_image_token(gemma3_dir):
    soft, _, _ = gemma3_token_ids(gemma3_dir)
    prompt = model_view(gemma3_dir).render_prompt(two_image_messages())
    # Wide enough for crops at the processor's minimum crop side (256); the square one gets none.
    images = [Image.new("RGB", (1200, 300), (200, 30, 30)), Image.new("RGB", (300, 300), (0, 0, 255))]
    options = {"do_pan_and_scan": True}

    view = processor_token_view(
        gemma3_dir, prompt, images, facts_of(images), block_size=BLOCK_SIZE, processor_kwargs=options
    ).view

    # The processor's own defaults for the crops, which it passes to its image processor.
    crops = processor_for(gemma3_dir).image_processor(
        images,
        **options,
        pan_and_scan_min_crop_size=256,
        pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )["num_crops"]
    wide_crops, square_crops = (int(n) for n in crops)
    assert wide_crops > 0 and square_crops == 0
    wide, square = view.images
    wide_span = view.tokens[wide.start : wide.start + wide.tokens]
    assert wide_span[0] == soft and wide_span[-1] == soft
    assert wide_span.count(soft) == GEMMA3_IMAGE_TOKENS * (1 + wide_crops)
    assert square.tokens == GEMMA3_IMAGE_TOKENS
    assert view.tokens.count(soft) == wide_span.count(soft) + square.tokens


def test_gemma3_a_different_second_image_changes_only_the_blocks_from_its_span_on(gemma3_dir):
    prompt = model_view(gemma3_dir).render_prompt(two_image_messages())
    red, blue, green = (
        Image.new("RGB", (80, 60), colour) for colour in ((200, 30, 30), (0, 0, 255), (0, 200, 0))
    )

    before = processor_token_view(
        gemma3_dir, prompt, [red, blue], facts_of([red, blue]), block_size=BLOCK_SIZE
    )
    after = processor_token_view(
        gemma3_dir, prompt, [red, green], facts_of([red, green]), block_size=BLOCK_SIZE
    )

    hashes, changed = before.view.block_hashes, after.view.block_hashes
    assert before.view.tokens == after.view.tokens  # same size: only the identity differs
    first_affected = after.view.images[1].start // BLOCK_SIZE
    assert first_affected > 0
    assert changed[:first_affected] == hashes[:first_affected]
    assert all(a != b for a, b in zip(changed[first_affected:], hashes[first_affected:], strict=True))


def test_gemma3_the_same_image_at_another_place_changes_only_the_blocks_from_the_first_moved_one(gemma3_dir):
    prompt = model_view(gemma3_dir).render_prompt(two_image_messages())
    red, blue = Image.new("RGB", (80, 60), (200, 30, 30)), Image.new("RGB", (80, 60), (0, 0, 255))

    order = processor_token_view(
        gemma3_dir, prompt, [red, blue], facts_of([red, blue]), block_size=BLOCK_SIZE
    )
    swapped = processor_token_view(
        gemma3_dir, prompt, [blue, red], facts_of([blue, red]), block_size=BLOCK_SIZE
    )

    first_affected = order.view.images[0].start // BLOCK_SIZE
    assert first_affected > 0
    assert swapped.view.block_hashes[:first_affected] == order.view.block_hashes[:first_affected]
    assert swapped.view.block_hashes[first_affected] != order.view.block_hashes[first_affected]


def test_gemma3_processed_inputs_round_trip_through_json(gemma3_dir):
    import torch

    prompt = model_view(gemma3_dir).render_prompt(two_image_messages())
    images = [Image.new("RGB", (80, 60), (200, 30, 30)), Image.new("RGB", (40, 90), (0, 0, 255))]
    processed = processor_token_view(gemma3_dir, prompt, images, facts_of(images), block_size=BLOCK_SIZE)

    expected = processor_for(gemma3_dir)(text=[prompt], images=images, return_tensors="pt")
    decoded = decode_processed(json.loads(json.dumps(processed.processed)))

    assert set(decoded) == set(expected)
    assert all(torch.equal(decoded[key], tensor) for key, tensor in expected.items())


def test_runs_are_attributed_one_per_image_when_the_processor_reports_no_offsets():
    ids = [1, 2, 9, 9, 9, 3, 4, 9, 9, 5]
    assert image_spans(ids, 9, 2) == [(2, 5), (7, 9)]


def test_more_runs_than_images_without_offsets_is_an_unsupported_layout():
    ids = [1, 9, 9, 3, 9, 9, 4, 9, 5]
    with pytest.raises(UnsupportedProcessorLayout, match=r"3 runs of the image token \(id 9\) for 2 images"):
        image_spans(ids, 9, 2, model_type="tiled_vl")


def test_fault_injected_processor_without_offsets_refuses_pan_and_scan_crops(gemma3_dir, monkeypatch):
    processor = processor_for(gemma3_dir)
    real_call = type(processor).__call__

    def call_without_offsets(self, *args, **kwargs):
        outputs = real_call(self, *args, **kwargs)
        outputs.pop("text_replacement_offsets", None)  # as a processor that cannot report them would
        return outputs

    monkeypatch.setattr(type(processor), "__call__", call_without_offsets)
    prompt = model_view(gemma3_dir).render_prompt(two_image_messages())
    images = [Image.new("RGB", (1200, 300)), Image.new("RGB", (300, 300))]
    facts = facts_of(images)

    with pytest.raises(UnsupportedProcessorLayout, match="no per-image replacement offsets"):
        processor_token_view(
            gemma3_dir,
            prompt,
            images,
            facts,
            block_size=BLOCK_SIZE,
            processor_kwargs={"do_pan_and_scan": True},
        )
    # One run per image needs no offsets.
    view = processor_token_view(gemma3_dir, prompt, images, facts, block_size=BLOCK_SIZE).view
    assert [image.tokens for image in view.images] == [GEMMA3_IMAGE_TOKENS, GEMMA3_IMAGE_TOKENS]


def test_a_model_type_transformers_has_no_processor_for_is_an_unsupported_layout(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mystery_vl"}))
    with pytest.raises(UnsupportedProcessorLayout, match="mystery_vl"):
        processor_token_view(tmp_path, "hi", [], [], block_size=BLOCK_SIZE)


def test_the_processor_is_loaded_once_per_model_directory_across_threads(gemma3_dir):
    loaded: list[object] = []
    threads = [threading.Thread(target=lambda: loaded.append(processor_for(gemma3_dir))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loaded) == 4 and all(processor is loaded[0] for processor in loaded)


def test_importing_the_module_imports_neither_torch_nor_transformers():
    code = (
        "import sys, routing.prompt.processor_view;"
        " print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout.strip() == "[]"
