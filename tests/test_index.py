"""The Redis KV index: overlaps, removal, purge, approximate mode, and that nothing leaks."""

from __future__ import annotations

import random
import struct
import time

import pytest
import redis

from routing.contract.kv_events import KvEvent
from routing.kv.index import EVENT_IDS_KEY, EVENTS_STREAM, INLINE_HOLDER_BYTES, KvIndex
from routing.prompt.hashing import MediaPlacement, block_hashes


def _keys(client: redis.Redis, namespace: str, family: str) -> list[bytes]:
    """The keys of a family, less the event stream and its per-worker counts: a log of what
    happened (a purge is announced there), not the index's state."""
    log = {f"{namespace}{EVENTS_STREAM}".encode(), f"{namespace}{EVENT_IDS_KEY}".encode()}
    return [key for key in client.scan_iter(match=f"{namespace}{family}*", count=1_000) if key not in log]


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


def _bucket(namespace: str, block: int) -> bytes:
    return f"{namespace}kv:b:".encode() + struct.pack(">Q", block)[:2]


def _own_key(namespace: str, block: int) -> bytes:
    return f"{namespace}kv:blk:".encode() + struct.pack(">Q", block)


def test_a_block_held_by_many_workers_gets_a_key_of_its_own_and_its_bucket_stays_a_listpack(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given: one more worker holding the first 8 blocks than a bucket value can list inline
    many = INLINE_HOLDER_BYTES // 2 + 1
    hashes = block_hashes(_prompt(30), 16)
    workers = [f"w{i}" for i in range(many)]
    for k, worker in enumerate(workers):
        index.apply(KvEvent("stored", worker, tuple(hashes[: 8 + k % 5])))
    walker = KvIndex(redis_client, key_namespace, prefix_closed=False)
    expected = {worker: 8 + k % 5 for k, worker in enumerate(workers)} | {"outsider": 0}

    # then: its holders moved out, the bucket stays compact, and every overlap is exact
    assert redis_client.exists(_own_key(key_namespace, hashes[0]))
    assert redis_client.object("encoding", _bucket(key_namespace, hashes[0])) == b"listpack"
    assert not redis_client.exists(_own_key(key_namespace, hashes[9])), "held by fewer"
    assert index.overlaps(hashes, list(expected)) == expected == walker.overlaps(hashes, list(expected))

    # when: all but 16 remove the blocks (leaves first), the holders go back inline
    for worker in workers[16:]:
        index.apply(KvEvent("removed", worker, tuple(reversed(hashes[:13]))))
    kept = {worker: expected[worker] for worker in workers[:16]}

    # then
    assert not redis_client.exists(_own_key(key_namespace, hashes[0]))
    assert index.overlaps(hashes, [*kept, *workers[16:]]) == kept | dict.fromkeys(workers[16:], 0)
    for worker in workers[:16]:
        index.purge_worker(worker)
    assert _keys(redis_client, key_namespace, "kv:") == []


def test_the_worker_id_maps_are_hash_tables_from_their_first_worker_and_go_with_the_last(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # A decision reads every weighed worker's id with one HMGET: a listpack would scan for each.
    index.apply(KvEvent("stored", "a", (1, 2)))
    index.apply(KvEvent("stored", "b", (1,)))
    for family in ("kv:wid", "kv:wname"):
        assert redis_client.object("encoding", f"{key_namespace}{family}") == b"hashtable"
    assert index.overlaps([1, 2], ["a", "b", "c"]) == {"a": 2, "b": 1, "c": 0}

    index.purge_worker("a")
    assert redis_client.hlen(f"{key_namespace}kv:wid") == 2  # b and the field that keeps it a table
    index.apply(KvEvent("removed", "b", (1,)))
    assert _keys(redis_client, key_namespace, "kv:") == []


def test_a_purged_workers_id_goes_to_a_new_worker_without_its_blocks(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given: a holds a prompt, b another; a is purged
    first, second, third = (block_hashes(_prompt(seed), 16) for seed in (31, 32, 33))
    index.apply(KvEvent("stored", "a", tuple(first)))
    index.apply(KvEvent("stored", "b", tuple(second)))
    id_of_a = redis_client.hget(f"{key_namespace}kv:wid", "a")
    index.purge_worker("a")

    # when: a new worker stores a third prompt
    index.apply(KvEvent("stored", "c", tuple(third)))

    # then: it has a's old id, and none of a's blocks
    assert redis_client.hget(f"{key_namespace}kv:wid", "c") == id_of_a
    assert index.overlaps(first, ["a", "b", "c"]) == {"a": 0, "b": 0, "c": 0}
    assert index.overlaps(third, ["a", "b", "c"]) == {"a": 0, "b": 0, "c": 20}
    assert index.worker_blocks("c") == set(third)
    assert index.block_counts(["a", "b", "c"]) == {"a": 0, "b": 20, "c": 20}


def test_a_workers_log_of_blocks_stays_within_half_again_what_it_holds_under_eviction(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given: a worker whose cache turns over: each round stores a prompt and evicts the oldest
    prompts = [block_hashes(_prompt(100 + i), 16) for i in range(60)]
    log_key = f"{key_namespace}kv:w:w"
    longest = 0
    for i, prompt in enumerate(prompts):
        index.apply(KvEvent("stored", "w", tuple(prompt)))
        # then: the log is bounded by what the worker holds once the stored blocks are in
        length = redis_client.strlen(log_key) // 8
        assert length <= 1.5 * index.block_counts(["w"])["w"] + 64
        longest = max(longest, length)
        if i >= 5:
            index.apply(KvEvent("removed", "w", tuple(reversed(prompts[i - 5]))))
        # and what the index says it holds is exact
        held = {h for kept in prompts[max(0, i - 4) : i + 1] for h in kept}
        assert index.worker_blocks("w") == held
        assert index.block_counts(["w"]) == {"w": len(held)}
    assert longest > 1.5 * 100, "removals did pile up in the log before a rewrite"
    assert index.purge_worker("w") == 100


def test_a_new_worker_beyond_the_ids_an_index_can_give_is_refused_clearly(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    hashes = block_hashes(_prompt(40), 16)
    index.apply(KvEvent("stored", "a", tuple(hashes)))
    redis_client.set(f"{key_namespace}kv:wid:next", 65535)
    with pytest.raises(redis.ResponseError, match="65535 workers"):
        index.apply(KvEvent("stored", "late", tuple(hashes)))
    assert index.overlaps(hashes, ["a", "late"]) == {"a": 20, "late": 0}
    index.purge_worker("a")  # its freed id goes to the next newcomer
    index.apply(KvEvent("stored", "late", tuple(hashes)))
    assert index.overlaps(hashes, ["a", "late"]) == {"a": 0, "late": 20}


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
