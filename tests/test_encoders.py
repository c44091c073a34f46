"""Choosing an encode worker: embedding-cache affinity weighed against the images already waiting
on each encoder, from the state the encode workers keep in Redis."""

from __future__ import annotations

import math
import random
import time

import pytest

from routing.fleet.encoders import (
    EncoderPool,
    EncoderScore,
    cache_partition,
    cache_tag,
    pending_key,
    score_encoders,
    select_encoder,
    split_images,
    summarize,
)


@pytest.fixture
def pool(redis_client, key_namespace: str) -> EncoderPool:
    return EncoderPool(redis_client, key_namespace, pending_ttl_s=30)


def test_an_encoder_holding_the_images_wins_while_it_is_not_busier_than_they_are_worth(
    pool: EncoderPool,
) -> None:
    tags = [cache_tag(None, "a" * 32), cache_tag(None, "b" * 32)]
    pool.cached("enc-1", tags[0])
    pool.cached("enc-1", tags[1])

    assert pool.choose(["enc-1", "enc-2"], tags).worker == "enc-1"

    # two images already queued on it cost as much as encoding both elsewhere; three cost more
    pool.reserve("enc-1", ["r1:0", "r1:1", "r1:2"])
    choice = pool.choose(["enc-1", "enc-2"], tags)
    assert choice.worker == "enc-2"
    assert {s.worker: (s.cached, s.pending, s.cost) for s in choice.scores} == {
        "enc-1": (2, 3, 3.0),
        "enc-2": (0, 0, 2.0),
    }


def test_finished_and_expired_images_stop_counting_as_load(
    pool: EncoderPool, redis_client, key_namespace
) -> None:
    pool.reserve("enc-1", ["r1:0", "r1:1"])
    pool.started("enc-1")
    pool.finished("enc-1", "r1:0")
    assert pool.snapshot(["enc-1"])["enc-1"]["pending"] == 1
    assert pool.snapshot(["enc-1"])["enc-1"]["busy"] == 0

    # an entry whose frontend or encoder died expires on its own
    redis_client.zadd(pending_key(key_namespace, "enc-1"), {"r0:0": time.time() - 1})
    assert pool.scores(["enc-1"], [])[0].pending == 1


def test_evicted_and_reset_entries_no_longer_attract_requests(pool: EncoderPool) -> None:
    tag = cache_tag("scope", "c" * 32)
    pool.cached("enc-1", tag)
    pool.evicted("enc-1", tag)
    assert pool.scores(["enc-1"], [tag])[0].cached == 0

    pool.cached("enc-1", tag)
    pool.reset_worker("enc-1")
    assert pool.snapshot(["enc-1"])["enc-1"]["cached_entries"] == 0


def test_scopes_are_part_of_the_tag() -> None:
    assert cache_tag("s1", "a" * 32) != cache_tag("s2", "a" * 32) != cache_tag(None, "a" * 32)


def test_ties_are_broken_at_random_among_the_cheapest() -> None:
    scores = score_encoders(["t"], {"a": 0, "b": 0, "c": 1}, {"a": 0, "b": 0, "c": 5})
    picks = {select_encoder(scores, random.Random(seed)) for seed in range(20)}
    assert picks == {"a", "b"}
    assert select_encoder([EncoderScore("x", 0, 0, 1.0)]) == "x"


def test_done_signals_reach_the_waiting_llm_worker_in_order(pool: EncoderPool) -> None:
    pool.signal_done("req-1", {"index": 1, "ok": True})
    pool.signal_done("req-1", {"index": 0, "ok": False})

    assert pool.wait_done("req-1", 0.5) == {"index": 1, "ok": True}
    assert pool.wait_done("req-1", 0.5) == {"index": 0, "ok": False}
    started = time.monotonic()
    assert pool.wait_done("req-1", 0.2) is None
    assert time.monotonic() - started >= 0.15


def test_counters_sum_into_the_operators_figures(pool: EncoderPool) -> None:
    pool.count("enc-1", {"images": 2, "cache_hits": 1, "cache_misses": 3, "put_bytes": 2000, "put_us": 4000})
    pool.count("llm-1", {"received": 2, "received_bytes": 2000, "get_us": 1000, "fallback_corrupt": 1})
    with pytest.raises(ValueError, match="unknown"):
        pool.count("enc-1", {"bogus": 1})

    snapshot = pool.snapshot(["enc-1", "llm-1"])
    encoder, llm = summarize(snapshot["enc-1"]), summarize(snapshot["llm-1"])

    assert encoder["embedding_cache_hit_rate"] == 0.25
    assert (encoder["put_bytes_per_image"], encoder["put_ms_per_image"]) == (1000, 2.0)
    assert (llm["received_bytes_per_image"], llm["get_ms_per_image"], llm["fallbacks"]) == (1000, 0.5, 1)


def test_the_frontend_tags_images_with_the_partition_the_workers_cache_them_under() -> None:
    from workers.runtime import WorkerRuntime

    for scoped in (False, True):
        runtime = WorkerRuntime.__new__(WorkerRuntime)  # only the partition rule, no process state
        runtime.session_scoped = scoped
        for scope, salt in ((None, None), ("s" * 32, None), (None, "00000000000000ff"), ("s" * 32, "ab" * 8)):
            expected = runtime.cache_partition(scope, None if salt is None else int(salt, 16))
            assert cache_partition(scoped, scope, salt) == expected


# --- the split between the encoder and the LLM worker (pure) ----------------------------------------
def test_at_low_load_every_image_goes_to_the_encoder() -> None:
    split = split_images([False, False], encoder_pending=0, encode_ms=300, local_backlog_ms=0, local_weight=2)
    assert split.to_encoder == (0, 1) and split.kept_local == ()
    assert split.encoder_ready_ms == 600 and split.local_ready_ms == 0


def test_a_busy_encoder_leaves_images_on_the_llm_worker_as_their_waits_balance() -> None:
    # 4 images queued on the encoder (1200 ms) against an idle LLM worker at 600 ms an image
    split = split_images([False] * 3, encoder_pending=4, encode_ms=300, local_backlog_ms=0, local_weight=2)
    assert split.kept_local == (0, 1) and split.to_encoder == (2,)
    assert (split.encoder_backlog_ms, split.encoder_ready_ms, split.local_ready_ms) == (1200, 1500, 1200)
    # the LLM worker's own backlog counts: already 2 s of local encoding, so the encoder keeps them
    busy_llm = split_images(
        [False] * 3, encoder_pending=4, encode_ms=300, local_backlog_ms=2000, local_weight=2
    )
    assert busy_llm.kept_local == () and busy_llm.to_encoder == (0, 1, 2)


def test_images_the_encoders_cache_holds_always_go_to_it_and_cost_nothing() -> None:
    split = split_images(
        [True, False, True], encoder_pending=10, encode_ms=100, local_backlog_ms=0, local_weight=1
    )
    assert split.to_encoder == (0, 2) and split.kept_local == (1,)
    assert split.encoder_ready_ms == 1000


def test_the_weight_protects_the_llm_worker_and_infinity_turns_the_split_off() -> None:
    args = {"encoder_pending": 2, "encode_ms": 300, "local_backlog_ms": 0}
    assert split_images([False], **args, local_weight=1).kept_local == (0,)  # 900 ms there, 300 here
    assert split_images([False], **args, local_weight=4).kept_local == ()  # 900 ms there, 1200 here
    off = split_images(
        [False] * 5, encoder_pending=50, encode_ms=300, local_backlog_ms=0, local_weight=math.inf
    )
    assert off.kept_local == () and off.to_dict()["local_encode_ms"] is None
    with pytest.raises(ValueError):
        split_images([False], encoder_pending=0, encode_ms=-1, local_backlog_ms=0, local_weight=1)
    with pytest.raises(ValueError):
        split_images([False], encoder_pending=0, encode_ms=1, local_backlog_ms=0, local_weight=0)


def test_the_llm_workers_backlog_is_what_it_was_left_until_its_expected_end(pool: EncoderPool) -> None:
    assert pool.local_backlog_ms("llm-1") == 0
    pool.keep_local("llm-1", ["r1:0", "r1:2"], [600, 1200])
    assert 1000 < pool.local_backlog_ms("llm-1") <= 1200
    assert pool.local_backlog_ms("llm-2") == 0
    pool.keep_local("llm-1", ["r2:0"], [-5])  # past its end: no longer counted, and swept
    assert 1000 < pool.local_backlog_ms("llm-1") <= 1200


def test_encoder_scores_carry_its_measured_milliseconds_per_image(pool: EncoderPool) -> None:
    assert pool.scores(["enc-1"], [])[0].encode_ms is None
    pool.count("enc-1", {"cache_misses": 4, "encode_us": 1_200_000, "cache_hits": 3})
    assert pool.scores(["enc-1"], [])[0].encode_ms == 300
    tag = cache_tag(None, "d" * 32)
    pool.cached("enc-1", tag)
    assert pool.held("enc-1", [cache_tag(None, "e" * 32), tag]) == [False, True]
