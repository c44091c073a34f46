"""The engine on the demo Qwen2-VL: prefix KV reuse and embedding reuse change nothing in the
output, skip the vision encoder, and the KV events describe the cache exactly."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from PIL import Image

from routing.contract.kv_events import KvEvent
from routing.media.images import routing_hash, url_identity
from routing.prompt.hashing import MediaPlacement, block_hashes
from workers.engine import (
    WARM_UP_PROMPT,
    Engine,
    GenerationRequest,
    GenerationResult,
    ImageChangedError,
    ImageInput,
    IncrementalDetokenizer,
    PromptError,
    load_image_directly,
)
from workers.processors import load_processor

BLOCK = 16
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


class EventLog:
    """Replays KV events into the set of blocks the router's index would believe we hold."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.blocks: set[int] = set()

    def __call__(self, events: Sequence[KvEvent]) -> None:
        for event in events:
            self.kinds.append(event.kind)
            if event.kind == "stored":
                self.blocks.update(event.block_hashes)
            elif event.kind == "removed":
                self.blocks.difference_update(event.block_hashes)
            else:
                self.blocks.clear()


@pytest.fixture
def make_engine(demo_engine) -> Iterator:
    def make(capacity: int = 512, events: EventLog | None = None) -> Engine:
        return demo_engine(capacity=capacity, events=events)

    yield make


def png(width: int, height: int, seed: int) -> bytes:
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed))
    buffer = io.BytesIO()
    Image.fromarray(pixels.to(torch.uint8).numpy()).save(buffer, "PNG")
    return buffer.getvalue()


def image_input(seed: int, width: int = 112, height: int = 84) -> ImageInput:
    data = png(width, height, seed)
    return ImageInput(identity=url_identity(f"https://img.test/{seed}.png"), data=data)


def chat(user: str, *, images: int = 0, before: str = "") -> str:
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * images
    return f"{SYSTEM}<|im_start|>user\n{before}{vision}{user}<|im_end|>\n<|im_start|>assistant\n"


def request(prompt: str, images: Sequence[ImageInput] = (), **options: object) -> GenerationRequest:
    options.setdefault("max_tokens", 8)
    return GenerationRequest(request_id="t", prompt=prompt, images=list(images), **options)


@pytest.fixture
def encoder_calls(shared_parts: tuple[object, object]) -> Iterator[list[int]]:
    model = shared_parts[0]
    calls: list[int] = []
    handle = model.model.visual.register_forward_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


LONG_TEXT = " ".join(["the red apple on the table near a quiet garden"] * 6)


# --- tokenization and the cold path against transformers itself ----------------------------------
def test_prompt_ids_are_the_processors_and_cold_output_is_transformers_generate(make_engine) -> None:
    engine = make_engine()
    image = image_input(1)
    prompt = chat("What is in the picture?", images=1)
    pil = Image.open(io.BytesIO(image.data))
    encoded = engine.processor(text=[prompt], images=[pil], return_tensors="pt")

    result = engine.generate(request(prompt, [image], max_tokens=10))

    assert engine.prompt_token_ids(prompt, [pil]) == encoded["input_ids"][0].tolist()
    with torch.inference_mode():
        reference = engine.model.generate(**encoded, max_new_tokens=10, do_sample=False)
    expected = engine.tokenizer.decode(
        reference[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True
    )
    assert result.text == expected
    assert result.prompt_tokens == encoded["input_ids"].shape[1]
    assert (result.cached_tokens, result.encoder_calls) == (0, 1)


def test_block_hashes_are_routings_with_the_images_identity(make_engine) -> None:
    engine = make_engine()
    image = image_input(2)
    prompt = chat("Describe it.", images=1)
    pil = Image.open(io.BytesIO(image.data))
    ids = engine.prompt_token_ids(prompt, [pil])
    start = ids.index(engine.image_token_id)
    length = ids.count(engine.image_token_id)

    result = engine.generate(request(prompt, [image], max_tokens=1))

    expected = block_hashes(ids, BLOCK, [MediaPlacement(routing_hash(image.identity), start, length)])
    assert result.block_hashes == expected
    assert set(expected) == engine.kv_block_hashes()


# --- prefix reuse changes nothing --------------------------------------------------------------------
@pytest.mark.parametrize("images", [0, 1], ids=["text", "image"])
def test_output_with_a_prefix_hit_equals_output_without_cache(make_engine, images: int) -> None:
    shared = [image_input(3)] * images
    first = chat(LONG_TEXT + " Which fruit is it?", images=images)
    second = chat(LONG_TEXT + " Where is the garden?", images=images)
    cold = make_engine()
    expected = [
        cold.generate(request(second, shared, **opts)) for opts in ({}, {"temperature": 1.0, "seed": 5})
    ]

    warm = make_engine()
    warm.generate(request(first, shared))
    results = [
        warm.generate(request(second, shared, **opts)) for opts in ({}, {"temperature": 1.0, "seed": 5})
    ]

    assert results[0].cached_tokens >= BLOCK * 3
    # Greedy text, and seeded sampling (sensitive to any change in the distribution), agree.
    assert [r.text for r in results] == [r.text for r in expected]
    assert results[1].cached_tokens == len(results[1].block_hashes) * BLOCK


@pytest.fixture
def first_token_logits(shared_parts: tuple[object, object]) -> Iterator:
    """Runs a one-token request; returns its result and its prefill's last-position logits,
    read with a hook on the LM head."""
    model = shared_parts[0]
    seen: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, output: seen.append(output[0, -1].clone()))

    def run(
        engine: Engine, prompt: str, images: Sequence[ImageInput]
    ) -> tuple[GenerationResult, torch.Tensor]:
        seen.clear()
        result = engine.generate(request(prompt, images, max_tokens=1))
        return result, seen[0]

    yield run
    handle.remove()


@pytest.mark.parametrize(
    ("images", "after_image"),
    [(0, "Shared words. " * 4), (1, "Shared words. " * 4), (1, "")],
    ids=["text", "image", "image-cut-by-the-boundary"],
)
def test_prefill_after_a_prefix_hit_gives_the_logits_of_a_full_prefill(
    make_engine, first_token_logits, images: int, after_image: str
) -> None:
    # With random weights, outputs barely depend on positions; the logits show an off-by-one
    # (about 7e-3 here) or the 1-D position fallback (about 1e-2) that output text would hide.
    shared = [image_input(15)] * images
    before = LONG_TEXT + "Look here. "  # puts the image's end 7 tokens into a block
    first = chat(after_image + "Which fruit?", images=images, before=before)
    second = chat(after_image + "Whose garden?", images=images, before=before)
    engine = make_engine()
    engine.generate(request(first, shared, max_tokens=1))

    warm, warm_logits = first_token_logits(engine, second, shared)
    cold, cold_logits = first_token_logits(make_engine(), second, shared)

    assert warm.cached_tokens >= 4 * BLOCK and cold.cached_tokens == 0
    assert warm.encoder_calls == 0 and cold.encoder_calls == images
    if images and not after_image:
        # the image ends inside the first block that differs: its embedding came from the cache
        assert warm.embedding_cache_hits == 1
    assert torch.allclose(warm_logits, cold_logits, rtol=0, atol=1e-4)


def test_repeated_image_prompt_reuses_its_blocks_without_the_vision_encoder(
    make_engine, encoder_calls
) -> None:
    engine = make_engine()
    image = image_input(4, 224, 168)
    prompt = chat("Count the birds in the picture.", images=1, before="Look closely. ")

    cold = engine.generate(request(prompt, [image]))
    calls_after_cold = len(encoder_calls)
    warm = engine.generate(request(prompt, [image]))

    assert (cold.encoder_calls, calls_after_cold) == (1, 1)
    assert warm.cached_tokens >= (warm.prompt_tokens // BLOCK) * BLOCK - 1
    assert warm.cached_tokens > warm.prompt_tokens - BLOCK - 1
    assert len(encoder_calls) == 1 and warm.encoder_calls == 0
    assert warm.embedding_cache_hits == warm.embedding_cache_misses == 0  # not even looked up
    assert warm.text == cold.text


def test_an_image_cut_by_the_prefix_boundary_comes_from_the_embedding_cache(
    make_engine, encoder_calls
) -> None:
    # given a prompt whose image ends inside a block, then one that differs right after the image
    engine = make_engine()
    image = image_input(5)  # 112x84 -> 12 image tokens
    before = "Please look at this. "
    first, second = chat("Alpha?", images=1, before=before), chat("Zeta?", images=1, before=before)
    ids = engine.prompt_token_ids(second, [Image.open(io.BytesIO(image.data))])
    start = ids.index(engine.image_token_id)
    end = start + ids.count(engine.image_token_id)
    assert start // BLOCK < end // BLOCK and end % BLOCK, "the image must straddle a block boundary"
    engine.generate(request(first, [image]))

    # when the second prompt reuses the blocks before the image's last one
    result = engine.generate(request(second, [image]))

    # then the image is not encoded again, and the output is that of a cold engine
    assert result.cached_tokens == (end // BLOCK) * BLOCK
    assert (result.encoder_calls, result.embedding_cache_hits) == (0, 1)
    assert len(encoder_calls) == 1
    assert result.text == make_engine().generate(request(second, [image])).text


def test_a_kv_miss_on_a_known_image_skips_the_encoder_with_identical_output(make_engine) -> None:
    engine = make_engine()
    image = image_input(6)
    prompt = chat("What colour dominates?", images=1)
    cold = engine.generate(request(prompt, [image], temperature=1.0, seed=11))
    engine.clear_kv_cache()

    again = engine.generate(request(prompt, [image], temperature=1.0, seed=11))

    assert (again.cached_tokens, again.encoder_calls, again.embedding_cache_hits) == (0, 0, 1)
    assert again.text == cold.text


def test_requests_without_embedding_cache_neither_read_nor_fill_it(make_engine) -> None:
    engine = make_engine()
    image = image_input(7)
    prompt = chat("Is it dark?", images=1)

    first = engine.generate(request(prompt, [image], use_embedding_cache=False))
    engine.clear_kv_cache()
    second = engine.generate(request(prompt, [image], use_embedding_cache=False))

    assert (first.encoder_calls, second.encoder_calls) == (1, 1)
    assert len(engine.embedding_cache) == 0


def test_scopes_do_not_share_embeddings(make_engine) -> None:
    engine = make_engine()
    image = image_input(8)
    prompt = chat("Is it bright?", images=1)
    engine.generate(request(prompt, [image], scope_key="scope-a"))
    engine.clear_kv_cache()

    other = engine.generate(request(prompt, [image], scope_key="scope-b"))

    assert (other.encoder_calls, other.embedding_cache_misses) == (1, 1)


# --- the cache's size and its events -----------------------------------------------------------------
def test_events_replayed_after_evictions_equal_the_cached_blocks(make_engine) -> None:
    log = EventLog()
    engine = make_engine(capacity=12, events=log)
    prompts = [chat(f"Question {n % 4}: {LONG_TEXT}", images=n % 2) for n in range(6)]
    for n, prompt in enumerate(prompts):
        engine.generate(request(prompt, [image_input(9)] * (n % 2), max_tokens=2))

    assert log.kinds[0] == "cleared"
    assert "removed" in log.kinds
    assert log.blocks == engine.kv_block_hashes()
    assert len(engine.kv_block_hashes()) <= 12
    held = len(log.blocks)
    assert engine.clear_kv_cache() == held and log.kinds[-1] == "cleared"
    assert log.blocks == engine.kv_block_hashes() == set()


def test_a_request_larger_than_the_whole_pool_is_refused_as_context_length_exceeded(make_engine) -> None:
    prompt = chat(LONG_TEXT * 2, images=1)
    small = make_engine(capacity=2)

    with pytest.raises(PromptError) as refused:
        small.generate(request(prompt, [image_input(10)]))

    # OpenAI's code, the limit in tokens (the pool's 2 blocks), no worker setting named
    assert (refused.value.status, refused.value.code) == (400, "context_length_exceeded")
    message = str(refused.value)
    assert f"maximum context length is {2 * small.block_size} tokens" in message
    assert "KV_CAPACITY_BLOCKS" not in message and "blocks" not in message
    assert small.load_report().kv_blocks_used == 0


# --- decoding ------------------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible(make_engine) -> None:
    engine = make_engine()
    prompt = chat("Tell me a story about a garden.")
    runs = [
        engine.generate(request(prompt, temperature=1.0, top_p=0.9, seed=s, max_tokens=16)) for s in (1, 1, 2)
    ]

    assert runs[0].text == runs[1].text
    assert runs[0].text != runs[2].text


def test_max_tokens_ends_with_length(make_engine) -> None:
    result = make_engine().generate(request(chat("Go on."), temperature=1.0, seed=3, max_tokens=5))
    assert (result.finish_reason, result.completion_tokens) == ("length", 5)


def test_stop_strings_end_the_text_and_are_not_sent(make_engine) -> None:
    engine = make_engine()
    prompt = chat("Tell me a story about a garden.")
    full = engine.generate(request(prompt, temperature=1.0, seed=21, max_tokens=24)).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    pieces: list[str] = []

    stopped = engine.generate(
        request(prompt, temperature=1.0, seed=21, max_tokens=24, stop=["never-seen", stop]),
        on_token=pieces.append,
    )

    assert stopped.finish_reason == "stop"
    assert stopped.text == full[: full.index(stop)]
    assert "".join(pieces) == stopped.text


def test_streamed_pieces_join_to_the_text_and_first_token_is_signalled(make_engine) -> None:
    events: list[str] = []
    result = make_engine().generate(
        request(chat("Hello"), temperature=1.0, seed=4, max_tokens=12),
        on_token=lambda piece: events.append(f"token:{piece}"),
        on_first_token=lambda: events.append("first"),
    )
    assert events[0] == "first"
    assert "".join(event[6:] for event in events[1:]) == result.text
    assert 0 < result.ttft_ms <= result.total_ms and result.prefill_ms <= result.ttft_ms


def test_should_stop_cancels_generation(make_engine) -> None:
    produced: list[str] = []
    result = make_engine().generate(
        request(chat("Hello"), temperature=1.0, seed=4, max_tokens=40),
        on_token=produced.append,
        should_stop=lambda: len(produced) >= 2,
    )
    assert result.completion_tokens < 40


def test_multibyte_characters_are_streamed_whole(demo_model_dir: Path) -> None:
    tokenizer = load_processor(demo_model_dir).tokenizer
    text = "café ☕ naïve — ünïcödé 日本"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text) // 2  # byte-level pieces split these characters
    detokenizer = IncrementalDetokenizer(tokenizer)

    pieces = [detokenizer.push(token) for token in ids]

    assert "".join(pieces) + detokenizer.flush() == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_concurrent_requests_get_the_same_answers_as_sequential_ones(make_engine) -> None:
    engine = make_engine()
    prompts = [chat(f"Question number {n} about the garden.") for n in range(3)]
    sequential = [make_engine().generate(request(p, temperature=1.0, seed=9)).text for p in prompts]
    answers: dict[int, str] = {}

    def ask(n: int) -> None:
        answers[n] = engine.generate(request(prompts[n], temperature=1.0, seed=9)).text

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert [answers[n] for n in range(3)] == sequential


def test_data_url_images_load_in_process(make_engine) -> None:
    data = png(64, 64, 12)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    by_url = ImageInput(identity=url_identity(url), url=url)
    engine = make_engine()

    result = engine.generate(request(chat("What is it?", images=1), [by_url], max_tokens=3))
    engine.clear_kv_cache()
    same = engine.generate(request(chat("What is it?", images=1), [ImageInput(url_identity(url), data=data)]))

    assert result.prompt_tokens == same.prompt_tokens
    assert result.text == same.text[: len(result.text)]


def test_a_prompt_whose_placeholders_do_not_match_its_images_is_refused(make_engine) -> None:
    with pytest.raises(PromptError, match="placeholders") as refused:
        make_engine().generate(request(chat("Two?", images=2), [image_input(13)]))
    assert refused.value.status == 400


# --- another family member ---------------------------------------------------------------------------
def build_tiny_qwen2_5_vl(path: Path, demo_dir: Path) -> None:
    """A random Qwen2.5-VL sharing the demo's tokenizer and image processor files."""
    import json
    import shutil

    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    path.mkdir(parents=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
    ):
        shutil.copy(demo_dir / name, path / name)
    demo = json.loads((demo_dir / "config.json").read_text())
    ids = {
        key: demo[key]
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    }
    text = {key: demo["text_config"][key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = Qwen2_5_VLConfig(
        text_config={
            **text,
            "vocab_size": 4096,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]},
        },
        vision_config={
            "depth": 2,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 2,
            "out_hidden_size": 128,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
        **ids,
    )
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(path)


def test_a_qwen2_5_vl_checkpoint_loads_and_reuses_its_prefix(demo_model_dir: Path, tmp_path: Path) -> None:
    build_tiny_qwen2_5_vl(tmp_path / "qwen25", demo_model_dir)
    engine = Engine.load(tmp_path / "qwen25")
    image = image_input(14)
    first = chat(LONG_TEXT + " Which fruit?", images=1)
    second = chat(LONG_TEXT + " Which garden?", images=1)

    engine.generate(request(first, [image]))
    warm = engine.generate(request(second, [image]))
    engine.clear_kv_cache()
    engine.embedding_cache.clear()
    cold = engine.generate(request(second, [image]))

    assert engine.model_type == "qwen2_5_vl"
    assert (warm.encoder_calls, cold.encoder_calls) == (0, 1)
    assert warm.cached_tokens >= 3 * BLOCK
    assert warm.text == cold.text


def test_with_declared_sizes_an_image_inside_the_cached_prefix_is_never_loaded(make_engine) -> None:
    # given an engine counting its image loads, and images whose size the frontend declared
    engine = make_engine()
    loads: list[str] = []

    def counting_loader(image: ImageInput, scope_key: str | None) -> Image.Image:
        loads.append(image.identity)
        return load_image_directly(image, scope_key)

    engine._load_image = counting_loader
    sized = dataclasses.replace(image_input(4, 224, 168), width=224, height=168)
    undeclared = image_input(4, 224, 168)
    prompt = chat("Count the birds in the picture.", images=1, before="Look closely. ")

    # when the same prompt comes twice
    cold = engine.generate(request(prompt, [sized]))
    warm = engine.generate(request(prompt, [sized]))

    # then the image was loaded for the cold request only, and the answers agree with an
    # engine that loads every image to learn its size
    assert len(loads) == 1
    assert warm.cached_tokens > warm.prompt_tokens - BLOCK - 1
    reference = make_engine().generate(request(prompt, [undeclared]))
    assert (cold.text, cold.prompt_tokens, cold.block_hashes) == (
        reference.text, reference.prompt_tokens, reference.block_hashes,
    )  # fmt: skip


def test_an_image_whose_size_changed_since_routing_is_refused(make_engine) -> None:
    engine = make_engine()
    lying = dataclasses.replace(image_input(4, 224, 168), width=100, height=100)
    with pytest.raises(ImageChangedError, match="changed at its origin") as refused:
        engine.generate(request(chat("What is this?", images=1), [lying]))
    # the frontend's cue to read the picture's size afresh, and the client's to send it again
    assert (refused.value.status, refused.value.code) == (409, "image_changed")


def test_a_warm_up_runs_the_model_and_leaves_nothing_behind(make_engine) -> None:
    # given an engine whose KV events the router would replay
    events = EventLog()
    engine = make_engine(events=events)
    kinds_before = list(events.kinds)  # the `cleared` a new engine says of its previous life

    # when it warms up before taking requests
    took_ms = engine.warm_up()

    # then the model ran (a forward pass took time), and nothing of it is left: no block cached or
    # announced, and the counters a heartbeat reports, the prefill rate first, as a new engine's
    assert took_ms > 0
    assert events.kinds == kinds_before
    assert engine.kv_block_hashes() == set()
    report = engine.load_report()
    assert (report.kv_blocks_cached, report.kv_blocks_used, report.forward_passes) == (0, 0, 0)
    assert (report.generated_tokens, report.running_peak, report.prefill_tokens_per_s) == (0, 0, 0.0)
    # and it serves as before: the warm-up's own prompt is computed in full, and the prefill rate
    # is measured afresh
    answer = engine.generate(
        GenerationRequest(request_id="again", prompt=WARM_UP_PROMPT, images=[], max_tokens=2, ignore_eos=True)
    )
    assert answer.cached_tokens == 0
    assert engine.load_report().prefill_tokens_per_s > 0
