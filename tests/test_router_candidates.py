"""A decision over a large fleet weighs candidates, not every worker (KvRouter._candidates): the
holders of the request's longest cached prefixes, the workers its siblings were just sent to,
and a random draw for load. It still finds the cached prefix, still spreads cold requests, and
still keeps a burst of siblings together; it reads a bounded number of workers."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import redis
import redis.asyncio

from routing.contract.kv_events import KvEvent
from routing.kv.decision import WorkerReport
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.kv.replica import IndexReplica
from routing.kv.router import FLEET_FACTS_FAMILY, FLEET_PLACES_FAMILY, HOLDERS_PER_PREFIX, LOAD_SAMPLE
from routing.kv.selection import RoutingPolicy
from routing.prompt.hashing import block_hashes
from tests.test_router import BS, _router, _tokens

FLEET = tuple(f"w{i:03d}" for i in range(300))  # past CANDIDATES_ABOVE


@pytest.fixture(params=["in_redis", "in_a_replica"])
def replica(request, redis_client: redis.Redis, key_namespace: str) -> IndexReplica | None:
    """Where the router finds a large fleet's candidates: in Redis's index, or in this process's
    replica of it (routing.kv.replica), built here and synced after each publish (no thread)."""
    if request.param == "in_redis":
        return None
    replica = IndexReplica(redis_client, key_namespace, index=KvIndex(redis_client, key_namespace))
    replica.sync()
    return replica


@pytest.fixture
def router(redis_client: redis.Redis, key_namespace: str, replica):
    return _router(redis_client, key_namespace, replica=replica)


@pytest.fixture
def publisher(redis_client: redis.Redis, key_namespace: str, replica) -> KvEventPublisher:
    publisher = KvEventPublisher(redis_client, key_namespace, index=KvIndex(redis_client, key_namespace))
    if replica is not None:
        publish = publisher.publish

        def publish_and_sync(events):
            publish(events)
            replica.sync()

        publisher.publish = publish_and_sync  # type: ignore[method-assign]
    return publisher


def test_a_large_fleet_decision_finds_the_one_worker_holding_the_prefix_among_few_candidates(
    router, publisher
):
    # given: a shared system prompt every worker holds, and one worker that also holds the image
    tokens = _tokens(7, 1_000)
    hashes = block_hashes(tokens, BS)
    publisher.publish([KvEvent("stored", name, tuple(hashes[:20])) for name in FLEET])
    publisher.publish([KvEvent("stored", "w137", tuple(hashes[:50]))])
    # when
    decision = router.route(hashes, len(tokens), BS, FLEET, RoutingPolicy(), rng=random.Random(1))
    # then
    assert decision.worker == "w137" and decision.overlap == 50 == decision.best_overlap
    assert len(decision.scores) <= 2 * HOLDERS_PER_PREFIX + LOAD_SAMPLE < len(FLEET)


def test_a_large_fleet_spreads_cold_requests_by_load_over_random_draws(router):
    # when: 120 distinct cold prompts, each reserved and held
    rng = random.Random(2)
    leases = [
        router.decide(
            f"r{n}", block_hashes(_tokens(100 + n, 320), BS), 320, BS, FLEET, RoutingPolicy(), rng=rng
        )
        for n in range(120)
    ]
    # then: no worker got more than two of them (the least loaded of each draw went)
    per_worker = Counter(lease.worker for lease in leases)
    assert max(per_worker.values()) <= 2
    for lease in leases:
        lease.release("done")


def test_a_large_fleet_keeps_a_burst_of_siblings_on_the_worker_the_first_went_to(router):
    # given: a new picture's prompt sent somewhere, whose worker has announced nothing yet
    rng = random.Random(3)
    tokens = _tokens(9, 800)
    first = router.decide("first", block_hashes(tokens, BS), len(tokens), BS, FLEET, RoutingPolicy(), rng=rng)
    sibling = tokens[:600] + _tokens(10, 200)  # the same picture, another question: 37 blocks shared
    # when: the sibling comes while the first is in flight
    while_busy = router.route(block_hashes(sibling, BS), len(sibling), BS, FLEET, RoutingPolicy(), rng=rng)
    # then the first's worker is weighed, credited with the shared prefix (its load may outweigh it)
    assert while_busy.best_overlap == 37
    # and once that worker is free again, the sibling goes there
    first.release("done")
    second = router.route(block_hashes(sibling, BS), len(sibling), BS, FLEET, RoutingPolicy(), rng=rng)
    assert second.worker == first.worker and second.overlap == 37


def test_every_candidate_comes_with_its_exact_overlap_even_where_holders_were_drawn(
    redis_client: redis.Redis, key_namespace: str, publisher
):
    # given: nested prefixes of 10, 25, 40 and 50 blocks, each held by more workers than are
    # drawn per prefix length (so a worker first met at a shallow length may hold a deeper one),
    # and an approximate worker credited with 30 blocks by a route
    index = KvIndex(redis_client, key_namespace)
    tokens = _tokens(11, 1_000)
    hashes = block_hashes(tokens, BS)
    rng = random.Random(5)
    shuffled = rng.sample(FLEET, len(FLEET))
    depth = {name: (10, 25, 40, 50)[k % 4] for k, name in enumerate(shuffled[:200])}
    publisher.publish([KvEvent("stored", name, tuple(hashes[:d])) for name, d in depth.items()])
    index.record_routed("w299", hashes[:30])
    sample = rng.sample(FLEET, LOAD_SAMPLE)

    # when
    found = index.candidates(hashes, HOLDERS_PER_PREFIX, sample)

    # then: each overlap is the one the whole-fleet query gives; the draw is bounded per length
    exact = index.overlaps(hashes, list(found))
    assert found == exact
    assert set(sample) <= set(found)
    assert len(found) <= 4 * HOLDERS_PER_PREFIX + LOAD_SAMPLE
    assert {found[name] for name in found if name in depth} == {10, 25, 40, 50}


def test_the_holders_drawn_for_a_widely_held_prefix_change_from_one_decision_to_the_next(
    redis_client: redis.Redis, key_namespace: str, publisher
):
    # given: 120 workers all holding the same 30 blocks (a shared system prompt)
    index = KvIndex(redis_client, key_namespace)
    hashes = block_hashes(_tokens(12, 1_000), BS)
    holders = FLEET[:120]
    publisher.publish([KvEvent("stored", name, tuple(hashes[:30])) for name in holders])

    # when: candidates are asked for ten times, with no sample
    draws = [index.candidates(hashes, HOLDERS_PER_PREFIX, []) for _ in range(10)]

    # then: each draw is bounded and exact, and the draws do not keep naming the same holders
    assert all(len(found) == HOLDERS_PER_PREFIX for found in draws)
    assert all(set(found.values()) == {30} and set(found) <= set(holders) for found in draws)
    assert len({name for found in draws for name in found}) > 2 * HOLDERS_PER_PREFIX


@pytest.mark.parametrize(
    "gone", [(FLEET_FACTS_FAMILY,), (FLEET_PLACES_FAMILY,), (FLEET_FACTS_FAMILY, FLEET_PLACES_FAMILY)]
)
def test_a_large_fleet_decides_the_same_after_its_facts_are_gone(
    router, publisher, redis_client: redis.Redis, key_namespace: str, gone: tuple[str, ...]
):
    # given: one worker holding a long prefix, and a first decision (which writes the read's
    # facts and their places)
    hashes = block_hashes(_tokens(13, 1_000), BS)
    publisher.publish([KvEvent("stored", name, tuple(hashes[:20])) for name in FLEET])
    publisher.publish([KvEvent("stored", "w201", tuple(hashes[:50]))])
    first = router.route(hashes, 1_000, BS, FLEET, RoutingPolicy(), rng=random.Random(1))
    written = [
        key
        for family in (FLEET_FACTS_FAMILY, FLEET_PLACES_FAMILY)
        for key in redis_client.scan_iter(match=f"{key_namespace}{family}*")
    ]
    assert len(written) == 2 and all(redis_client.pttl(key) > 0 for key in written)

    # when: the facts, their places or both are gone (expired, or Redis restarted), and the next
    # decision comes
    redis_client.delete(
        *(key for key in written if key.decode().startswith(tuple(key_namespace + g for g in gone)))
    )
    again = router.route(hashes, 1_000, BS, FLEET, RoutingPolicy(), rng=random.Random(1))

    # then: the same decision, and both are back
    assert first.worker == again.worker == "w201" and again.overlap == 50
    assert redis_client.exists(*written) == 2


def test_a_loaded_fleets_new_read_writes_its_facts_and_leaves_their_places_as_they_are(
    router, publisher, redis_client: redis.Redis, key_namespace: str
):
    def keys(family: str) -> set[bytes]:
        return set(redis_client.scan_iter(match=f"{key_namespace}{family}*"))

    # given: a read of the fleet decided on, and a worker holding the prompt
    hashes = block_hashes(_tokens(21, 400), BS)
    publisher.publish([KvEvent("stored", "w123", tuple(hashes))])
    policy = RoutingPolicy(busy_max_requests=32)
    reports = {name: WorkerReport(capacity_blocks=10_000, running_and_waiting=1) for name in FLEET}
    router.route(hashes, 400, BS, FLEET, policy, reports=reports, rng=random.Random(1))
    (places,) = keys(FLEET_PLACES_FAMILY)
    redis_client.hset(places, "written-before", 0)  # gone if the hash is written again

    # when: the next read finds the same workers with other loads (as heartbeats under load do)
    reports["w007"] = WorkerReport(capacity_blocks=10_000, running_and_waiting=31)
    reports["w123"] = WorkerReport(capacity_blocks=10_000, running_and_waiting=32)
    decided = router.route(hashes, 400, BS, FLEET, policy, reports=reports, rng=random.Random(1))

    # then: its facts are new and weighed (the holder is busy now), and the places are the same
    # hash, not written again: a thousand fields cost Redis milliseconds on its one thread
    assert len(keys(FLEET_FACTS_FAMILY)) == 2 and keys(FLEET_PLACES_FAMILY) == {places}
    assert redis_client.hexists(places, "written-before")
    assert decided.worker != "w123" and "w123" in decided.busy
    # and the same workers in another order are other places
    router.route(hashes, 400, BS, FLEET[::-1], policy, reports=reports, rng=random.Random(1))
    assert len(keys(FLEET_PLACES_FAMILY)) == 2


def test_a_worker_outside_the_fleet_read_is_never_weighed_however_much_it_holds(router, publisher):
    # given: w137 holds the longest prefix but is not among the workers read (disabled, another
    # model, no heartbeat)
    hashes = block_hashes(_tokens(14, 1_000), BS)
    publisher.publish([KvEvent("stored", name, tuple(hashes[:20])) for name in FLEET])
    publisher.publish([KvEvent("stored", "w137", tuple(hashes[:50]))])
    fleet = tuple(name for name in FLEET if name != "w137")

    # when
    decisions = [
        router.route(hashes, 1_000, BS, fleet, RoutingPolicy(), rng=random.Random(seed)) for seed in range(5)
    ]

    # then
    for decision in decisions:
        assert decision.worker != "w137" and decision.best_overlap == 20
        assert "w137" not in {score.worker for score in decision.scores}


def _a_busy_worker_holds_the_longest_prefix(publisher, seed: int):
    """Every worker holds a prompt's first 20 blocks, w250 its first 50, and w250's engine reports
    a full queue: the prompt's hashes, the reports and a policy with a busy threshold."""
    hashes = block_hashes(_tokens(seed, 1_000), BS)
    publisher.publish([KvEvent("stored", name, tuple(hashes[:20])) for name in FLEET])
    publisher.publish([KvEvent("stored", "w250", tuple(hashes[:50]))])
    reports = {name: WorkerReport(capacity_blocks=10_000, running_and_waiting=1) for name in FLEET}
    reports["w250"] = WorkerReport(capacity_blocks=10_000, running_and_waiting=64)
    return hashes, reports, RoutingPolicy(busy_max_requests=32)


def test_among_candidates_a_holder_its_report_says_is_busy_is_passed_over(router, publisher):
    # given: w250 holds the longest prefix, but its engine reports a full queue
    hashes, reports, policy = _a_busy_worker_holds_the_longest_prefix(publisher, 15)

    # when
    decision = router.route(hashes, 1_000, BS, FLEET, policy, reports=reports, rng=random.Random(2))

    # then: it was among those weighed, and left out as busy
    assert decision.busy == ("w250",)
    assert decision.worker != "w250" and decision.overlap == 20
    # and without the report it wins
    assert router.route(hashes, 1_000, BS, FLEET, policy, rng=random.Random(2)).worker == "w250"


def test_among_candidates_a_decision_asked_for_no_scores_holds_the_chosen_workers_alone(router, publisher):
    # given: a busy worker holding the longest prefix, and a preview's decision
    hashes, reports, policy = _a_busy_worker_holds_the_longest_prefix(publisher, 16)
    previewed = router.route(hashes, 1_000, BS, FLEET, policy, reports=reports, rng=random.Random(4))

    # when: reserving, asked for no scores
    lease = router.decide(
        "r1", hashes, 1_000, BS, FLEET, policy, reports=reports, rng=random.Random(4), scores=False
    )

    # then: a worker of the same overlap (the holders are drawn anew at each decision), its score
    # alone, and the busy holder still named
    decision = lease.decision
    assert (
        (decision.overlap, decision.best_overlap) == (previewed.overlap, previewed.best_overlap) == (20, 20)
    )
    assert decision.busy == previewed.busy == ("w250",)
    assert [(s.worker, s.overlap) for s in decision.scores] == [(decision.worker, 20)]
    assert len(previewed.scores) > 2
    assert router.load.snapshot([decision.worker])[decision.worker].active_requests == 1
    lease.release("done")


def test_a_routers_new_facts_replace_those_before_the_last_it_wrote(
    router, publisher, redis_client: redis.Redis, key_namespace: str
):
    hashes = block_hashes(_tokens(16, 400), BS)
    policy = RoutingPolicy(busy_max_requests=32)

    def facts_keys() -> set[bytes]:
        return set(redis_client.scan_iter(match=f"{key_namespace}{FLEET_FACTS_FAMILY}*"))

    # given: facts written for one read of the fleet, then for a newer one whose reports moved
    reports = {name: WorkerReport(capacity_blocks=10_000, running_and_waiting=1) for name in FLEET}
    router.route(hashes, 400, BS, FLEET, policy, reports=reports, rng=random.Random(1))
    first = facts_keys()
    reports["w007"] = WorkerReport(capacity_blocks=10_000, running_and_waiting=5)
    router.route(hashes, 400, BS, FLEET, policy, reports=reports, rng=random.Random(1))
    second = facts_keys()
    # when: a third read decides
    reports["w008"] = WorkerReport(capacity_blocks=10_000, running_and_waiting=5)
    router.route(hashes, 400, BS, FLEET, policy, reports=reports, rng=random.Random(1))
    # then: the last two reads' facts are kept (requests may still decide on the one before the
    # newest), and the first read's are gone
    third = facts_keys()
    assert len(first) == 1 and len(second) == 2 and first < second
    assert len(third) == 2 and not first & third and second - first < third


def test_a_frontend_whose_places_another_unlinked_writes_them_again_and_decides_the_same(
    publisher, redis_client: redis.Redis, key_namespace: str
):
    # given: two frontends' routers deciding on the same read of the fleet (so on the same places),
    # and a worker holding the prompt
    hashes = block_hashes(_tokens(22, 600), BS)
    publisher.publish([KvEvent("stored", "w042", tuple(hashes))])
    one, other = _router(redis_client, key_namespace), _router(redis_client, key_namespace)
    assert one.route(hashes, 600, BS, FLEET, RoutingPolicy(), rng=random.Random(1)).worker == "w042"
    assert other.route(hashes, 600, BS, FLEET, RoutingPolicy(), rng=random.Random(1)).worker == "w042"
    (shared,) = redis_client.scan_iter(match=f"{key_namespace}{FLEET_PLACES_FAMILY}*")

    # when: the first frontend's fleet changes twice (heartbeats lapse), so that it unlinks the
    # places it wrote before the last
    for fewer in (FLEET[:-1], FLEET[:-2]):
        one.route(hashes, 600, BS, fewer, RoutingPolicy(), rng=random.Random(1))
    assert not redis_client.exists(shared)

    # then: the other, still on the first read, finds its places gone, writes them again and
    # decides as before
    again = other.route(hashes, 600, BS, FLEET, RoutingPolicy(), rng=random.Random(1))
    assert again.worker == "w042" and again.overlap == len(hashes)
    assert redis_client.exists(shared)


@pytest.mark.parametrize("fleet_size", [8, len(FLEET)])
async def test_a_decision_awaited_on_the_event_loop_reserves_as_the_threaded_one_does(
    router, publisher, redis_url: str, key_namespace: str, fleet_size: int
):
    from routing.state.redis_direct import AsyncDirectCommands

    # given: one worker holding a long prefix, in a small fleet and a large one (candidates)
    fleet = FLEET[:fleet_size]
    hashes = block_hashes(_tokens(17, 1_000), BS)
    publisher.publish([KvEvent("stored", name, tuple(hashes[:20])) for name in fleet])
    publisher.publish([KvEvent("stored", fleet[5], tuple(hashes[:50]))])
    lines = AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(redis_url))

    # when: decided on the loop, then on a thread, for the same prompt
    awaited = await router.adecide(
        lines, "on-loop", hashes, 1_000, BS, fleet, RoutingPolicy(), rng=random.Random(3)
    )
    threaded = router.decide("on-thread", hashes, 1_000, BS, fleet, RoutingPolicy(), rng=random.Random(3))

    # then: each reserved, and the second saw the first (its predicted blocks: the whole prompt)
    assert awaited.worker == fleet[5] and awaited.decision.overlap == 50
    assert threaded.worker == fleet[5] and threaded.decision.overlap == len(hashes)
    assert sum(load.active_requests for load in router.load.snapshot(fleet).values()) == 2
    awaited.release("done")
    threaded.release("done")
    assert sum(load.active_requests for load in router.load.snapshot(fleet).values()) == 0
    await lines.close()


def test_a_prepared_large_fleet_read_has_its_facts_written_once(
    router, redis_client: redis.Redis, key_namespace: str
):
    def facts_keys() -> set[bytes]:
        return set(redis_client.scan_iter(match=f"{key_namespace}{FLEET_FACTS_FAMILY}*"))

    policy = RoutingPolicy()
    # a fleet read prepared in the background writes its facts
    router.pack_workers(FLEET, None, frozenset(), policy)
    written = facts_keys()
    assert len(written) == 1
    # the same facts again are left as they are (here: gone, as after a Redis restart) ...
    redis_client.delete(*written)
    router.pack_workers(FLEET, None, frozenset(), policy)
    assert facts_keys() == set()
    # ... and the decision that finds them gone writes them
    hashes = block_hashes(_tokens(18, 400), BS)
    assert router.route(hashes, 400, BS, FLEET, policy, rng=random.Random(4)).worker in FLEET
    assert facts_keys() == written


def test_requests_deciding_on_the_read_before_a_newly_prepared_one_repack_and_rewrite_nothing(
    router, redis_client: redis.Redis, key_namespace: str, monkeypatch: pytest.MonkeyPatch
):
    import routing.kv.router as router_module

    def facts_keys() -> set[bytes]:
        return set(redis_client.scan_iter(match=f"{key_namespace}{FLEET_FACTS_FAMILY}*"))

    policy = RoutingPolicy()
    older, newer = FLEET, FLEET[:-1]  # two reads of the fleet: one worker's heartbeat lapsed
    none_approximate = frozenset()  # (a read passes the same objects each time: EligibleWorkers)
    router.pack_workers(older, None, none_approximate, policy)
    hashes = block_hashes(_tokens(20, 400), BS)
    fleet_read = {"approximate_workers": none_approximate, "reports": None}
    router.route(hashes, 400, BS, older, policy, rng=random.Random(5), **fleet_read)  # the replica mask made
    # given: the newer read prepared in the background while requests still decide on the older
    router.pack_workers(newer, None, none_approximate, policy)
    assert len(facts_keys()) == 2
    packs, writes = [], []
    real_pack, real_write = router_module._PackedWorkers.pack, router._write_facts
    monkeypatch.setattr(router_module._PackedWorkers, "pack", lambda *a: packs.append(a) or real_pack(*a))
    monkeypatch.setattr(router, "_write_facts", lambda fleet: writes.append(fleet) or real_write(fleet))

    # when: requests decide on the older read, then on the newer, then on the older again
    for workers in (older, newer, older):
        decision = router.route(hashes, 400, BS, workers, policy, rng=random.Random(6), **fleet_read)
        assert decision.worker in workers

    # then: each read's arguments were packed and its facts written once, in the background
    assert packs == [] and writes == []
    # and a third read's facts replace the oldest's: a router keeps the last two
    router.pack_workers(FLEET[1:], None, none_approximate, policy)
    assert len(facts_keys()) == 2


def test_the_sessions_worker_is_weighed_with_its_exact_overlap_where_its_prefixs_holders_were_drawn(
    router, publisher, redis_client: redis.Redis
):
    # given: 100 workers hold the same 50 blocks (more than are drawn per prefix length), and the
    # session last went to one of them
    hashes = block_hashes(_tokens(19, 1_000), BS)
    holders = FLEET[100:200]
    publisher.publish([KvEvent("stored", name, tuple(hashes[:50])) for name in holders])
    session = "c" * 64
    redis_client.set(router._affinity.key(session), "w150")

    # when: the session's next request is routed, with several draws
    decisions = [
        router.route(hashes, 1_000, BS, FLEET, RoutingPolicy(), session_key=session, rng=random.Random(seed))
        for seed in range(5)
    ]

    # then: its worker is weighed each time with the prefix it holds, and kept
    for decision in decisions:
        assert decision.worker == "w150" and decision.overlap == 50 and decision.reason == "affinity"


def test_a_decision_whose_replica_bits_moved_under_it_finds_its_candidates_in_redis(
    redis_client, key_namespace, monkeypatch
):
    # given: a replica that refuses the view of the fleet it is asked with (its bits moved in
    # between, a race with its event thread), and the one worker holding the image
    replica = IndexReplica(redis_client, key_namespace, index=KvIndex(redis_client, key_namespace))
    router = _router(redis_client, key_namespace, replica=replica)
    publisher = KvEventPublisher(redis_client, key_namespace, index=KvIndex(redis_client, key_namespace))
    tokens = _tokens(7, 1_000)
    hashes = block_hashes(tokens, BS)
    publisher.publish([KvEvent("stored", name, tuple(hashes[:20])) for name in FLEET])
    publisher.publish([KvEvent("stored", "w137", tuple(hashes[:50]))])
    replica.sync()
    asked = []
    monkeypatch.setattr(replica, "candidates", lambda *args: asked.append(args) and None)

    # when
    decision = router.route(hashes, len(tokens), BS, FLEET, RoutingPolicy(), rng=random.Random(1))

    # then: asked, refused, and decided from Redis's index all the same
    assert len(asked) == 1
    assert decision.worker == "w137" and decision.overlap == 50 == decision.best_overlap
