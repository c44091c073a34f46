"""Continuous batching: requests served together give, token for token, what transformers'
`generate` gives each alone; a tiny pool preempts without losing or changing anything; cancelled
requests leave the batch and free their blocks; the KV events still mirror the pool."""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Sequence

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
from PIL import Image

from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from tests.test_engine import LONG_TEXT, EventLog, chat, image_input
from workers.engine import Engine, GenerationRequest, GenerationResult, ImageInput

BLOCK = 16


def request(prompt: str, images: Sequence[ImageInput] = (), **options: object) -> GenerationRequest:
    options.setdefault("max_tokens", 12)
    return GenerationRequest(request_id=f"r{id(prompt)}", prompt=prompt, images=list(images), **options)


def serve_together(engine: Engine, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    """Submits every request before waiting for any, so they share the engine's steps."""
    handles = [engine.submit(r) for r in requests]
    results = []
    for handle in handles:
        while True:
            kind, value = handle.events.get(timeout=120)
            if kind == "done":
                results.append(value)
                break
            if kind == "error":
                raise value
    return results


def wait_for(handle) -> tuple[GenerationResult, float]:
    """The request's result and the instant (perf_counter) of its first token."""
    first = float("nan")
    while True:
        kind, value = handle.events.get(timeout=120)
        if kind == "first":
            first = value
        elif kind == "done":
            return value, first
        elif kind == "error":
            raise value


def generate_alone(engine: Engine, prompt: str, images: Sequence[ImageInput], max_tokens: int) -> str:
    """transformers' own generate on one request, greedy."""
    pil = [Image.open(io.BytesIO(image.data)) for image in images]
    if pil:
        encoded = engine.processor(text=[prompt], images=pil, return_tensors="pt")
    else:
        encoded = engine.processor.tokenizer([prompt], add_special_tokens=False, return_tensors="pt")
    with torch.inference_mode():
        output = engine.model.generate(**encoded, max_new_tokens=max_tokens, do_sample=False)
    return engine.tokenizer.decode(output[0, encoded["input_ids"].shape[1] :], skip_special_tokens=True)


MIXED = [
    (chat("Hi."), 0),
    (chat(LONG_TEXT + " Which fruit is it?"), 0),
    (chat("What is in the picture?", images=1), 1),
    (chat(LONG_TEXT * 2 + " Where is the garden?", images=1, before="Look. "), 1),
    (chat("Tell me a story about a garden. " * 3), 0),
]


def test_greedy_outputs_in_one_batch_equal_generate_alone(demo_engine) -> None:
    # given prompts of different lengths, with and without images, and a warm prefix for some
    engine = demo_engine()
    images = [image_input(20 + n) for n in range(len(MIXED))]
    engine.generate(request(chat(LONG_TEXT + " Something else?"), max_tokens=1))  # a shared prefix
    batch = [request(prompt, images[n : n + count], max_tokens=12) for n, (prompt, count) in enumerate(MIXED)]

    # when they are served together
    results = serve_together(engine, batch)

    # then each equals transformers' generate on it alone, and steps served several at once
    expected = [
        generate_alone(engine, prompt, images[n : n + count], 12) for n, (prompt, count) in enumerate(MIXED)
    ]
    assert [r.text for r in results] == expected
    assert results[1].cached_tokens >= 3 * BLOCK
    report = engine.load_report()
    assert report.running_peak >= 3
    assert report.forward_passes < report.generated_tokens
    assert report.kv_blocks_used == 0 and report.running == report.waiting == 0


def test_the_engine_reports_the_prefill_rate_it_measures(demo_engine) -> None:
    # given: a fresh engine, which has measured nothing yet
    engine = demo_engine()
    assert engine.load_report().prefill_tokens_per_s == 0

    # when: it prefills a prompt with an image
    started = time.perf_counter()
    result = engine.generate(
        request(chat(LONG_TEXT + " What is it?", images=1), [image_input(40)], max_tokens=1)
    )
    elapsed = time.perf_counter() - started

    # then: its rate is at least the prompt over the whole call (the steps are part of the call)
    rate = engine.load_report().prefill_tokens_per_s
    assert result.prompt_tokens / elapsed <= rate < 1e7


@pytest.mark.parametrize("policy", ["shortest_first", "fcfs"])
def test_a_cache_hit_gets_its_first_token_before_a_cold_picture_that_came_first(
    demo_engine, policy, monkeypatch
) -> None:
    # given: an engine whose cache holds a picture's prompt, held inside a step (its model call
    # waits for the test) so that both requests below are queued when it looks next
    engine = demo_engine(schedule_policy=policy)
    cached = chat(LONG_TEXT + " What is it?", images=1)
    engine.generate(request(cached, [image_input(50, 224, 224)], max_tokens=1))
    in_step, release = threading.Event(), threading.Event()
    run = engine.runner.run

    def held(inputs):
        if not in_step.is_set():
            in_step.set()
            release.wait(30)
        return run(inputs)

    monkeypatch.setattr(engine.runner, "run", held)
    ballast = engine.submit(request(chat("Hello there."), max_tokens=3))
    assert in_step.wait(30)

    # when: a new picture's prompt comes, then a question about the cached one (a few tokens left)
    cold = engine.submit(
        request(chat(LONG_TEXT + " What is it?", images=1), [image_input(51, 224, 224)], max_tokens=1)
    )
    hit = engine.submit(
        request(cached.replace("What is it?", "Which colour?"), [image_input(50, 224, 224)], max_tokens=1)
    )
    release.set()
    (cold_result, cold_first_token), (hit_result, hit_first_token), _ = (
        wait_for(handle) for handle in (cold, hit, ballast)
    )

    # then: shortest_first answers the hit while the cold picture waits (its encoder runs between
    # steps, its prompt gets a step of its own); fcfs makes the hit ride the cold prompt's step
    assert (
        hit_result.prompt_tokens - hit_result.cached_tokens
        < 32
        < cold_result.prompt_tokens - cold_result.cached_tokens
    )
    if policy == "shortest_first":
        assert hit_first_token < cold_first_token
    else:
        assert hit_first_token >= cold_first_token


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(demo_engine) -> None:
    engine = demo_engine()
    engine.scheduler.max_batch_tokens = 48
    prompt, images = chat(LONG_TEXT * 2 + " Where?", images=1, before="Look. "), [image_input(30)]
    decoding = request(chat("Hello there."), max_tokens=24)

    results = serve_together(engine, [decoding, request(prompt, images, max_tokens=8)])

    assert results[1].prompt_tokens > 3 * 48
    assert results[1].text == generate_alone(engine, prompt, images, 8)
    assert results[0].text == generate_alone(engine, chat("Hello there."), [], 24)


def test_a_tiny_pool_preempts_without_losing_or_changing_any_output(
    demo_engine, redis_client, key_namespace
) -> None:
    # given a pool that holds one long request, not four at once, publishing to the router's index
    log = EventLog()
    index = KvIndex(redis_client, key_namespace)
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)

    def publish(events) -> None:
        log(events)
        publisher.publish(events)

    engine = demo_engine(capacity=14, events=publish)
    prompts = [chat(f"Question {n}: {LONG_TEXT}") for n in range(4)]

    results = serve_together(engine, [request(p, max_tokens=24) for p in prompts])

    # then every request finished, with what it gives alone, and some had to wait their turn
    assert [r.text for r in results] == [generate_alone(engine, p, [], 24) for p in prompts]
    assert sum(r.preemptions for r in results) > 0
    assert engine.load_report().preemptions > 0
    # and the events, replayed into the index, equal what the pool caches after evictions and
    # preemptions
    assert "removed" in log.kinds
    assert log.blocks == engine.kv_block_hashes() == index.worker_blocks("w")
    assert engine.load_report().kv_blocks_used == 0


def test_a_cancelled_request_leaves_the_batch_and_frees_its_blocks(demo_engine) -> None:
    engine = demo_engine()
    long = engine.submit(request(chat("Write a long story."), max_tokens=400, temperature=1.0, seed=2))
    short = engine.submit(request(chat("Hi."), max_tokens=60))
    assert long.events.get(timeout=60)[0] == "first"

    long.cancel()

    events = []
    while not events or events[-1][0] != "done":
        events.append(long.events.get(timeout=60))
    cancelled = events[-1][1]
    assert cancelled.completion_tokens < 400
    while (event := short.events.get(timeout=60))[0] != "done":
        pass
    assert event[1].completion_tokens > 0
    assert engine.load_report().kv_blocks_used == 0


def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch(demo_engine) -> None:
    engine = demo_engine()
    seeded = request(chat("Tell me about rivers."), temperature=0.9, top_p=0.95, seed=123, max_tokens=16)
    alone = engine.generate(seeded).text

    together = serve_together(
        engine,
        [
            request(chat("Other words entirely."), temperature=1.0, seed=5, max_tokens=20),
            seeded,
            request(chat(LONG_TEXT), max_tokens=10),
        ],
    )

    assert together[1].text == alone


@pytest.fixture(scope="module")
def llava_next(llava_demo_dir) -> Engine:
    return Engine.load(llava_demo_dir("llava_next"))


def test_llava_greedy_outputs_in_one_batch_equal_generate_alone(llava_next: Engine) -> None:
    engine = llava_next
    prompts = [
        ("USER: <image>\nWhat is it? ASSISTANT:", [image_input(40, 160, 120)]),
        ("USER: " + LONG_TEXT + " Where is it? ASSISTANT:", []),
        ("USER: Hi ASSISTANT:", []),
    ]

    results = serve_together(engine, [request("<s>" + p, images, max_tokens=10) for p, images in prompts])

    assert [r.text for r in results] == [generate_alone(engine, "<s>" + p, im, 10) for p, im in prompts]
