"""The media side store on the real Redis: references instead of bytes, TTL, caps, clear misses."""

from __future__ import annotations

import time

import pytest

from routing.media.store import MediaMissing, MediaRef, MediaStore, MediaStoreFull, MediaTooLarge


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
