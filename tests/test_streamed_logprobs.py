"""Streamed log probabilities: which chunk carries which token's entry (issue 12).

The real demo tokenizer decodes; the end-to-end check with the `openai` client streaming against
the platform is in tests/test_tenants_end_to_end.py."""

from __future__ import annotations

import json

import pytest

from inference_platform.api.chat_request import parse_chat_request
from inference_platform.api.views import _chunk, _remaining_logprobs, _streamed_logprobs
from routing.contract.tasks import DoneEvent, TokenEvent, event_data, parse_event
from workers.detokenizer import TextStream
from workers.processors import load_processor


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    return load_processor(demo_model_dir).tokenizer


def stream_of(tokenizer, text: str, stops: list[str]) -> tuple[list[tuple[str, list[int]]], TextStream]:
    """Feeds `text`'s tokens through a TextStream; the pieces sent, each with its token ids."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sent: list[tuple[str, int]] = []
    stream = TextStream(tokenizer, stops, lambda piece, tokens: sent.append((piece, tokens)))
    for token in ids:
        if stream.accept(token):
            break
    else:
        stream.finish()
    pieces, at = [], 0
    for piece, tokens in sent:
        pieces.append((piece, ids[at : at + tokens]))
        at += tokens
    return pieces, stream


def test_each_piece_counts_the_tokens_whose_text_it_completes(tokenizer) -> None:
    text = "café ☕ naïve — plain words 日本"
    pieces, stream = stream_of(tokenizer, text, [])
    assert "".join(piece for piece, _ in pieces) == text
    assert sum(len(ids) for _, ids in pieces) == stream.completion_tokens
    for piece, ids in pieces:
        # A piece is exactly its tokens' text: a character split over tokens goes whole, once.
        assert ids and tokenizer.decode(ids) == piece


def test_a_held_back_stop_prefix_moves_its_tokens_to_the_piece_that_sends_it(tokenizer) -> None:
    text = "the river flows to the sea and on"
    pieces, stream = stream_of(tokenizer, text, ["sea", "the riv-never"])
    assert "".join(piece for piece, _ in pieces) == stream.text == "the river flows to the "
    sent, carried = "", []
    for piece, ids in pieces:
        sent, carried = sent + piece, carried + ids
        # A token goes with the piece holding its last character: the text sent so far is the
        # carried tokens' text plus at most the start of the next token (" sea" sends its space).
        assert sent.startswith(tokenizer.decode(carried)) and len(sent) - len(tokenizer.decode(carried)) <= 1
    # The stop string's own tokens are in no piece: the last chunk carries their entries.
    assert sum(len(ids) for _, ids in pieces) < stream.completion_tokens


def test_streamed_chunks_carry_their_entries_and_the_last_one_the_rest() -> None:
    chat = parse_chat_request(
        {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], "logprobs": True},
        max_tokens_limit=64,
    )
    entries = [{"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in "abc"]
    # The worker's events round-trip through the response stream's JSON with their entries.
    event = parse_event("token", json.loads(json.dumps(event_data(TokenEvent("ab", entries[:2])))))
    assert event == TokenEvent("ab", entries[:2])
    chunk = json.loads(
        _chunk("r1", "demo", {"content": event.text}, None, _streamed_logprobs(chat, event.logprobs))[6:]
    )
    assert chunk["choices"][0]["logprobs"] == {"content": entries[:2]}
    done = DoneEvent(text="ab", completion_tokens=3, logprobs=entries)
    assert _remaining_logprobs(chat, done, streamed=2) == {"content": entries[2:]}
    assert _remaining_logprobs(chat, done, streamed=3) is None  # nothing left: null, as OpenAI sends
    # A worker that streams no entries: they all ride on the last chunk.
    assert _remaining_logprobs(chat, done, streamed=0) == {"content": entries}
    unasked = parse_chat_request(
        {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}, max_tokens_limit=64
    )
    assert _streamed_logprobs(unasked, entries) is None and _remaining_logprobs(unasked, done, 0) is None
