"""The paged KV pool as a prefix cache: longest-prefix reuse by reference, shared blocks, LRU
eviction of unheld leaves, and events that let an index mirror exactly what it caches."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import redis

from routing.contract.kv_events import KvEvent
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.prompt.hashing import MediaPlacement, block_hashes, local_block_hashes
from workers.kv_cache import KvPool

BLOCK = 4
LAYERS = 2


def hashes(tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    local = local_block_hashes(tokens, BLOCK)
    return block_hashes(tokens, BLOCK), local


class EventLog:
    """Replays events the way an index does: the set of blocks a worker holds."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []
        self.blocks: set[int] = set()

    def __call__(self, events: Sequence[KvEvent]) -> None:
        for event in events:
            self.events.append(event)
            if event.kind == "stored":
                assert event.parent_hash is None or event.parent_hash in self.blocks
                assert not self.blocks & set(event.block_hashes), "a block was stored twice"
                self.blocks.update(event.block_hashes)
            elif event.kind == "removed":
                assert set(event.block_hashes) <= self.blocks, "removed a block never stored"
                self.blocks.difference_update(event.block_hashes)
            else:
                self.blocks.clear()


def run_request(pool: KvPool, tokens: Sequence[int]) -> tuple[int, int]:
    """Hold the cached prefix, fill the rest, cache it and let go, as the engine does;
    returns (reused blocks, newly cached blocks)."""
    sequence, local = hashes(tokens)
    blocks = pool.acquire_prefix(sequence)
    reused = len(blocks)
    fresh = pool.allocate(len(sequence) - reused)
    if fresh is None:  # no room: cache what fits, one block at a time
        fresh = []
        while len(blocks) + len(fresh) < len(sequence) and (one := pool.allocate(1)) is not None:
            fresh += one
    blocks += fresh
    try:
        cached = pool.commit(blocks, reused, len(blocks), sequence, local)
    finally:
        pool.release(blocks)
    return reused, cached


def test_longest_cached_prefix_is_reused_by_reference() -> None:
    pool = KvPool(capacity_blocks=16, block_size=BLOCK, worker="w")
    first = list(range(10, 22))  # three blocks
    sequence, local = hashes(first)
    owned = pool.allocate(3)
    pool.commit(owned, 0, 3, sequence, local)
    pool.release(owned)

    second = [*first[:8], 99, 98, 97, 96]  # shares two blocks
    held = pool.acquire_prefix(hashes(second)[0])

    assert held == owned[:2]  # the same pool blocks: nothing copied
    assert pool.held_blocks == 2 and pool.free_blocks == 14
    pool.release(held)
    assert pool.held_blocks == 0


def test_prompts_with_a_common_prefix_share_its_blocks() -> None:
    log = EventLog()
    cache = KvPool(capacity_blocks=16, block_size=BLOCK, worker="w", publish_events=log)
    shared = list(range(8))
    run_request(cache, [*shared, 1, 1, 1, 1])

    reused, stored = run_request(cache, [*shared, 2, 2, 2, 2])

    assert (reused, stored) == (2, 1)
    assert len(cache) == 4
    last = log.events[-1]
    assert last.kind == "stored" and last.parent_hash == hashes(shared)[0][-1]
    assert last.local_hashes == tuple(local_block_hashes([*shared, 2, 2, 2, 2], BLOCK)[2:])


def test_same_tokens_with_another_image_are_other_blocks() -> None:
    cache = KvPool(capacity_blocks=16, block_size=BLOCK, worker="w")
    tokens = [7, 7, 9, 9, 9, 9, 9, 9]
    cat = block_hashes(tokens, BLOCK, [MediaPlacement(111, 2, 6)])
    dog = block_hashes(tokens, BLOCK, [MediaPlacement(222, 2, 6)])
    blocks = cache.allocate(2)
    cache.commit(blocks, 0, 2, cat, local_block_hashes(tokens, BLOCK, [MediaPlacement(111, 2, 6)]))
    cache.release(blocks)

    assert len(cache.acquire_prefix(dog)) == 0
    assert len(cache.acquire_prefix(cat)) == 2


def test_eviction_takes_the_least_recently_used_leaf_before_its_parent() -> None:
    log = EventLog()
    cache = KvPool(capacity_blocks=4, block_size=BLOCK, worker="w", publish_events=log)
    old = [1] * 8  # blocks A, A'
    recent = [2] * 8  # blocks B, B'
    run_request(cache, old)
    run_request(cache, recent)

    run_request(cache, [3] * 4)  # needs one block

    old_hashes, _ = hashes(old)
    removed = [event.block_hashes for event in log.events if event.kind == "removed"]
    assert removed == [(old_hashes[1],)]  # the old leaf, not its parent, not the recent path
    assert cache.block_hashes() == log.blocks


def test_events_replayed_after_many_evictions_equal_the_cache() -> None:
    # given a small cache and requests that share prefixes, repeat, and overflow it
    log = EventLog()
    cache = KvPool(capacity_blocks=7, block_size=BLOCK, worker="w", publish_events=log)
    base = list(range(100, 108))
    for step in range(40):
        branch = [step % 5] * (4 * (1 + step % 3))
        run_request(cache, [*base[: 4 * (step % 3)], *branch])

    # then the events describe exactly the blocks held, and capacity was respected
    assert any(event.kind == "removed" for event in log.events)
    assert cache.block_hashes() == log.blocks
    assert len(cache) <= 7


def test_blocks_in_use_are_never_evicted() -> None:
    cache = KvPool(capacity_blocks=3, block_size=BLOCK, worker="w")
    running = [5] * 8
    sequence, local = hashes(running)
    held = cache.allocate(2)
    cache.commit(held, 0, 2, sequence, local)  # the running request holds 2 blocks

    reused, stored = run_request(cache, [6] * 12)  # wants 3 blocks; only 1 is free

    assert (reused, stored) == (0, 1)
    assert set(sequence) <= cache.block_hashes()
    assert cache.allocate(3) is None  # two held, one cached: never more than one to give
    cache.release(held)
    assert run_request(cache, [6] * 12) == (1, 2)  # released blocks make room again


def test_a_prompt_larger_than_the_cache_is_cached_in_part() -> None:
    log = EventLog()
    cache = KvPool(capacity_blocks=3, block_size=BLOCK, worker="w", publish_events=log)

    reused, stored = run_request(cache, list(range(40)))  # ten blocks

    assert (reused, stored) == (0, 3)
    assert cache.block_hashes() == set(hashes(list(range(40)))[0][:3]) == log.blocks
    assert run_request(cache, list(range(40))) == (3, 0)


def test_clear_drops_everything_and_a_running_request_survives_it() -> None:
    log = EventLog()
    cache = KvPool(capacity_blocks=8, block_size=BLOCK, worker="w", publish_events=log)
    run_request(cache, [1] * 8)
    tokens = [1] * 12
    sequence, local = hashes(tokens)
    held = cache.acquire_prefix(sequence)
    held += cache.allocate(1)

    assert cache.clear() == 2

    assert cache.commit(held, 2, 3, sequence, local) == 0  # its prefix is gone
    assert cache.held_blocks == 3  # the running request keeps its blocks
    cache.release(held)
    assert log.events[-1].kind == "cleared"
    assert cache.block_hashes() == set() == log.blocks
    assert run_request(cache, tokens) == (0, 3)


def test_published_events_make_the_redis_index_mirror_the_cache(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    index = KvIndex(redis_client, key_namespace)
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)
    cache = KvPool(capacity_blocks=5, block_size=BLOCK, worker="gpu-test", publish_events=publisher.publish)
    cache.clear()
    for step in range(12):
        run_request(cache, [step % 4] * 4 + [step] * 4 * (step % 3))

    assert index.worker_blocks("gpu-test") == cache.block_hashes()
    probe = [1] * 4
    assert index.overlaps(hashes(probe)[0], ["gpu-test"])["gpu-test"] == run_request(cache, probe)[0]


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_cache_needs_room_for_a_block(capacity: int) -> None:
    with pytest.raises(ValueError):
        KvPool(capacity_blocks=capacity, block_size=BLOCK, worker="w")


def test_reusing_blocks_without_evictions_keeps_bookkeeping_bounded() -> None:
    cache = KvPool(capacity_blocks=64, block_size=BLOCK, worker="w")
    for _ in range(500):
        run_request(cache, [1] * 16)

    assert len(cache._evictable) <= 2 * len(cache) + 64
    run_request(cache, [2] * 4 * 61)  # fills the cache: the one LRU path must still be found
    assert len(cache) == 64
