"""bench/workload.py's cache references: what one cache of the workers' blocks would have kept of a
run's requests under each eviction, which its report sets beside the routers' warm requests."""

from __future__ import annotations

import pytest

from bench.workload import BLOCK_SIZE, REFERENCES, Outcome, Turn, cache_reference


def asked(*prefixes: str, blocks: int = 1) -> list[Outcome]:
    """One request per prefix, in this order, each prompt `blocks` blocks long."""
    return [
        Outcome(Turn(0, (), f"q{i}", prefix), float(i), "w0", blocks * BLOCK_SIZE, 0, 0.0)
        for i, prefix in enumerate(prefixes)
    ]


@pytest.mark.parametrize(
    ("sequence", "expected"),
    [
        # a one-off (C) arrives with the cache full: LRU drops A, asked twice and never again;
        # LFU drops B, asked once so far and again next; the clairvoyant drops A
        (("A", "A", "B", "C", "B"), {"lru": 2, "lfu": 1, "clairvoyant": 2}),
        # the same, but A comes back: LRU had dropped it, LFU kept the prefix asked most
        (("A", "A", "B", "C", "A", "B"), {"lru": 1, "lfu": 2, "clairvoyant": 2}),
    ],
)
def test_each_eviction_keeps_what_it_should_of_a_two_block_cache(sequence, expected) -> None:
    assert {eviction: cache_reference(asked(*sequence), 2, eviction) for eviction in REFERENCES} == expected


def test_the_requests_are_replayed_in_the_order_they_were_sent_not_the_order_listed() -> None:
    outcomes = asked("A", "B", "C", "A")  # sent at 0, 1, 2, 3
    outcomes[1].sent_at, outcomes[3].sent_at = 3.0, 1.0  # sent: A, A, C, B
    assert cache_reference(outcomes, 2, "lru") == 1


def test_a_prefix_larger_than_the_cache_is_still_kept_alone() -> None:
    assert cache_reference(asked("A", "A", blocks=3), 2, "lru") == 1
    assert cache_reference(asked("A", "B", "A", blocks=3), 2, "clairvoyant") == 0


def test_an_unknown_eviction_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown eviction"):
        cache_reference(asked("A"), 2, "fifo")
