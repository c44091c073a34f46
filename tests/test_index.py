"""The Redis KV index: overlaps, removal, purge, approximate mode, and that nothing leaks."""

from __future__ import annotations

import random
import time

import pytest
import redis

from routing.contract.kv_events import KvEvent
from routing.kv.index import KvIndex
from routing.prompt.hashing import MediaPlacement, block_hashes


def _keys(client: redis.Redis, namespace: str, family: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{namespace}{family}*", count=1_000))


@pytest.fixture
def index(redis_client: redis.Redis, key_namespace: str) -> KvIndex:
    return KvIndex(redis_client, key_namespace)


def _prompt(seed: int, n_tokens: int = 320) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n_tokens)]


def test_overlap_is_the_number_of_consecutive_leading_blocks_each_worker_holds(index: KvIndex) -> None:
    # given: a 20-block prompt with an image; a holds it all, b the first 7, c another prompt
    hashes = block_hashes(_prompt(1), 16, [MediaPlacement(0xDEADBEEF12345678, 32, 40)])
    other = block_hashes(_prompt(2), 16)
    index.apply(KvEvent("stored", "a", tuple(hashes)))
    index.apply(KvEvent("stored", "b", tuple(hashes[:7])))
    index.apply(KvEvent("stored", "c", tuple(other)))

    # when
    overlaps = index.overlaps(hashes, ["a", "b", "c", "d"])

    # then
    assert overlaps == {"a": 20, "b": 7, "c": 0, "d": 0}
    assert index.overlaps(hashes[:5], ["a", "b"]) == {"a": 5, "b": 5}
    assert index.overlaps([], ["a"]) == {"a": 0}
    assert index.overlaps(hashes, []) == {}


def test_the_same_tokens_with_another_image_do_not_overlap(index: KvIndex) -> None:
    tokens = _prompt(3)
    with_a = block_hashes(tokens, 16, [MediaPlacement(111, 0, 64)])
    with_b = block_hashes(tokens, 16, [MediaPlacement(222, 0, 64)])
    index.apply(KvEvent("stored", "w", tuple(with_a)))
    assert index.overlaps(with_b, ["w"]) == {"w": 0}
    assert index.overlaps(with_a, ["w"]) == {"w": 20}


def test_bisecting_and_walking_agree_on_prefix_closed_caches(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given: 12 workers each holding random prefixes of a few related prompts (a shared system
    # prompt, then branches), as a prefix cache that evicts leaves first would
    rng = random.Random(5)
    system = _prompt(10, 160)
    prompts = [block_hashes(system + _prompt(20 + i, 480), 16) for i in range(4)]
    workers = [f"w{i}" for i in range(12)]
    for worker in workers:
        for prompt in rng.sample(prompts, 2):
            index.apply(KvEvent("stored", worker, tuple(prompt[: rng.randrange(0, len(prompt) + 1)])))
    walker = KvIndex(redis_client, key_namespace, prefix_closed=False)

    # when / then: every prompt, and every truncation of one, gives the same overlaps both ways
    for prompt in prompts:
        for length in (1, 9, 10, 11, 25, len(prompt)):
            bisected = index.overlaps(prompt[:length], workers)
            assert bisected == walker.overlaps(prompt[:length], workers)
    assert max(index.overlaps(prompts[0], workers).values()) > 10  # the data is not trivial


def test_walking_mode_stops_at_a_hole_left_by_an_out_of_order_removal(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    hashes = block_hashes(_prompt(6), 16)
    index.apply(KvEvent("stored", "w", tuple(hashes)))
    index.apply(KvEvent("removed", "w", (hashes[4],)))  # not a leaf: breaks the prefix
    walker = KvIndex(redis_client, key_namespace, prefix_closed=False)
    assert walker.overlaps(hashes, ["w"]) == {"w": 4}


def test_removed_blocks_and_a_purge_leave_no_key_of_the_family_behind(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given
    hashes = block_hashes(_prompt(7), 16)
    index.apply(KvEvent("stored", "a", tuple(hashes)))
    index.apply(KvEvent("stored", "b", tuple(hashes[:10])))
    index.record_routed("c", hashes)

    # when: a evicts everything, leaves first; b and c are purged (heartbeat lapsed)
    index.apply(KvEvent("removed", "a", tuple(reversed(hashes))))
    assert index.worker_blocks("a") == set()
    assert index.overlaps(hashes, ["a", "b"]) == {"a": 0, "b": 10}
    assert index.purge_worker("b") == 10
    index.purge_worker("c")

    # then
    assert _keys(redis_client, key_namespace, "kv:") == []


def test_cleared_event_drops_every_block_of_that_worker_only(index: KvIndex) -> None:
    hashes = block_hashes(_prompt(8), 16)
    index.apply(KvEvent("stored", "a", tuple(hashes)))
    index.apply(KvEvent("stored", "b", tuple(hashes)))
    index.apply(KvEvent("cleared", "a"))
    assert index.overlaps(hashes, ["a", "b"]) == {"a": 0, "b": 20}
    assert index.block_counts(["a", "b"]) == {"a": 0, "b": 20}


def test_worker_blocks_round_trip_u64_hashes_at_both_extremes(index: KvIndex) -> None:
    extremes = (0, 1, 2**63, 2**64 - 1)
    index.apply(KvEvent("stored", "w", extremes))
    assert index.worker_blocks("w") == set(extremes)
    assert index.overlaps(list(extremes), ["w"]) == {"w": 4}
    with pytest.raises(ValueError):
        index.apply(KvEvent("stored", "w", (2**64,)))


def test_approximate_blocks_count_until_their_ttl_runs_out(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given: a worker that publishes no events, to which the router sent a request
    hashes = block_hashes(_prompt(9), 16)
    index.record_routed("quiet", hashes[:12], ttl_s=0.3)
    index.apply(KvEvent("stored", "loud", tuple(hashes[:5])))

    # then: it gets credit for what was routed there, beside event-backed workers
    assert index.overlaps(hashes, ["quiet", "loud"]) == {"quiet": 12, "loud": 5}
    assert index.block_counts(["quiet"]) == {"quiet": 12}
    assert index.worker_blocks("quiet") == set(hashes[:12])

    # when the TTL has passed
    time.sleep(0.45)

    # then: no credit, and Redis itself dropped the record
    assert index.overlaps(hashes, ["quiet", "loud"]) == {"quiet": 0, "loud": 5}
    assert index.worker_blocks("quiet") == set()
    assert _keys(redis_client, key_namespace, "kv:approx:") == []


def test_approximate_and_event_blocks_of_one_worker_combine(index: KvIndex) -> None:
    hashes = block_hashes(_prompt(12), 16)
    index.apply(KvEvent("stored", "w", tuple(hashes[:6])))
    index.record_routed("w", hashes[:15])
    assert index.overlaps(hashes, ["w"]) == {"w": 15}
    index.record_routed("v", hashes[:3])
    index.apply(KvEvent("stored", "v", tuple(hashes[:9])))
    assert index.overlaps(hashes, ["v", "w"]) == {"v": 9, "w": 15}


def test_worker_names_that_cannot_be_keys_are_refused(index: KvIndex) -> None:
    with pytest.raises(ValueError):
        index.overlaps([1], ["bad\nname"])
    with pytest.raises(ValueError):
        KvEvent("stored", "", (1,))
