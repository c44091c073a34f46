"""Load tracking in Redis: the request lifecycle, sharing between processes, and expiry."""

from __future__ import annotations

import struct
import time

import pytest
import redis

from routing.kv.load import LoadTracker, WorkerLoad


@pytest.fixture
def load(redis_client: redis.Redis, key_namespace: str) -> LoadTracker:
    return LoadTracker(redis_client, key_namespace)


# The entry TTL of the expiry tests, and their waits in thirds and halves of it: long enough that
# a loaded machine's scheduling delays (tenths of a second) do not move a check across an expiry.
TTL_S = 0.9


def test_a_request_counts_prefill_until_its_first_token_and_blocks_until_freed(load: LoadTracker) -> None:
    # given
    load.add("gpu0", "r1", prefill_tokens=1_600, blocks=125)
    load.add("gpu0", "r2", prefill_tokens=400, blocks=30)
    assert load.snapshot(["gpu0", "gpu1"]) == {
        "gpu0": WorkerLoad(active_prefill_tokens=2_000, active_decode_blocks=155, active_requests=2),
        "gpu1": WorkerLoad(0, 0, 0),
    }

    # when: r1 produces its first token
    assert load.prefill_done("gpu0", "r1")
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(400, 155, 2)

    # when: r1 completes and r2 is cancelled
    assert load.free("gpu0", "r1")
    assert load.free("gpu0", "r2")

    # then
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(0, 0, 0)
    assert not load.free("gpu0", "r2")  # freeing twice is harmless
    assert not load.prefill_done("gpu0", "r2")


def test_nothing_stays_in_redis_once_every_request_is_freed(
    redis_client: redis.Redis, key_namespace: str, load: LoadTracker
) -> None:
    for i in range(5):
        load.add(f"gpu{i % 2}", f"r{i}", 100, 7)
    load.prefill_done("gpu0", "r0")
    for i in range(5):
        load.free(f"gpu{i % 2}", f"r{i}")
    assert list(redis_client.scan_iter(match=f"{key_namespace}*")) == []


def test_adding_a_request_twice_replaces_it_instead_of_counting_it_twice(load: LoadTracker) -> None:
    load.add("gpu0", "r1", 100, 10)
    load.add("gpu0", "r1", 50, 4)
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(50, 4, 1)


def test_every_process_sees_the_same_load(redis_url: str, key_namespace: str, load: LoadTracker) -> None:
    # given: a second frontend process, with its own connection
    other_client = redis.Redis.from_url(redis_url)
    other = LoadTracker(other_client, key_namespace)
    try:
        # when
        load.add("gpu0", "r1", 320, 20)
        other.add("gpu0", "r2", 160, 10)
        other.prefill_done("gpu0", "r1")

        # then
        assert load.snapshot(["gpu0"]) == other.snapshot(["gpu0"]) == {"gpu0": WorkerLoad(160, 30, 2)}
    finally:
        other_client.close()


def test_an_entry_left_behind_by_a_dead_frontend_expires_after_its_ttl(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given: a short entry TTL; r1 is never freed (its frontend died), r2 keeps decoding
    load = LoadTracker(redis_client, key_namespace, entry_ttl_s=TTL_S)
    load.add("gpu0", "r1", 500, 30)
    time.sleep(2 * TTL_S / 3)
    load.add("gpu0", "r2", 100, 5)
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(600, 35, 2)

    # when: r1's TTL has passed, r2's not yet
    time.sleep(TTL_S / 2)

    # then
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(100, 5, 1)
    time.sleep(2 * TTL_S / 3)
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(0, 0, 0)
    assert list(redis_client.scan_iter(match=f"{key_namespace}*")) == []


def test_the_first_token_restarts_the_entry_ttl(redis_client: redis.Redis, key_namespace: str) -> None:
    load = LoadTracker(redis_client, key_namespace, entry_ttl_s=TTL_S)
    load.add("gpu0", "r1", 500, 30)
    time.sleep(2 * TTL_S / 3)
    load.prefill_done("gpu0", "r1")
    time.sleep(2 * TTL_S / 3)
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(0, 30, 1)


def test_negative_load_is_refused(load: LoadTracker) -> None:
    with pytest.raises(ValueError):
        load.add("gpu0", "r1", -1, 3)


def test_a_drifted_sum_fault_injected_heals_when_the_workers_last_request_goes(
    redis_client: redis.Redis, key_namespace: str, load: LoadTracker
) -> None:
    # given: two requests on gpu0, and its sums inflated behind the tracker's back (as a process
    # of an older layout freeing an entry without them would leave them)
    load.add("gpu0", "r1", 100, 10)
    load.add("gpu0", "r2", 50, 4)
    redis_client.hset(f"{key_namespace}load:totals", "gpu0", struct.pack(">qqqq", 900, 90, 7, 0))
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(900, 90, 7)

    # when: one request goes, then the last
    load.free("gpu0", "r1")
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(800, 80, 6)  # still drifted
    load.free("gpu0", "r2")

    # then: with nothing in flight, nothing is counted, and the next request counts alone
    assert load.totals("gpu0") is None
    load.add("gpu0", "r3", 30, 2)
    assert load.snapshot(["gpu0"])["gpu0"] == WorkerLoad(30, 2, 1)
    load.free("gpu0", "r3")
