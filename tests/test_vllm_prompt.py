"""The prompt a vLLM worker gives vLLM, and the check of vLLM's layout against the router's.

Pure: no vLLM needed (the end-to-end tests with vLLM are in test_vllm_engine.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from routing.media.images import routing_hash
from routing.prompt.hashing import MediaPlacement, block_hashes
from workers.engine.api import EngineFailure
from workers.prompt_layout import PromptError
from workers.vllm_engine.prompt import (
    EngineVideo,
    PromptLayoutMismatch,
    check_block_hashes,
    engine_prompt,
    expanded_block_hashes,
)

IMAGE = 12  # the demo checkpoints' <|image_pad|>
START, END = 10, 11  # their <|vision_start|>, <|vision_end|>
BLOCK = 32


def expanded(*image_lengths: int) -> tuple[list[int], list[tuple[int, int]]]:
    """A prompt as vLLM expands it: text, then each image's placeholder run between its markers."""
    tokens = list(range(100, 140))
    runs = []
    for length in image_lengths:
        tokens.append(START)
        runs.append((len(tokens), length))
        tokens += [IMAGE] * length
        tokens += [END, *range(200, 230)]
    return tokens, runs


def picture(colour: tuple[int, int, int]) -> Image.Image:
    return Image.new("RGB", (56, 56), colour)


def test_vllms_expanded_prompt_hashes_as_the_router_hashed_its_token_view() -> None:
    # given the router's view of a two-image prompt: its blocks folded with each image's identity
    tokens, runs = expanded(48, 80)
    identities = ["a" * 32, "b" * 32]
    placements = [MediaPlacement(routing_hash(i), s, n) for i, (s, n) in zip(identities, runs, strict=True)]
    router = block_hashes(tokens, BLOCK, placements, salt=7)

    # when the worker hashes vLLM's expanded ids with the task's identities
    worker = expanded_block_hashes(tokens, IMAGE, [routing_hash(i) for i in identities], BLOCK, 7)

    # then they agree, and the check lets the request through
    assert worker == router and len(router) == len(tokens) // BLOCK
    check_block_hashes(router, worker, model_type="qwen2_vl", block_size=BLOCK)


def test_images_in_another_order_than_the_routers_fail_naming_the_model_family() -> None:
    # given the router's hashes for images a then b
    tokens, runs = expanded(48, 48)
    a, b = routing_hash("a" * 32), routing_hash("b" * 32)
    router = block_hashes(tokens, BLOCK, [MediaPlacement(a, *runs[0]), MediaPlacement(b, *runs[1])])

    # when vLLM's layout is hashed with the images the other way round
    worker = expanded_block_hashes(tokens, IMAGE, [b, a], BLOCK, None)

    # then the request fails, saying which family's layout disagrees
    with pytest.raises(PromptLayoutMismatch, match="qwen3_vl"):
        check_block_hashes(router, worker, model_type="qwen3_vl", block_size=BLOCK)


def test_a_different_placeholder_count_than_the_routers_is_a_mismatch() -> None:
    # given the router expanded the image to 48 placeholders, vLLM to 64
    router_tokens, router_runs = expanded(48)
    vllm_tokens, _ = expanded(64)
    h = routing_hash("a" * 32)
    router = block_hashes(router_tokens, BLOCK, [MediaPlacement(h, *router_runs[0])])

    # when the worker checks vLLM's layout
    worker = expanded_block_hashes(vllm_tokens, IMAGE, [h], BLOCK, None)

    # then it is refused, never answered silently
    with pytest.raises(PromptLayoutMismatch, match="block 2 of 32 tokens differs"):
        check_block_hashes(router, worker, model_type="qwen2_vl", block_size=BLOCK)


def test_a_task_without_block_hashes_is_not_checked() -> None:
    check_block_hashes((), [1, 2, 3], model_type="qwen2_vl", block_size=BLOCK)


def test_one_placeholder_per_image_goes_to_vllm_with_pixel_uuids_and_routing_hashes() -> None:
    # given a chat prompt with one placeholder per image
    tokens = [100, START, IMAGE, END, 101, START, IMAGE, END, 102]
    images = [picture((200, 0, 0)), picture((0, 200, 0))]

    # when it becomes vLLM's prompt
    prompt = engine_prompt(tokens, IMAGE, images, ["a" * 32, "b" * 32]).as_tokens_prompt()

    # then vLLM gets the tokens as they are, the images, and a uuid per image
    assert prompt["prompt_token_ids"] == tokens
    assert prompt["multi_modal_data"] == {"image": images}
    assert len(set(prompt["multi_modal_uuids"]["image"])) == 2


def test_the_same_url_identity_with_new_pixels_gets_a_new_uuid() -> None:
    # given one URL identity whose pixels changed at the origin between two requests
    before = engine_prompt([START, IMAGE, END], IMAGE, [picture((1, 2, 3))], ["c" * 32])
    after = engine_prompt([START, IMAGE, END], IMAGE, [picture((3, 2, 1))], ["c" * 32])
    # and the same pixels under two identities
    elsewhere = engine_prompt([START, IMAGE, END], IMAGE, [picture((1, 2, 3))], ["d" * 32])

    # then vLLM's cache key follows the pixels (it trusts the uuid completely), the router's
    # hash follows the task's identity
    assert before.uuids != after.uuids
    assert before.uuids == elsewhere.uuids
    assert before.routing_hashes == after.routing_hashes != elsewhere.routing_hashes


def test_pre_expanded_placeholders_are_refused_because_vllm_does_not_check_them() -> None:
    with pytest.raises(PromptError, match="already expanded"):
        engine_prompt([START, *[IMAGE] * 64, END], IMAGE, [picture((0, 0, 0))], ["a" * 32])


def test_a_placeholder_count_that_is_not_the_image_count_is_refused() -> None:
    with pytest.raises(PromptError, match="2 image placeholders for 1 images"):
        engine_prompt([START, IMAGE, END, START, IMAGE, END], IMAGE, [picture((0, 0, 0))], ["a" * 32])


def test_a_continued_answers_tokens_follow_the_prompt_for_generation_to_go_on_after_them() -> None:
    # given a prompt with one image and the tokens another worker generated before it died
    tokens = [100, START, IMAGE, END, 101]
    continued = [300, 301, 302]

    # when it becomes vLLM's prompt
    prompt = engine_prompt(tokens, IMAGE, [picture((9, 9, 9))], ["a" * 32], continued=continued)

    # then generation goes on after them
    assert prompt.as_tokens_prompt()["prompt_token_ids"] == [*tokens, *continued]


def test_a_continued_answer_holding_the_image_placeholder_is_refused_as_the_engines_failure() -> None:
    with pytest.raises(EngineFailure, match="cannot be continued"):
        engine_prompt([START, IMAGE, END], IMAGE, [picture((0, 0, 0))], ["a" * 32], continued=[300, IMAGE])


VIDEO = 13  # a <|video_pad|>
STAMP = [400, 401]  # a Qwen3-VL "<t seconds>", tokenized


def clip(seed: int, identity: str, expansion: list[int]) -> EngineVideo:
    frames = np.random.default_rng(seed).integers(0, 255, size=(4, 56, 56, 3), dtype=np.uint8)
    return EngineVideo(
        frames=frames,
        fps=12.0,
        total_frames=48,
        indices=(0, 6, 12, 18),
        identity=identity,
        expansion=tuple(expansion),
    )


def test_a_video_goes_to_vllm_with_one_placeholder_its_frames_and_their_own_uuid() -> None:
    # given a prompt with one video placeholder, and the same frames under two task identities
    tokens = [100, START, VIDEO, END, 101]
    video = clip(1, "c" * 32, [VIDEO] * 8)

    # when it becomes vLLM's prompt
    prompt = engine_prompt(tokens, IMAGE, [], [], videos=[video], video_token_id=VIDEO)
    given = prompt.as_tokens_prompt()

    # then vLLM gets the frames with the rate and indices the frontend sampled them at, under a
    # uuid of the frames (the same frames under another identity: the same), and no per-request
    # processor options, which vLLM would fold into the key its KV events name the video by
    frames, metadata = given["multi_modal_data"]["video"][0]
    assert frames is video.frames
    assert metadata["frames_indices"] == [0, 6, 12, 18] and metadata["fps"] == 12.0
    assert "mm_processor_kwargs" not in given
    assert given["multi_modal_uuids"]["video"] == [clip(1, "d" * 32, [VIDEO] * 8).uuid]
    assert clip(2, "c" * 32, [VIDEO] * 8).uuid != video.uuid
    assert prompt.media_routing_hashes == [routing_hash("c" * 32)]


def test_a_qwen3_vl_video_as_vllm_expands_it_hashes_as_the_router_hashed_its_view() -> None:
    # given an image then a Qwen3-VL video (timestamps and vision markers between its groups),
    # as vLLM expands them, and the router's run for the video
    run = [*STAMP, START, *[VIDEO] * 20, END, *STAMP, START, *[VIDEO] * 20, END]
    image_ids, image_runs = expanded(40)
    ids = [*image_ids, START, *run, END, *range(500, 540)]
    video = clip(3, "c" * 32, run)

    # when the worker hashes vLLM's prompt
    got = expanded_block_hashes(ids, IMAGE, [routing_hash("a" * 32)], BLOCK, None, [video], VIDEO)

    # then it is the router's hashing of its own view
    placements = [
        MediaPlacement(routing_hash("a" * 32), *image_runs[0]),
        MediaPlacement(routing_hash("c" * 32), len(image_ids) + 1, len(run)),
    ]
    assert got == block_hashes(ids, BLOCK, placements, salt=None)


def test_a_video_vllm_expanded_differently_from_the_router_is_a_mismatch() -> None:
    run = [*STAMP, START, *[VIDEO] * 20, END]
    ids = [100, START, *STAMP, START, *[VIDEO] * 21, END, END, 101]
    with pytest.raises(PromptLayoutMismatch, match="video 0"):
        expanded_block_hashes(ids, IMAGE, [], BLOCK, None, [clip(4, "c" * 32, run)], VIDEO)


def test_a_video_placeholder_count_that_is_not_the_video_count_is_refused() -> None:
    with pytest.raises(PromptError, match="2 video placeholders for 1 videos"):
        engine_prompt(
            [VIDEO, 1, VIDEO], IMAGE, [], [], videos=[clip(5, "c" * 32, [VIDEO])], video_token_id=VIDEO
        )
