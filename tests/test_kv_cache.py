"""The prefix KV cache: longest-prefix reuse, shared blocks, LRU eviction of unreferenced leaves,
and events that let an index mirror exactly what it holds."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import redis
import torch

from routing.hashing import MediaPlacement, block_hashes, local_block_hashes
from routing.index import KvIndex
from routing.kv_events import KvEvent, KvEventPublisher
from workers.kv_cache import PrefixKvCache, prefix_kv

BLOCK = 4
LAYERS = 2


def prompt_kv(tokens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV whose every position holds its token id (keys) and its negation (values)."""
    column = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [
        (column.expand(1, 2, -1, 3).clone() + layer, -column.expand(1, 2, -1, 3).clone())
        for layer in range(LAYERS)
    ]


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


def run_request(cache: PrefixKvCache, tokens: Sequence[int]) -> tuple[int, int]:
    """Acquire, store and release like the engine does; returns (reused blocks, stored blocks)."""
    sequence, local = hashes(tokens)
    lease = cache.acquire(sequence)
    try:
        stored = cache.store(lease, sequence, local, prompt_kv(tokens))
    finally:
        cache.release(lease)
    return lease.reused_blocks, stored


def test_longest_cached_prefix_is_reused_and_its_kv_is_the_prompts() -> None:
    cache = PrefixKvCache(capacity_blocks=16, block_size=BLOCK, worker="w")
    first = list(range(10, 22))  # three blocks
    run_request(cache, first)

    second = [*first[:8], 99, 98, 97, 96]  # shares two blocks
    sequence, _ = hashes(second)
    lease = cache.acquire(sequence)

    assert lease.reused_blocks == 2
    keys, values = prefix_kv(lease.blocks)[1]
    assert keys[0, 0, :, 0].tolist() == [t + 1 for t in first[:8]]
    assert values[0, 1, :, 2].tolist() == [-t for t in first[:8]]
    cache.release(lease)


def test_prompts_with_a_common_prefix_share_its_blocks() -> None:
    log = EventLog()
    cache = PrefixKvCache(capacity_blocks=16, block_size=BLOCK, worker="w", publish_events=log)
    shared = list(range(8))
    run_request(cache, [*shared, 1, 1, 1, 1])

    reused, stored = run_request(cache, [*shared, 2, 2, 2, 2])

    assert (reused, stored) == (2, 1)
    assert len(cache) == 4
    last = log.events[-1]
    assert last.kind == "stored" and last.parent_hash == hashes(shared)[0][-1]
    assert last.local_hashes == tuple(local_block_hashes([*shared, 2, 2, 2, 2], BLOCK)[2:])


def test_same_tokens_with_another_image_are_other_blocks() -> None:
    cache = PrefixKvCache(capacity_blocks=16, block_size=BLOCK, worker="w")
    tokens = [7, 7, 9, 9, 9, 9, 9, 9]
    cat = block_hashes(tokens, BLOCK, [MediaPlacement(111, 2, 6)])
    dog = block_hashes(tokens, BLOCK, [MediaPlacement(222, 2, 6)])
    lease = cache.acquire(cat)
    cache.store(lease, cat, local_block_hashes(tokens, BLOCK, [MediaPlacement(111, 2, 6)]), prompt_kv(tokens))
    cache.release(lease)

    assert cache.acquire(dog).reused_blocks == 0
    assert cache.acquire(cat).reused_blocks == 2


def test_eviction_takes_the_least_recently_used_leaf_before_its_parent() -> None:
    log = EventLog()
    cache = PrefixKvCache(capacity_blocks=4, block_size=BLOCK, worker="w", publish_events=log)
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
    cache = PrefixKvCache(capacity_blocks=7, block_size=BLOCK, worker="w", publish_events=log)
    base = list(range(100, 108))
    for step in range(40):
        branch = [step % 5] * (4 * (1 + step % 3))
        run_request(cache, [*base[: 4 * (step % 3)], *branch])

    # then the events describe exactly the blocks held, and capacity was respected
    assert any(event.kind == "removed" for event in log.events)
    assert cache.block_hashes() == log.blocks
    assert len(cache) <= 7


def test_blocks_in_use_are_never_evicted() -> None:
    cache = PrefixKvCache(capacity_blocks=3, block_size=BLOCK, worker="w")
    running = [5] * 8
    sequence, local = hashes(running)
    lease = cache.acquire(sequence)
    cache.store(lease, sequence, local, prompt_kv(running))  # the running request holds 2 blocks

    reused, stored = run_request(cache, [6] * 12)  # wants 3 blocks; only 1 is free

    assert (reused, stored) == (0, 1)
    assert set(sequence) <= cache.block_hashes()
    cache.release(lease)
    assert run_request(cache, [6] * 12) == (1, 2)  # released blocks make room again


def test_a_prompt_larger_than_the_cache_is_cached_in_part() -> None:
    log = EventLog()
    cache = PrefixKvCache(capacity_blocks=3, block_size=BLOCK, worker="w", publish_events=log)

    reused, stored = run_request(cache, list(range(40)))  # ten blocks

    assert (reused, stored) == (0, 3)
    assert cache.block_hashes() == set(hashes(list(range(40)))[0][:3]) == log.blocks
    assert run_request(cache, list(range(40))) == (3, 0)


def test_clear_drops_everything_and_a_running_request_survives_it() -> None:
    log = EventLog()
    cache = PrefixKvCache(capacity_blocks=8, block_size=BLOCK, worker="w", publish_events=log)
    run_request(cache, [1] * 8)
    tokens = [1] * 12
    sequence, local = hashes(tokens)
    lease = cache.acquire(sequence)

    assert cache.clear() == 2

    assert cache.store(lease, sequence, local, prompt_kv(tokens)) == 0  # its prefix is gone
    cache.release(lease)
    assert log.events[-1].kind == "cleared"
    assert cache.block_hashes() == set() == log.blocks
    assert run_request(cache, tokens) == (0, 3)


def test_published_events_make_the_redis_index_mirror_the_cache(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    index = KvIndex(redis_client, key_namespace)
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)
    cache = PrefixKvCache(
        capacity_blocks=5, block_size=BLOCK, worker="gpu-test", publish_events=publisher.publish
    )
    cache.clear()
    for step in range(12):
        run_request(cache, [step % 4] * 4 + [step] * 4 * (step % 3))

    assert index.worker_blocks("gpu-test") == cache.block_hashes()
    probe = [1] * 4
    assert index.overlaps(hashes(probe)[0], ["gpu-test"])["gpu-test"] == run_request(cache, probe)[0]


@pytest.mark.parametrize("capacity", [0, -1])
def test_a_cache_needs_room_for_a_block(capacity: int) -> None:
    with pytest.raises(ValueError):
        PrefixKvCache(capacity_blocks=capacity, block_size=BLOCK, worker="w")


def test_reusing_blocks_without_evictions_keeps_bookkeeping_bounded() -> None:
    cache = PrefixKvCache(capacity_blocks=64, block_size=BLOCK, worker="w")
    for _ in range(500):
        run_request(cache, [1] * 16)

    assert len(cache._evictable) <= 2 * len(cache) + 64
    run_request(cache, [2] * 4 * 61)  # fills the cache: the one LRU path must still be found
    assert len(cache) == 64
