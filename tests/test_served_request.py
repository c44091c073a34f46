"""A served request (inference_platform.serving.served.ServedRequest) frees everything it took,
once, on every path; and an answer whose worker dies mid-way continues on another worker as if
nothing had happened.

The first tests run the demo model in process: an answer continued from the tokens a client
already has equals the uninterrupted answer."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest

from tests.test_engine import LONG_TEXT, chat, image_input
from workers.engine import GenerationRequest


def _pieces(engine, **options):
    pieces: list[tuple[str, list[int]]] = []
    result = engine.generate(
        GenerationRequest(request_id="c", **options),
        on_piece=lambda text, logprobs, ids: pieces.append((text, ids)),
    )
    return result, pieces


@pytest.mark.parametrize(
    ("images", "after_pieces"), [(0, 1), (1, 7)], ids=["text-after-1-piece", "image-after-7"]
)
def test_a_greedy_answer_continued_from_its_first_pieces_equals_the_uninterrupted_answer(
    demo_engine, images, after_pieces
):
    # given an uninterrupted greedy answer, and the token ids its first pieces carried
    engine = demo_engine()
    prompt = chat(LONG_TEXT + " What next?", images=images)
    imgs = [image_input(1)] if images else []
    whole, pieces = _pieces(engine, prompt=prompt, images=imgs, max_tokens=24, ignore_eos=True)
    assert sum(len(ids) for _, ids in pieces) <= whole.completion_tokens
    sent = pieces[:after_pieces]
    carried = [t for _, ids in sent for t in ids]
    # when a fresh engine (another worker: nothing cached) continues from those tokens
    fresh = demo_engine()
    rest, rest_pieces = _pieces(
        fresh,
        prompt=prompt,
        images=[image_input(1)] if images else [],
        max_tokens=24 - len(carried),
        ignore_eos=True,
        continued_token_ids=carried,
    )
    # then the pieces sent plus the continuation are the answer, token for token, counted once
    assert "".join(t for t, _ in sent) + rest.text == whole.text
    assert len(carried) + rest.completion_tokens == whole.completion_tokens
    assert carried + [t for _, ids in rest_pieces for t in ids] == [t for _, ids in pieces for t in ids]
