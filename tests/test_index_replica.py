"""A frontend's replica of the KV index (routing.kv.replica) holds what Redis's index holds: fed by
the event stream in order, started from a snapshot mid-stream, after falling behind a trimmed
stream, after a purge, and after Redis lost the index; two replicas agree with each other."""

from __future__ import annotations

import random
import time

import pytest
import redis

from routing.contract.kv_events import KvEvent
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.kv.replica import IndexReplica
from routing.prompt.hashing import block_hashes

BS = 16
WORKERS = tuple(f"g{i:02d}" for i in range(24))


def _prompts(seed: int, count: int = 6) -> list[list[int]]:
    """Prompts sharing prefixes: a system prompt, then one of a few pictures, then a question."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 50_000) for _ in range(160)]
    pictures = [[rng.randrange(1, 50_000) for _ in range(320)] for _ in range(3)]
    return [
        block_hashes(system + pictures[k % 3] + [rng.randrange(1, 50_000) for _ in range(200)], BS)
        for k in range(count)
    ]


def _random_events(rng: random.Random, prompts: list[list[int]], count: int) -> list[KvEvent]:
    """What caches do: store a prompt's prefix, evict a prompt's last blocks (leaves first), clear."""
    events = []
    for _ in range(count):
        worker = rng.choice(WORKERS)
        hashes = rng.choice(prompts)
        roll = rng.random()
        if roll < 0.7:
            events.append(KvEvent("stored", worker, tuple(hashes[: rng.randrange(1, len(hashes) + 1)])))
        elif roll < 0.95:
            events.append(KvEvent("removed", worker, tuple(hashes[rng.randrange(1, len(hashes)) :])))
        else:
            events.append(KvEvent("cleared", worker))
    return events


@pytest.fixture
def index(redis_client: redis.Redis, key_namespace: str) -> KvIndex:
    # The linear walk: exact whatever the events (the replica's walk is exact too).
    return KvIndex(redis_client, key_namespace, prefix_closed=False)


@pytest.fixture
def publisher(redis_client: redis.Redis, key_namespace: str, index: KvIndex) -> KvEventPublisher:
    return KvEventPublisher(redis_client, key_namespace, index=index)


def _replica(redis_client: redis.Redis, key_namespace: str, index: KvIndex) -> IndexReplica:
    return IndexReplica(redis_client, key_namespace, index=index)


def _assert_mirrors(replica: IndexReplica, index: KvIndex, prompts: list[list[int]]) -> None:
    for hashes in prompts:
        assert replica.overlaps(hashes, WORKERS) == index.overlaps(hashes, WORKERS)


def test_a_replica_following_the_stream_gives_each_worker_the_overlap_the_index_gives(
    redis_client, key_namespace, index, publisher
):
    # given: a replica built before any event, and 600 random events published in batches
    replica = _replica(redis_client, key_namespace, index)
    replica.sync()
    rng = random.Random(1)
    prompts = _prompts(1)
    for _ in range(30):
        publisher.publish(_random_events(rng, prompts, 20))
        # when: it reads what is new
        replica.sync()
        # then: every worker's overlap on every prompt is the index's
        _assert_mirrors(replica, index, prompts)
    assert replica.rebuilds == 1 and replica.resyncs == 0


def test_a_replica_started_mid_stream_agrees_with_one_that_followed_it_from_the_start(
    redis_client, key_namespace, index, publisher
):
    rng = random.Random(2)
    prompts = _prompts(2)
    early = _replica(redis_client, key_namespace, index)
    early.sync()
    publisher.publish(_random_events(rng, prompts, 300))
    # given: a second replica whose snapshot of each worker is taken while events keep coming
    # (fault injection: an event is published between its stream position and each snapshot)
    late = _replica(redis_client, key_namespace, index)
    snapshot = index.snapshot

    def snapshot_while_publishing(worker: str):
        publisher.publish(_random_events(rng, prompts, 3))
        return snapshot(worker)

    index.snapshot = snapshot_while_publishing  # type: ignore[method-assign]
    late.sync()
    index.snapshot = snapshot  # type: ignore[method-assign]
    publisher.publish(_random_events(rng, prompts, 100))

    # when
    while late.sync() or early.sync():
        pass

    # then: both mirror the index, each event applied once over the snapshot
    _assert_mirrors(late, index, prompts)
    _assert_mirrors(early, index, prompts)
    assert late.entries() == early.entries()


def test_a_replica_that_fell_behind_a_trimmed_stream_reads_the_workers_it_missed_again(
    redis_client, key_namespace, index
):
    # given: a replica in step, then far more events than the stream keeps
    publisher = KvEventPublisher(redis_client, key_namespace, index=index, maxlen=10)
    replica = _replica(redis_client, key_namespace, index)
    rng = random.Random(3)
    prompts = _prompts(3)
    publisher.publish(_random_events(rng, prompts, 50))
    replica.sync()
    for _ in range(40):
        publisher.publish(_random_events(rng, prompts, 25))
    assert redis_client.xlen(f"{key_namespace}kv:events") < 1_000

    # when: it next looks at what was trimmed (at least every second, and after a full batch)
    replica._epoch_checked_at = float("-inf")
    while replica.sync():
        pass

    # then: the workers whose events it missed were read again, and it mirrors the index
    assert replica.resyncs > 0
    _assert_mirrors(replica, index, prompts)


def test_a_worker_purged_from_the_index_leaves_every_replica(redis_client, key_namespace, index, publisher):
    prompts = _prompts(4)
    replicas = [_replica(redis_client, key_namespace, index) for _ in range(2)]
    publisher.publish([KvEvent("stored", name, tuple(prompts[0])) for name in WORKERS[:3]])
    for replica in replicas:
        replica.sync()
        assert replica.overlaps(prompts[0], ["g01"]) == {"g01": len(prompts[0])}

    # when: its heartbeat lapsed and a frontend purged it
    index.purge_worker("g01")
    for replica in replicas:
        replica.sync()

    # then
    for replica in replicas:
        assert replica.overlaps(prompts[0], ["g00", "g01"]) == {"g00": len(prompts[0]), "g01": 0}
        assert replica.entries() == 2 * len(prompts[0])


def test_after_redis_loses_the_index_the_replica_holds_what_the_workers_announce_again(
    redis_client, key_namespace, index, publisher
):
    # given: a replica in step with an index of several workers
    prompts = _prompts(5)
    replica = _replica(redis_client, key_namespace, index)
    publisher.publish([KvEvent("stored", name, tuple(prompts[k % 6])) for k, name in enumerate(WORKERS)])
    replica.sync()
    old_epoch = index.epoch()

    # when: Redis loses everything (the namespace's keys, the epoch and the stream with them), and
    # the workers that see the new epoch announce their blocks again: two of them, here
    for key in redis_client.scan_iter(match=f"{key_namespace}*"):
        redis_client.delete(key)
    assert index.epoch() != old_epoch
    publisher.publish([KvEvent("cleared", "g03"), KvEvent("stored", "g03", tuple(prompts[1][:7]))])
    publisher.publish([KvEvent("cleared", "g04"), KvEvent("stored", "g04", tuple(prompts[2]))])
    replica._epoch_checked_at = float("-inf")  # its next read looks at the epoch (every second)
    replica.sync()

    # then: it holds the new index alone
    assert replica.rebuilds == 2
    _assert_mirrors(replica, index, prompts)
    assert replica.entries() == 7 + len(prompts[2])


def test_a_replica_following_in_its_thread_sees_each_publish(redis_client, key_namespace, index, publisher):
    replica = _replica(redis_client, key_namespace, index)
    replica.start()
    try:
        prompts = _prompts(6)
        publisher.publish([KvEvent("stored", "g07", tuple(prompts[0]))])
        deadline = time.monotonic() + 10
        while not (replica.ready and replica.overlaps(prompts[0], ["g07"])["g07"] == len(prompts[0])):
            assert time.monotonic() < deadline, "the replica never saw the event"
            time.sleep(0.01)
    finally:
        replica.close()


def test_a_replica_that_has_not_read_the_stream_lately_is_not_ready(redis_client, key_namespace, index):
    replica = IndexReplica(redis_client, key_namespace, index=index, stale_after_s=0.05)
    assert not replica.ready
    replica.sync()
    assert replica.ready
    time.sleep(0.1)
    assert not replica.ready  # a router decides from Redis's index then


def test_candidates_are_the_eligible_holders_of_each_prefix_length_drawn_and_the_sample(
    redis_client, key_namespace, index, publisher
):
    # given: 24 workers holding the same prompt to 10, 20 or 30 blocks (8 each)
    hashes = block_hashes([random.Random(7).randrange(1, 50_000) for _ in range(640)], BS)
    depths = {name: (10, 20, 30)[k % 3] for k, name in enumerate(WORKERS)}
    publisher.publish([KvEvent("stored", name, tuple(hashes[:d])) for name, d in depths.items()])
    replica = _replica(redis_client, key_namespace, index)
    replica.sync()
    # g02 holds 30 blocks but is not eligible; two eligible workers hold nothing
    eligible = [name for name in WORKERS if name != "g02"] + ["idle-a", "idle-b"]
    fleet = replica.fleet(eligible)

    # when: at most 4 per prefix length, and a sample of the two workers holding nothing
    at = replica.candidates(hashes, fleet, 4, [len(eligible) - 2, len(eligible) - 1], random.Random(1))

    # then
    assert at is not None
    found = {eligible[position]: overlap for position, overlap in at.items()}
    assert "g02" not in found
    assert sorted(found.values()).count(30) == 4 and sorted(found.values()).count(20) == 4
    assert sorted(found.values()).count(10) == 4
    assert all(found[name] == depths[name] for name in found if name in depths)
    assert found["idle-a"] == found["idle-b"] == 0


def test_a_draw_among_more_holders_than_wanted_gives_as_many_distinct_holders_as_wanted():
    from routing.kv.replica import _drawn

    rng = random.Random(11)
    for _ in range(2_000):
        members = rng.getrandbits(rng.choice((8, 64, 300, 1_100))) | 1 << rng.randrange(4)
        cap = rng.randrange(1, 20)
        drawn = list(_drawn(members, cap, rng))
        assert len(drawn) == len(set(drawn)) == min(cap, members.bit_count())
        assert all(members >> bit & 1 for bit in drawn)


def test_a_view_of_the_fleet_made_before_the_replica_gave_a_bit_is_refused_not_misread(
    redis_client, key_namespace, index, publisher
):
    # given: a view of the fleet made while g00 alone held blocks
    hashes = block_hashes(list(range(1, 65)), BS)
    publisher.publish([KvEvent("stored", "g00", tuple(hashes))])
    replica = _replica(redis_client, key_namespace, index)
    replica.sync()
    fleet = replica.fleet(["g00", "g01"])
    assert replica.candidates(hashes, fleet, 4, [], random.Random(1)) == {0: len(hashes)}

    # when: g01 stores blocks, so the replica gives it a bit the view does not know
    publisher.publish([KvEvent("stored", "g01", tuple(hashes))])
    replica.sync()

    # then: the old view is refused (the router makes it again), and a new one sees both
    assert replica.candidates(hashes, fleet, 4, [], random.Random(1)) is None
    again = replica.fleet(["g00", "g01"])
    assert replica.candidates(hashes, again, 4, [], random.Random(1)) == {0: len(hashes), 1: len(hashes)}


def test_a_load_sample_is_distinct_positions_of_the_fleet():
    from routing.kv.router import _positions

    rng = random.Random(5)
    for n, k in ((1_024, 16), (17, 16), (16, 16), (3, 16)):
        for _ in range(200):
            drawn = _positions(rng, n, k)
            assert len(drawn) == len(set(drawn)) == min(n, k)
            assert all(0 <= position < n for position in drawn)
