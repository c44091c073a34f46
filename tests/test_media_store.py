"""The media side store on the real Redis: references instead of bytes, TTL, caps, clear misses."""

from __future__ import annotations

import time

import pytest
import redis
import redis.asyncio

from routing.media.store import MediaMissing, MediaRef, MediaStore, MediaStoreFull, MediaTooLarge
from routing.state.redis_direct import AsyncDirectCommands


def store(redis_client, key_namespace, **limits) -> MediaStore:
    return MediaStore(redis_client, key_namespace, **limits)


def test_a_blob_comes_back_by_its_reference_which_survives_the_payload_round_trip(
    redis_client, key_namespace
):
    media = store(redis_client, key_namespace)
    ref = media.put("req-1", b"\x89PNG...bytes")
    again = MediaRef.from_payload(ref.to_payload())
    assert media.get(again) == b"\x89PNG...bytes"
    assert media.total_bytes() == len(b"\x89PNG...bytes")


def test_many_blobs_come_back_in_order_in_one_call(redis_client, key_namespace):
    media = store(redis_client, key_namespace)
    refs = media.put_many("req-1", [b"one", b"two", b"three"])
    assert media.get_many(refs) == [b"one", b"two", b"three"]


def test_a_released_reference_is_a_clear_error_at_once_and_frees_its_bytes(redis_client, key_namespace):
    media = store(redis_client, key_namespace)
    ref = media.put("req-1", b"x" * 100)
    assert media.release("req-1", [ref]) == 100
    assert media.total_bytes() == 0
    started = time.monotonic()
    with pytest.raises(MediaMissing) as missing:
        media.get(ref)
    assert time.monotonic() - started < 1.0
    assert missing.value.status == 503 and "no longer stored" in missing.value.message
    assert media.release("req-1", [ref]) == 0  # freeing twice frees nothing twice


async def test_an_event_loop_releases_as_a_thread_does_on_its_own_connections(
    redis_client, key_namespace, redis_url
):
    # given two requests' blobs, and an event loop's own connections to the store's Redis
    media = store(redis_client, key_namespace)
    first = media.put_many("req-1", [b"a" * 100, b"b" * 50])
    second = media.put("req-2", b"c" * 30)
    lines = AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(redis_url))

    # when the loop releases the first request's, then they go as `release` would free them
    assert await media.arelease(lines, "req-1", first) == 150
    assert media.total_bytes() == 30 and media.get(second) == b"c" * 30
    with pytest.raises(MediaMissing):
        media.get(first[0])
    assert not redis_client.exists(f"{key_namespace}media:owner:req-1")
    assert await media.arelease(lines, "req-1", first) == 0  # freeing twice frees nothing twice


class _ForgetfulRedisFaultInjected:
    """A loop's connections to a Redis that forgot its scripts (restarted): NOSCRIPT once."""

    def __init__(self, lines: AsyncDirectCommands) -> None:
        self.lines, self.refused = lines, 0

    async def execute(self, *command):
        if command[0] == "EVALSHA" and not self.refused:
            self.refused += 1
            raise redis.exceptions.NoScriptError("NOSCRIPT No matching script.")
        return await self.lines.execute(*command)


async def test_a_release_after_redis_forgot_its_scripts_loads_the_script_again_fault_injected(
    redis_client, key_namespace, redis_url
):
    media = store(redis_client, key_namespace)
    refs = media.put_many("req-1", [b"a" * 40])
    forgetful = _ForgetfulRedisFaultInjected(
        AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(redis_url))
    )
    assert await media.arelease(forgetful, "req-1", refs) == 40  # type: ignore[arg-type]
    assert forgetful.refused == 1 and media.total_bytes() == 0


def test_blobs_expire_with_their_ttl_and_stop_counting_against_the_total(redis_client, key_namespace):
    media = store(redis_client, key_namespace, ttl_s=0.2, max_total_bytes=150)
    ref = media.put("req-1", b"x" * 100)
    time.sleep(0.35)
    with pytest.raises(MediaMissing):
        media.get(ref)
    # the expired 100 bytes no longer count: another 100 fit under the 150-byte total
    media.put("req-2", b"y" * 100)
    assert media.total_bytes() == 100


def test_the_per_request_cap_refuses_with_413_and_stores_nothing_of_the_request(redis_client, key_namespace):
    media = store(redis_client, key_namespace, max_request_bytes=250)
    with pytest.raises(MediaTooLarge) as refused:
        media.put_many("req-1", [b"a" * 100, b"b" * 100, b"c" * 100])
    assert refused.value.status == 413
    assert media.total_bytes() == 0
    assert not list(redis_client.scan_iter(match=f"{key_namespace}media:blob:*"))
    media.put("req-2", b"d" * 250)  # another request has a cap of its own


def test_the_total_cap_refuses_with_503_while_the_store_is_full(redis_client, key_namespace):
    media = store(redis_client, key_namespace, max_total_bytes=250)
    first = media.put("req-1", b"a" * 200)
    with pytest.raises(MediaStoreFull) as refused:
        media.put("req-2", b"b" * 100)
    assert refused.value.status == 503
    media.release("req-1", [first])
    media.put("req-2", b"b" * 100)
