"""The embedding cache: LRU by tensor bytes, keys that partition by scope, model and processor."""

from __future__ import annotations

import threading

import torch

from workers.embedding_cache import EmbeddingCache, EmbeddingKey


def key(
    identity: str, *, scope: str | None = None, model: str = "demo", processor: str = "p1"
) -> EmbeddingKey:
    return EmbeddingKey(scope_key=scope, identity=identity, model=model, processor_fingerprint=processor)


def embedding(rows: int, value: float = 1.0) -> torch.Tensor:
    return torch.full((rows, 8), value, dtype=torch.float32)  # 32 bytes a row


def test_least_recently_used_entries_go_first_once_bytes_exceed_capacity() -> None:
    cache = EmbeddingCache(capacity_bytes=3 * 320)
    for name in ("a", "b", "c"):
        cache.put(key(name), embedding(10))
    cache.get(key("a"))  # a is now more recent than b

    cache.put(key("d"), embedding(10))

    assert key("b") not in cache
    assert all(key(name) in cache for name in ("a", "c", "d"))
    assert cache.size_bytes == 3 * 320
    assert cache.evictions == 1


def test_a_large_entry_evicts_as_many_as_it_needs() -> None:
    cache = EmbeddingCache(capacity_bytes=1200)
    for name in ("a", "b", "c"):
        cache.put(key(name), embedding(10))

    cache.put(key("big"), embedding(25))  # 800 bytes

    assert [name for name in ("a", "b", "c", "big") if key(name) in cache] == ["c", "big"]
    assert cache.size_bytes == 320 + 800


def test_an_entry_larger_than_the_cache_is_not_kept() -> None:
    cache = EmbeddingCache(capacity_bytes=100)
    cache.put(key("small"), embedding(2))

    assert cache.put(key("huge"), embedding(10)) is False
    assert key("small") in cache and key("huge") not in cache


def test_hits_and_misses_are_counted() -> None:
    cache = EmbeddingCache(capacity_bytes=10_000)
    stored = embedding(3, 0.5)
    cache.put(key("a"), stored)

    assert cache.get(key("a")) is not None
    assert torch.equal(cache.get(key("a")), stored)
    assert cache.get(key("b")) is None
    assert (cache.hits, cache.misses) == (2, 1)


def test_scope_model_and_processor_settings_partition_entries() -> None:
    cache = EmbeddingCache(capacity_bytes=10_000)
    cache.put(key("img", scope="s1"), embedding(2))

    assert cache.get(key("img", scope="s2")) is None
    assert cache.get(key("img")) is None
    assert cache.get(key("img", scope="s1", model="other")) is None
    assert cache.get(key("img", scope="s1", processor="p2")) is None
    assert cache.get(key("img", scope="s1")) is not None


def test_discarding_a_scope_leaves_other_scopes() -> None:
    cache = EmbeddingCache(capacity_bytes=10_000)
    cache.put(key("img", scope="s1"), embedding(2))
    cache.put(key("other", scope="s1"), embedding(2))
    cache.put(key("img", scope="s2"), embedding(2))

    assert cache.discard_scope("s1") == 2
    assert len(cache) == 1 and cache.size_bytes == 64
    assert cache.clear() == 1 and cache.size_bytes == 0


def test_replacing_an_entry_counts_its_bytes_once() -> None:
    cache = EmbeddingCache(capacity_bytes=10_000)
    cache.put(key("a"), embedding(10))
    cache.put(key("a"), embedding(20))
    assert cache.size_bytes == 640 and len(cache) == 1


def test_concurrent_use_keeps_the_byte_count_exact() -> None:
    cache = EmbeddingCache(capacity_bytes=50 * 320)

    def worker(offset: int) -> None:
        for step in range(300):
            name = f"img{(offset + step) % 80}"
            if cache.get(key(name)) is None:
                cache.put(key(name), embedding(10))

    threads = [threading.Thread(target=worker, args=(n * 7,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert cache.size_bytes == 320 * len(cache) <= 50 * 320
    assert cache.hits + cache.misses == 4 * 300
