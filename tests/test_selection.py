"""Scoring and selection: Dynamo's cost formula, ties, and temperature sampling."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest

from routing.kv.selection import Candidate, RoutingPolicy, Score, score_candidates, select_worker


def test_cost_terms_follow_the_design_formula() -> None:
    # given: 2,000 prompt tokens (125 blocks of 16); a holds 100 blocks and has queued work
    candidates = [
        Candidate("a", overlap=100, active_prefill_tokens=320, active_decode_blocks=40),
        Candidate("b", overlap=0, active_prefill_tokens=0, active_decode_blocks=0),
    ]
    policy = RoutingPolicy(overlap_credit=1.0, prefill_load_scale=2.0)

    # when
    a, b = score_candidates(candidates, isl=2_000, block_size=16, policy=policy)

    # then: prefill (320+2000)/16 - 100 = 45; decode 40 + (125-100) = 65; cost 2*45 + 65
    assert (a.prefill_blocks, a.decode_blocks, a.cost) == (45.0, 65.0, 155.0)
    assert (b.prefill_blocks, b.decode_blocks, b.cost) == (125.0, 125.0, 375.0)
    assert (a.worker, a.overlap, b.worker) == ("a", 100, "b")


def test_partial_last_block_counts_in_the_block_total() -> None:
    (score,) = score_candidates([Candidate("a", 0, 0, 0)], isl=33, block_size=16, policy=RoutingPolicy())
    assert score.decode_blocks == 3.0  # ceil(33 / 16)
    assert score.prefill_blocks == pytest.approx(33 / 16)


def test_prefill_blocks_never_go_negative_under_a_large_overlap_credit() -> None:
    (score,) = score_candidates(
        [Candidate("a", overlap=10, active_prefill_tokens=0, active_decode_blocks=0)],
        isl=160,
        block_size=16,
        policy=RoutingPolicy(overlap_credit=5.0),
    )
    assert score.prefill_blocks == 0.0
    assert score.cost == 0.0


def test_lowest_cost_wins_at_temperature_zero() -> None:
    scores = [Score("a", 0, 1, 1, 5.0), Score("b", 0, 1, 1, 3.0), Score("c", 0, 1, 1, 4.0)]
    rng = random.Random(7)
    assert {select_worker(scores, RoutingPolicy(), rng).worker for _ in range(50)} == {"b"}


def test_ties_are_broken_at_random_among_the_cheapest_only() -> None:
    scores = [Score("a", 0, 1, 1, 3.0), Score("b", 0, 1, 1, 3.0), Score("c", 0, 1, 1, 9.0)]
    rng = random.Random(11)
    picks = Counter(select_worker(scores, RoutingPolicy(), rng).worker for _ in range(400))
    assert set(picks) == {"a", "b"}
    assert 150 < picks["a"] < 250


def test_temperature_sampling_follows_the_softmax_of_normalised_costs() -> None:
    # given: costs 0, 5, 10 at T = 0.5 -> weights exp(0), exp(-1), exp(-2)
    scores = [Score("a", 0, 0, 0, 0.0), Score("b", 0, 0, 0, 5.0), Score("c", 0, 0, 0, 10.0)]
    policy = RoutingPolicy(temperature=0.5)
    rng = random.Random(2026)
    draws = 20_000

    # when
    picks = Counter(select_worker(scores, policy, rng).worker for _ in range(draws))

    # then: each frequency within 4 standard deviations of its probability
    weights = {"a": 1.0, "b": math.exp(-1), "c": math.exp(-2)}
    total = sum(weights.values())
    for worker, weight in weights.items():
        p = weight / total
        assert abs(picks[worker] / draws - p) < 4 * math.sqrt(p * (1 - p) / draws)


def test_equal_costs_at_positive_temperature_are_sampled_uniformly() -> None:
    scores = [Score(w, 0, 0, 0, 2.0) for w in "abcd"]
    rng = random.Random(3)
    picks = Counter(select_worker(scores, RoutingPolicy(temperature=1.0), rng).worker for _ in range(4_000))
    assert set(picks) == set("abcd")
    assert all(850 < n < 1_150 for n in picks.values())


def test_selecting_from_no_scores_is_refused() -> None:
    with pytest.raises(ValueError):
        select_worker([], RoutingPolicy(), random.Random())


def test_policy_refuses_negative_values() -> None:
    with pytest.raises(ValueError):
        RoutingPolicy(temperature=-0.1)
    with pytest.raises(ValueError):
        RoutingPolicy(overlap_credit=-1)


def test_scores_built_on_the_hot_path_are_ordinary_frozen_scores() -> None:
    policy = RoutingPolicy(prefill_load_scale=1.0)
    (score,) = score_candidates([Candidate("a", 2, 16, 3)], isl=64, block_size=16, policy=policy)
    assert score == Score("a", 2, 3.0, 5.0, 8.0)
    assert hash(score) == hash(Score("a", 2, 3.0, 5.0, 8.0))
    assert dataclasses.asdict(score)["cost"] == 8.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        score.cost = 0.0  # type: ignore[misc]


def test_default_policy_keeps_a_cached_prefix_on_a_worker_that_is_only_decoding() -> None:
    # given: a 49-block prompt, 46 blocks cached on a, which decodes two requests (98 blocks,
    # nothing left to prefill); b holds 1 block and is idle. TTFT on a is 3 blocks of prefill
    # plus a token per step for the decodes; on b it is 48 blocks of prefill.
    candidates = [
        Candidate("a", overlap=46, active_prefill_tokens=0, active_decode_blocks=98),
        Candidate("b", overlap=1, active_prefill_tokens=0, active_decode_blocks=0),
    ]

    # when
    scores = score_candidates(candidates, isl=49 * 16, block_size=16, policy=RoutingPolicy())

    # then: a (4 x 3 + 98 + 3 = 113) beats b (4 x 48 + 48 = 240); at Dynamo's weight of 1 it lost
    assert select_worker(scores, RoutingPolicy(), random.Random(0)).worker == "a"
    at_one = score_candidates(
        candidates, isl=49 * 16, block_size=16, policy=RoutingPolicy(prefill_load_scale=1.0)
    )
    assert select_worker(at_one, RoutingPolicy(), random.Random(0)).worker == "b"


def test_default_policy_still_leaves_a_cached_prefix_behind_queued_prefill() -> None:
    # given: the same prompt; a holds 46 blocks but has three cold prompts (144 blocks) queued
    candidates = [
        Candidate("a", overlap=46, active_prefill_tokens=144 * 16, active_decode_blocks=147),
        Candidate("b", overlap=1, active_prefill_tokens=0, active_decode_blocks=0),
    ]

    # when
    scores = score_candidates(candidates, isl=49 * 16, block_size=16, policy=RoutingPolicy())

    # then: waiting for 147 blocks of prefill on a is slower than 48 on b
    assert select_worker(scores, RoutingPolicy(), random.Random(0)).worker == "b"
