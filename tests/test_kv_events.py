"""KV events: their JSON form, and publication that updates the index and the stream together."""

from __future__ import annotations

import json

import pytest
import redis

from routing.contract.kv_events import KvEvent
from routing.kv.events import EVENTS_STREAM, KvEventPublisher, read_events
from routing.kv.index import KvIndex


@pytest.fixture
def index(redis_client: redis.Redis, key_namespace: str) -> KvIndex:
    return KvIndex(redis_client, key_namespace)


def test_event_round_trips_through_a_json_safe_dict() -> None:
    event = KvEvent("stored", "gpu0", (1, 2**64 - 1), parent_hash=2**63, local_hashes=(5, 6), event_id=9)
    assert KvEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    assert KvEvent.from_dict({"kind": "cleared", "worker": "gpu0"}) == KvEvent("cleared", "gpu0")


def test_unknown_event_kind_is_refused() -> None:
    with pytest.raises(ValueError):
        KvEvent("evicted", "gpu0")  # type: ignore[arg-type]


def test_publish_updates_the_index_and_appends_to_the_stream_in_order(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)
    batch = [
        KvEvent("stored", "gpu0", (10, 11, 12), local_hashes=(1, 2, 3)),
        KvEvent("stored", "gpu1", (10,)),
        KvEvent("removed", "gpu0", (12,)),
        KvEvent("stored", "gpu0", (13,), parent_hash=11),
    ]

    # when
    publisher.publish(batch)

    # then: the index mirrors the cache at once
    assert index.worker_blocks("gpu0") == {10, 11, 13}
    assert index.overlaps([10, 11, 12], ["gpu0", "gpu1"]) == {"gpu0": 2, "gpu1": 1}
    # and the stream holds the same events, in order, with ids counting up per worker
    events = [event for _, event in read_events(redis_client, key_namespace)]
    assert [(e.kind, e.worker, e.block_hashes, e.parent_hash) for e in events] == [
        (e.kind, e.worker, e.block_hashes, e.parent_hash) for e in batch
    ]
    assert [(e.worker, e.event_id) for e in events] == [("gpu0", 1), ("gpu1", 1), ("gpu0", 2), ("gpu0", 3)]
    assert events[0].local_hashes == (1, 2, 3)


def test_an_observer_resumes_reading_after_the_last_event_it_saw(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)
    publisher.publish([KvEvent("stored", "gpu0", (1,)), KvEvent("stored", "gpu0", (2,))])
    first = read_events(redis_client, key_namespace, count=1)
    rest = read_events(redis_client, key_namespace, last_id=first[-1][0])
    assert [e.block_hashes for _, e in first + rest] == [(1,), (2,)]
    assert read_events(redis_client, key_namespace, last_id=rest[-1][0]) == []


def test_event_ids_keep_counting_up_after_the_worker_process_restarts(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    KvEventPublisher(redis_client, key_namespace, index=index).publish([KvEvent("stored", "gpu0", (1,))])
    restarted = KvEventPublisher(redis_client, key_namespace, index=KvIndex(redis_client, key_namespace))
    restarted.publish([KvEvent("stored", "gpu0", (2,))])
    assert [e.event_id for _, e in read_events(redis_client, key_namespace)] == [1, 2]


def test_the_stream_stays_capped(redis_client: redis.Redis, key_namespace: str, index: KvIndex) -> None:
    publisher = KvEventPublisher(redis_client, key_namespace, index=index, maxlen=100)
    for start in range(0, 1_000, 50):
        publisher.publish([KvEvent("stored", "gpu0", (h,)) for h in range(start, start + 50)])
    # MAXLEN ~ trims whole stream nodes (100 entries each by default), never less than asked
    assert 100 <= redis_client.xlen(f"{key_namespace}{EVENTS_STREAM}") <= 200
    assert len(index.worker_blocks("gpu0")) == 1_000


def test_a_cleared_event_empties_the_workers_index_entries(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)
    publisher.publish([KvEvent("stored", "gpu0", (1, 2, 3)), KvEvent("cleared", "gpu0")])
    assert index.worker_blocks("gpu0") == set()
    # nothing of the worker stays in the index (no bucket, promoted holders, log, count or id);
    # the event stream keeps the events themselves
    left = {key.decode() for key in redis_client.scan_iter(match=f"{key_namespace}kv:*")}
    assert {key.removeprefix(key_namespace) for key in left} <= {"kv:epoch", "kv:events", "kv:event-ids"}


def test_publisher_refuses_an_index_in_another_namespace(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    with pytest.raises(ValueError):
        KvEventPublisher(redis_client, key_namespace, index=KvIndex(redis_client, f"{key_namespace}x:"))


def test_a_purge_is_announced_on_the_stream_as_the_workers_cleared_event_with_its_next_id(
    redis_client: redis.Redis, key_namespace: str, index: KvIndex
) -> None:
    # given: a worker that published two events, and one that never stored anything
    publisher = KvEventPublisher(redis_client, key_namespace, index=index)
    publisher.publish([KvEvent("stored", "gpu0", (1, 2)), KvEvent("removed", "gpu0", (2,))])
    # when: its heartbeat lapsed and a frontend purged it; and the other is purged too
    assert index.purge_worker("gpu0") == 1
    assert index.purge_worker("gpu9") == 0
    # then: the stream says so, as the worker's own `cleared` would, and nothing of the other
    events = [event for _id, event in read_events(redis_client, key_namespace)]
    assert events[-1] == KvEvent("cleared", "gpu0", event_id=3)
    assert [event.worker for event in events] == ["gpu0"] * 3
