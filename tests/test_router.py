"""The KV-aware router on the real Redis: cache affinity against load, fairness, and its logs."""

from __future__ import annotations

import asyncio
import logging
import math
import random
import re
import threading
import time
from collections import Counter
from typing import Any

import pytest
import redis
import redis.asyncio

from routing.contract.kv_events import KvEvent
from routing.kv.affinity import SessionAffinity
from routing.kv.decision import (
    AllWorkersBusy,
    NoEligibleWorker,
    RequestsWaiting,
    RoutingDecision,
    StaleWorkers,
    WorkerReport,
)
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.kv.lease import RequestLease
from routing.kv.load import LoadTracker
from routing.kv.router import KvRouter
from routing.kv.selection import RoutingPolicy
from routing.prompt.hashing import MediaPlacement, block_hashes
from routing.state.redis_direct import AsyncDirectCommands

BS = 16
WORKERS = ["gpu0", "gpu1", "gpu2", "gpu3"]
SCOPE = "3f2a9c0d4b5e6f708192a3b4c5d6e7f8"


class CountingConnection(redis.connection.Connection):
    """A real connection that counts its writes: a pipeline is one write, one round trip."""

    writes = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).writes += 1
        super().send_packed_command(command, check_health)


def _router(client: redis.Redis, namespace: str, **kwargs: Any) -> KvRouter:
    return KvRouter(
        client,
        namespace,
        index=KvIndex(client, namespace),
        load=LoadTracker(client, namespace),
        affinity=SessionAffinity(client, namespace),
        **kwargs,
    )


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


@pytest.fixture
def router(redis_client: redis.Redis, key_namespace: str) -> KvRouter:
    return _router(redis_client, key_namespace)


@pytest.fixture
def publisher(redis_client: redis.Redis, key_namespace: str) -> KvEventPublisher:
    return KvEventPublisher(redis_client, key_namespace, index=KvIndex(redis_client, key_namespace))


def test_a_repeated_request_goes_back_to_the_worker_holding_its_blocks_with_more_overlap(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: a 1,000-token prompt with one image, on idle workers with empty caches
    tokens = _tokens(1, 1_000)
    hashes = block_hashes(tokens, BS, [MediaPlacement(0xA11CE, 40, 256)])
    rng = random.Random(1)

    # when: the first request is served, and its worker publishes the blocks it cached
    lease = router.decide("r1", hashes, len(tokens), BS, WORKERS, RoutingPolicy(), rng=rng)
    first = lease.decision
    publisher.publish([KvEvent("stored", first.worker, tuple(hashes))])
    lease.release("done")
    second = router.route(hashes, len(tokens), BS, WORKERS, RoutingPolicy(), rng=rng)

    # then
    assert (first.overlap, first.total_blocks, first.reason) == (0, 63, "cost")
    assert second.worker == first.worker
    assert second.overlap == 62 > first.overlap  # 62 full blocks of ceil(1000/16) = 63


def test_a_busy_worker_with_the_best_overlap_loses_to_an_idle_one_when_the_cost_says_so(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: gpu0 holds 100 of the prompt's 125 blocks
    tokens = _tokens(2, 2_000)
    hashes = block_hashes(tokens, BS)
    publisher.publish([KvEvent("stored", "gpu0", tuple(hashes[:100]))])
    pair = ["gpu0", "gpu1"]

    # when gpu0 is lightly loaded: cost 0 = (160+2000)/16-100 + (10+25) = 70 < gpu1's 250
    dynamo = RoutingPolicy(prefill_load_scale=1.0)  # the figures below are Dynamo's weights
    router.load.add("gpu0", "light", prefill_tokens=160, blocks=10)
    light = router.route(hashes, 2_000, BS, pair, dynamo)
    # when gpu0 has 3,200 prefill tokens and 200 blocks queued: (3200+2000)/16-100 + 225 = 450
    router.load.add("gpu0", "heavy", prefill_tokens=3_040, blocks=190)
    heavy = router.route(hashes, 2_000, BS, pair, dynamo)

    # then
    assert (light.worker, light.overlap) == ("gpu0", 100)
    assert {s.worker: s.cost for s in light.scores} == {"gpu0": 70.0, "gpu1": 250.0}
    assert (heavy.worker, heavy.overlap, heavy.reason) == ("gpu1", 0, "cost")
    assert {s.worker: s.cost for s in heavy.scores} == {"gpu0": 450.0, "gpu1": 250.0}


def test_a_shared_system_prompt_does_not_pile_every_request_onto_one_worker(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: every worker holds the 512-token system prompt
    system = _tokens(3, 512)
    system_hashes = block_hashes(system, BS)
    publisher.publish([KvEvent("stored", w, tuple(system_hashes)) for w in WORKERS])
    rng = random.Random(3)
    in_flight: list[tuple[str, str, bool]] = []  # (worker, request id, decoding)
    sent: Counter[str] = Counter()

    # when: 300 requests with distinct suffixes arrive while earlier ones are still running
    for i in range(300):
        tokens = system + _tokens(1_000 + i, rng.randrange(200, 1_200))
        hashes = block_hashes(tokens, BS)
        decision = router.decide(f"r{i}", hashes, len(tokens), BS, WORKERS, RoutingPolicy(), rng=rng).decision
        publisher.publish([KvEvent("stored", decision.worker, tuple(hashes[decision.overlap :]))])
        sent[decision.worker] += 1
        assert decision.overlap >= len(system_hashes)
        in_flight.append((decision.worker, f"r{i}", False))
        # each step, running requests move on: first tokens come, some finish
        still = []
        for worker, request_id, decoding in in_flight:
            if not decoding and rng.random() < 0.5:
                router.load.prefill_done(worker, request_id)
                decoding = True
            if decoding and rng.random() < 0.15:
                router.load.free(worker, request_id)
            else:
                still.append((worker, request_id, decoding))
        in_flight = still

    for worker in WORKERS:  # the workers go away: their blocks leave the index with them
        router.index.purge_worker(worker)

    # then
    mean = 300 / len(WORKERS)
    assert set(sent) == set(WORKERS)
    assert max(sent.values()) / mean <= 1.5, sent


def test_two_frontend_processes_make_identical_choices_for_the_same_state(
    redis_url: str, key_namespace: str, redis_client: redis.Redis, publisher: KvEventPublisher
) -> None:
    # given: two routers on two connections (two processes), a shared cache and load state
    other_client = redis.Redis.from_url(redis_url)
    try:
        first, second = _router(redis_client, key_namespace), _router(other_client, key_namespace)
        prompts = [_tokens(10 + i, 400 + 100 * i) for i in range(6)]
        for i, tokens in enumerate(prompts[:3]):
            publisher.publish([KvEvent("stored", WORKERS[i], tuple(block_hashes(tokens, BS)[: 10 + 5 * i]))])
        first.load.add("gpu1", "busy", 800, 60)
        rng_a, rng_b = random.Random(42), random.Random(42)

        # when: the same requests, including ties (prompts nobody holds)
        choices_a, choices_b = [], []
        for tokens in prompts:
            hashes = block_hashes(tokens, BS)
            choices_a.append(first.route(hashes, len(tokens), BS, WORKERS, RoutingPolicy(), rng=rng_a))
            choices_b.append(second.route(hashes, len(tokens), BS, WORKERS, RoutingPolicy(), rng=rng_b))

        # then
        assert [(d.worker, d.overlap, d.scores) for d in choices_a] == [
            (d.worker, d.overlap, d.scores) for d in choices_b
        ]
        assert choices_a[0].worker == "gpu0" and choices_a[2].worker == "gpu2"
    finally:
        other_client.close()


def test_each_decision_logs_its_candidates_and_the_routing_line(
    router: KvRouter, publisher: KvEventPublisher, caplog: pytest.LogCaptureFixture
) -> None:
    # given: an exact repeat of a 100-token prompt (6 full blocks of ceil(100/16) = 7)
    hashes = block_hashes(_tokens(4, 100), BS)
    publisher.publish([KvEvent("stored", "gpu2", tuple(hashes))])

    # when
    with caplog.at_level(logging.DEBUG, logger="routing"):
        router.route(hashes, 100, BS, WORKERS, RoutingPolicy())

    # then
    lines = [r.getMessage() for r in caplog.records if r.name == "routing"]
    assert lines[-1] == (
        "[ROUTING] Best: worker_gpu2 with 6/7 blocks overlap (cost; best eligible overlap 6, given up 0)"
    )
    assert len(lines) == len(WORKERS) + 1
    scale = re.escape(f"{RoutingPolicy().prefill_load_scale:.3f}")
    for worker, line in zip(WORKERS, lines, strict=False):
        assert re.fullmatch(
            rf"\[ROUTING\] Formula for worker_{worker}: cost=[\d.]+ = {scale} \* prefill_blocks [\d.]+"
            r" \+ decode_blocks [\d.]+ \(overlap \d/7\)",
            line,
        ), line


def test_temperature_spreads_choices_by_cost_with_a_seeded_rng(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: gpu0 holds the whole prompt, so it is cheapest; the others tie at the highest cost
    tokens = _tokens(5, 320)
    hashes = block_hashes(tokens, BS)
    publisher.publish([KvEvent("stored", "gpu0", tuple(hashes))])
    rng = random.Random(9)

    # when
    greedy = {router.route(hashes, 320, BS, WORKERS, RoutingPolicy(), rng=rng).worker for _ in range(20)}
    picks = Counter(
        router.route(hashes, 320, BS, WORKERS, RoutingPolicy(temperature=1.0), rng=rng).worker
        for _ in range(600)
    )

    # then: p(gpu0) = 1 / (1 + 3/e) ~ 0.475, the rest ~ 0.175 each
    assert greedy == {"gpu0"}
    assert 0.40 < picks["gpu0"] / 600 < 0.55
    assert all(0.11 < picks[w] / 600 < 0.24 for w in WORKERS[1:])


def test_a_session_goes_back_to_its_last_worker_while_its_cost_stays_within_the_bound(
    router: KvRouter,
) -> None:
    # given: a session's first request, decided and reserved on some worker
    hashes = block_hashes(_tokens(6, 320), BS)
    first = router.decide(
        "s1", hashes, 320, BS, WORKERS, RoutingPolicy(), session_key=SCOPE, rng=random.Random(1)
    ).decision
    others = [w for w in WORKERS if w != first.worker]

    # when: its worker carries that request (its predicted blocks offset it), then much more
    near = router.route(hashes, 320, BS, WORKERS, RoutingPolicy(), session_key=SCOPE)
    off = router.route(hashes, 320, BS, WORKERS, RoutingPolicy(), session_key=SCOPE, affinity_enabled=False)
    router.load.add(first.worker, "burden", 5_000, 400)
    far = router.route(hashes, 320, BS, WORKERS, RoutingPolicy(), session_key=SCOPE)
    gone = router.route(hashes, 320, BS, others, RoutingPolicy(), session_key=SCOPE)

    # then: within the bound the session stays; with 5,000 tokens queued there it moves
    assert (near.worker, near.reason) == (first.worker, "affinity")
    assert off.reason == "cost"
    assert far.worker in others and far.reason == "cost"
    assert gone.worker in others and gone.reason == "cost"


def test_affinity_gives_way_when_another_worker_holds_a_longer_prefix(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: the session last went to gpu0 (which holds 2 blocks); gpu1 holds 12 of 20
    hashes = block_hashes(_tokens(12, 320), BS)
    router.decide("s1", hashes[:1], 16, BS, ["gpu0"], RoutingPolicy(), session_key=SCOPE).release("done")
    publisher.publish(
        [KvEvent("stored", "gpu0", tuple(hashes[:2])), KvEvent("stored", "gpu1", tuple(hashes[:12]))]
    )
    lenient = RoutingPolicy(affinity_cost_slack=10.0, affinity_max_overlap_lead=20)

    # when: the same session asks about the longer prompt
    strict = router.route(hashes, 320, BS, ["gpu0", "gpu1"], RoutingPolicy(), session_key=SCOPE)
    loose = router.route(hashes, 320, BS, ["gpu0", "gpu1"], lenient, session_key=SCOPE)

    # then: 10 blocks more than the 2-block bound: the prefix wins; with a huge bound, the session
    assert (strict.worker, strict.reason, strict.overlap_given_up) == ("gpu1", "cost", 0)
    assert (loose.worker, loose.reason, loose.overlap_given_up) == ("gpu0", "affinity", 10)


def test_a_worker_past_the_load_bound_gives_way_though_it_holds_the_prefix(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: gpu1 holds a shared 240-token prefix (a system prompt) of a 320-token prompt and gpu0
    # nothing; a request in flight on gpu1 with 80 tokens still to prefill, as many as this one's
    # own (prompts of one size wait for each other even when the engine takes the shortest first)
    hashes = block_hashes(_tokens(13, 320), BS)
    publisher.publish([KvEvent("stored", "gpu1", tuple(hashes[:15]))])
    pair = ["gpu0", "gpu1"]
    router.load.add("gpu1", "in-flight-1", 80, 20)

    # when / then: a second still joins it (one ahead of the idle worker: within the gap of 2)
    second = router.route(hashes, 320, BS, pair, RoutingPolicy())
    assert (second.worker, second.reason) == ("gpu1", "cost")

    # when: a second request is in flight there, and a third is decided with and without the bound
    router.load.add("gpu1", "in-flight-2", 80, 20)
    bounded = router.route(hashes, 320, BS, pair, RoutingPolicy())
    unbounded = router.route(hashes, 320, BS, pair, RoutingPolicy(load_bound_gap=0))

    # then: two ahead, the idle worker takes it (its full prefill costs less than gpu1's cost
    # plus the 160 tokens queued there), and the decision says what the bound gave up; without
    # the bound, the prefix outweighs the queue
    assert (bounded.worker, bounded.reason, bounded.overlap_given_up) == ("gpu0", "load-bound", 15)
    assert (unbounded.worker, unbounded.reason) == ("gpu1", "cost")

    # and once those two are decoding (nothing queued), the prefix's worker keeps the prompt
    for n in (1, 2):
        router.load.prefill_done("gpu1", f"in-flight-{n}")
    assert router.route(hashes, 320, BS, pair, RoutingPolicy()).worker == "gpu1"


def _cached_prompt_behind_two_cold_ones(router: KvRouter, publisher: KvEventPublisher) -> list[int]:
    """gpu1 holds 19 of a 20-block prompt's blocks (16 tokens left to compute) and has two cold
    prompts queued, 100 tokens each; gpu0 is idle and holds nothing. The prompt's hashes."""
    hashes = block_hashes(_tokens(16, 320), BS)
    publisher.publish([KvEvent("stored", "gpu1", tuple(hashes[:19]))])
    for n in range(2):
        router.load.add("gpu1", f"cold-{n}", 100, 20)
    return hashes


def test_the_load_bound_keeps_a_short_prompt_where_shortest_first_workers_compute_it_first(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: a prompt gpu1 nearly holds, behind two cold prompts there; gpu0 idle
    hashes = _cached_prompt_behind_two_cold_ones(router, publisher)
    pair = ["gpu0", "gpu1"]

    # when: decided for workers that compute prompts in arrival order, and for shortest-first ones
    in_order = router.route(hashes, 320, BS, pair, RoutingPolicy(shortest_first_queues=False))
    shortest_first = router.route(hashes, 320, BS, pair, RoutingPolicy())

    # then: in arrival order it would wait for the 200 queued tokens, so the bound sends it to
    # the idle worker; shortest first, its 16 tokens go before each of them, so it waits for at
    # most 32 and keeps its 19 cached blocks
    assert (in_order.worker, in_order.reason) == ("gpu0", "load-bound")
    assert (shortest_first.worker, shortest_first.reason, shortest_first.overlap) == ("gpu1", "cost", 19)


def test_the_load_bound_charges_each_worker_the_wait_its_own_schedule_makes(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: the same queue, in a fleet whose heartbeats say each engine's schedule
    hashes = _cached_prompt_behind_two_cold_ones(router, publisher)
    pair = ["gpu0", "gpu1"]
    says = {
        policy: {"gpu0": WorkerReport(shortest_first=True), "gpu1": WorkerReport(shortest_first=policy)}
        for policy in (True, False)
    }

    # when: the frontend assumes the opposite of what gpu1 says, either way
    said_shortest_first = router.route(
        hashes, 320, BS, pair, RoutingPolicy(shortest_first_queues=False), reports=says[True]
    )
    said_in_order = router.route(hashes, 320, BS, pair, RoutingPolicy(), reports=says[False])
    unsaid = router.route(hashes, 320, BS, pair, RoutingPolicy(), reports={"gpu0": WorkerReport()})

    # then: gpu1's own word counts: shortest first it keeps its 19 cached blocks, in arrival
    # order the bound sends the prompt to the idle worker; a worker that says nothing is taken
    # to schedule as the frontend assumes
    assert (said_shortest_first.worker, said_shortest_first.reason) == ("gpu1", "cost")
    assert (said_in_order.worker, said_in_order.reason) == ("gpu0", "load-bound")
    assert (unsaid.worker, unsaid.reason) == ("gpu1", "cost")


def test_the_load_bound_never_gives_up_a_long_cached_prefix_for_a_short_queue(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: gpu1 holds 90 of a 100-block prompt and has four prompts queued, 100 tokens each;
    # gpu0 is idle and holds nothing
    hashes = block_hashes(_tokens(15, 1600), BS)
    publisher.publish([KvEvent("stored", "gpu1", tuple(hashes[:90]))])
    for n in range(4):
        router.load.add("gpu1", f"short-{n}", 100, 10)

    # when / then: giving up 1,440 cached tokens to skip 400 queued would cost the request more
    # than the queue does: it stays
    kept = router.route(hashes, 1600, BS, ["gpu0", "gpu1"], RoutingPolicy())
    assert (kept.worker, kept.reason, kept.overlap) == ("gpu1", "cost", 90)

    # when: the four queued are 250 tokens each, 1,000 in all
    for n in range(4):
        router.load.add("gpu1", f"short-{n}", 250, 10)
    passed = router.route(hashes, 1600, BS, ["gpu0", "gpu1"], RoutingPolicy())

    # then: the cost alone would still wait there, but the full prefill elsewhere costs less than
    # that wait plus the request's own: the bound sends it to the idle worker
    assert (passed.worker, passed.reason) == ("gpu0", "load-bound")


def test_a_busy_fleet_is_bounded_by_the_ratio_as_well_as_the_gap(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: gpu0 holds the prompt but its last block (16 tokens to compute); 8 requests in flight
    # on it (each with 25 tokens to prefill), 6 on gpu1
    hashes = block_hashes(_tokens(14, 320), BS)
    publisher.publish([KvEvent("stored", "gpu0", tuple(hashes[:19]))])
    for n in range(8):
        router.load.add("gpu0", f"a{n}", 25, 20)
    for n in range(6):
        router.load.add("gpu1", f"b{n}", 0, 20)
    policy, pair = RoutingPolicy(load_bound_gap=2, load_bound_ratio=1.5), ["gpu0", "gpu1"]

    # when / then: two ahead but under 1.5 x, gpu0 stays a candidate and its prefix wins
    assert router.route(hashes, 320, BS, pair, policy).worker == "gpu0"
    # 9 against 6: past both the gap and the ratio, gpu1 takes it
    router.load.add("gpu0", "a8", 25, 20)
    decision = router.route(hashes, 320, BS, pair, policy)
    assert (decision.worker, decision.reason) == ("gpu1", "load-bound")


def test_a_load_bound_ratio_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="load_bound_ratio"):
        RoutingPolicy(load_bound_ratio=0.5)


def test_dispatch_counts_the_request_and_a_single_worker_is_the_only_candidate(router: KvRouter) -> None:
    hashes = block_hashes(_tokens(7, 330), BS)
    lease = router.decide("r1", hashes, 330, BS, ["gpu3"], RoutingPolicy())
    assert lease.decision.reason == "only-candidate"
    load = router.load.snapshot(["gpu3"])["gpu3"]
    assert (load.active_prefill_tokens, load.active_decode_blocks, load.active_requests) == (330, 21, 1)


def test_an_approximate_worker_gets_credit_for_what_was_routed_to_it(router: KvRouter) -> None:
    # given: workers that publish no events
    hashes = block_hashes(_tokens(8, 640), BS)
    lease = router.decide("r1", hashes, 640, BS, WORKERS, RoutingPolicy(), approximate_workers=set(WORKERS))
    lease.release("done")
    first = lease.decision

    # when
    second = router.route(hashes, 640, BS, WORKERS, RoutingPolicy(), approximate_workers=set(WORKERS))

    # then
    assert (first.overlap, second.worker, second.overlap) == (0, first.worker, 40)


def test_predicted_blocks_credit_an_event_publishing_worker_only_until_their_ttl(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given: a router whose predicted blocks last 1 s, and one that predicts nothing
    router = _router(redis_client, key_namespace, predicted_ttl_s=1.0)
    hashes = block_hashes(_tokens(8, 640), BS)
    router.decide("r1", hashes, 640, BS, ["gpu0"], RoutingPolicy())

    # when / then: a sibling right away sees the prompt as cached there; later it does not
    sibling = router.route(hashes, 640, BS, ["gpu0", "gpu1"], RoutingPolicy())
    assert {s.worker: s.overlap for s in sibling.scores} == {"gpu0": 40, "gpu1": 0}
    time.sleep(1.2)
    assert router.route(hashes, 640, BS, ["gpu0"], RoutingPolicy()).overlap == 0
    blind = _router(redis_client, key_namespace, predicted_ttl_s=0)
    blind.decide("r2", hashes, 640, BS, ["gpu1"], RoutingPolicy())
    assert blind.route(hashes, 640, BS, ["gpu1"], RoutingPolicy()).overlap == 0


@pytest.mark.parametrize("shared_blocks", [21, 32, 37, 40, 50])
def test_a_sibling_is_credited_with_exactly_the_blocks_it_shares_with_a_predicted_prompt(
    redis_client: redis.Redis, key_namespace: str, shared_blocks: int
) -> None:
    # given: a 40-block prompt sent to gpu0 (marks every PREDICTED_STRIDE blocks, each carrying
    # the blocks up to the next), and a sibling of 50 blocks sharing its first `shared_blocks`
    # (between two marks, on one, past the prompt's end)
    router = _router(redis_client, key_namespace, predicted_ttl_s=30.0)
    prompt = _tokens(8, 40 * BS)
    router.decide("r1", block_hashes(prompt, BS), len(prompt), BS, ["gpu0"], RoutingPolicy())
    sibling = (prompt + _tokens(9, 10 * BS))[: shared_blocks * BS] + _tokens(10, 50 * BS)
    sibling = sibling[: 50 * BS]

    # when
    decision = router.route(block_hashes(sibling, BS), len(sibling), BS, ["gpu0", "gpu1"], RoutingPolicy())

    # then: credited to the exact block, never past what the prompt held
    assert {s.worker: s.overlap for s in decision.scores} == {"gpu0": min(shared_blocks, 40), "gpu1": 0}


@pytest.mark.usefixtures("redis_client")  # removes what the test wrote
def test_decisions_in_the_same_instant_see_each_others_reservations(
    redis_url: str, key_namespace: str
) -> None:
    # given: 8 threads, each with its own connection (as 8 frontend processes), 8 idle workers
    workers = [f"w{i}" for i in range(8)]
    barrier = threading.Barrier(8)
    chosen: list[str] = []

    def decide(i: int) -> None:
        client = redis.Redis.from_url(redis_url)
        try:
            router = _router(client, key_namespace)
            hashes = block_hashes(_tokens(100 + i, 480), BS)
            barrier.wait()
            chosen.append(router.decide(f"r{i}", hashes, 480, BS, workers, RoutingPolicy()).worker)
        finally:
            client.close()

    # when: each decides a request with its own prefix at the same instant
    threads = [threading.Thread(target=decide, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    # then: one request per worker
    assert sorted(chosen) == workers


def test_busy_workers_are_no_candidates_and_all_busy_reserves_nothing(router: KvRouter) -> None:
    # given: at most 2 requests per worker; gpu0 has 2 reserved, gpu1 reports 3 itself
    policy = RoutingPolicy(busy_max_requests=2)
    hashes = block_hashes(_tokens(13, 160), BS)
    for rid in ("a", "b"):
        router.decide(rid, hashes, 160, BS, ["gpu0"], RoutingPolicy())
    reports = {"gpu1": WorkerReport(running_and_waiting=3), "gpu2": WorkerReport(running_and_waiting=1)}

    # when / then: only gpu2 is a candidate; its own report (1) and one reservation merge to 1, not 2
    first = router.decide("c", hashes, 160, BS, ["gpu0", "gpu1", "gpu2"], policy, reports=reports)
    assert (first.worker, first.decision.busy) == ("gpu2", ("gpu0", "gpu1"))
    reports["gpu2"] = WorkerReport(running_and_waiting=1)  # the report counts the same request
    with pytest.raises(AllWorkersBusy):
        router.decide("d", hashes, 160, BS, ["gpu0", "gpu1"], policy, reports=reports)
    second = router.decide("d", hashes, 160, BS, ["gpu0", "gpu1", "gpu2"], policy, reports=reports)
    assert second.worker == "gpu2"
    with pytest.raises(AllWorkersBusy):
        router.decide("e", hashes, 160, BS, ["gpu0", "gpu1", "gpu2"], policy, reports=reports)
    assert router.load.snapshot(["gpu2"])["gpu2"].active_requests == 2


def test_a_decision_asked_for_no_scores_holds_the_chosen_workers_alone_and_names_the_busy(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: gpu1 holds the prompt, gpu0 reports a full queue, gpu2 and gpu3 are idle
    policy = RoutingPolicy(busy_max_requests=2)
    tokens = _tokens(22, 400)
    hashes = block_hashes(tokens, BS)
    publisher.publish([KvEvent("stored", "gpu1", tuple(hashes[:10]))])
    reports = {"gpu0": WorkerReport(running_and_waiting=2)}
    previewed = router.route(hashes, len(tokens), BS, WORKERS, policy, reports=reports, rng=random.Random(3))

    # when: the same decision, reserving, asked for no scores
    lease = router.decide(
        "r1", hashes, len(tokens), BS, WORKERS, policy, reports=reports, rng=random.Random(3), scores=False
    )

    # then: the same choice, the chosen worker's score alone, the busy worker still named
    decision = lease.decision
    assert (decision.worker, decision.overlap, decision.best_overlap) == ("gpu1", 10, 10)
    assert (decision.reason, decision.busy) == (previewed.reason, previewed.busy) == ("cost", ("gpu0",))
    assert list(decision.scores) == [s for s in previewed.scores if s.worker == "gpu1"]
    assert len(previewed.scores) == len(WORKERS) - 1
    # and the reservation is the one a full decision makes
    assert router.load.snapshot(["gpu1"])["gpu1"].active_requests == 1
    lease.release("done")
    # and every worker busy is still told apart from none eligible
    with pytest.raises(AllWorkersBusy) as busy:
        router.decide("r2", hashes, len(tokens), BS, ["gpu0"], policy, reports=reports, scores=False)
    assert busy.value.workers == ("gpu0",)


@pytest.mark.parametrize("fleet", [WORKERS, tuple(f"w{i:03d}" for i in range(100))])
def test_a_decision_conditional_on_a_generation_that_moved_reserves_nothing(
    router: KvRouter, redis_client: redis.Redis, key_namespace: str, fleet: tuple[str, ...]
) -> None:
    # given: the workers were read under generation "g1" (a whole fleet, and one past the
    # candidates' threshold, whose decision reads candidates first)
    key = f"{key_namespace}workers:generation"
    redis_client.set(key, b"g1")
    hashes = block_hashes(_tokens(16, 160), BS)
    first = router.decide("a", hashes, 160, BS, list(fleet), RoutingPolicy(), only_if=(key, b"g1"))
    assert first.worker in fleet

    # when: the rows move on (an operator disabled a worker) before the next decision
    redis_client.set(key, b"g2")

    # then: it refuses, and nothing of it is reserved; unconditional, it decides as before
    with pytest.raises(StaleWorkers):
        router.decide("b", hashes, 160, BS, list(fleet), RoutingPolicy(), only_if=(key, b"g1"))
    redis_client.delete(key)
    with pytest.raises(StaleWorkers):  # a generation gone (Redis restarted empty) moved too
        router.decide("b", hashes, 160, BS, list(fleet), RoutingPolicy(), only_if=(key, b"g1"))
    loads = router.load.snapshot(list(fleet))
    assert sum(load.active_requests for load in loads.values()) == 1
    assert router.decide("b", hashes, 160, BS, list(fleet), RoutingPolicy()).worker in fleet


@pytest.mark.parametrize("fleet", [WORKERS, tuple(f"w{i:03d}" for i in range(100))])
def test_a_decision_made_unless_requests_wait_reserves_nothing_while_they_do(
    router: KvRouter, redis_client: redis.Redis, key_namespace: str, fleet: tuple[str, ...]
) -> None:
    # given: the key that exists while the model's requests wait in the admission queue, absent
    key = f"{key_namespace}admq:bands:demo"
    hashes = block_hashes(_tokens(17, 160), BS)
    first = router.decide("a", hashes, 160, BS, list(fleet), RoutingPolicy(), unless_waiting=key)
    assert first.worker in fleet

    # when: requests start waiting (a small fleet, and one past the candidates' threshold)
    redis_client.zadd(key, {"0": 0})

    # then: it refuses, and nothing of it is reserved; without the condition it decides as before
    with pytest.raises(RequestsWaiting):
        router.decide("b", hashes, 160, BS, list(fleet), RoutingPolicy(), unless_waiting=key)
    loads = router.load.snapshot(list(fleet))
    assert sum(load.active_requests for load in loads.values()) == 1
    assert router.decide("b", hashes, 160, BS, list(fleet), RoutingPolicy()).worker in fleet
    redis_client.delete(key)


def test_a_worker_past_its_kv_fraction_is_busy(router: KvRouter) -> None:
    policy = RoutingPolicy(busy_kv_fraction=0.5)
    hashes = block_hashes(_tokens(14, 320), BS)  # 20 blocks
    reports = {w: WorkerReport(capacity_blocks=40) for w in ("gpu0", "gpu1")}
    reports["gpu1"] = WorkerReport(capacity_blocks=40, kv_used_blocks=30)  # the engine says 30 in use
    first = router.decide("a", hashes, 320, BS, ["gpu0", "gpu1"], policy, reports=reports)
    assert (first.worker, first.decision.busy) == ("gpu0", ("gpu1",))
    with pytest.raises(AllWorkersBusy):  # gpu0 now holds 20 of 40 blocks for the request
        router.decide("b", hashes, 320, BS, ["gpu0", "gpu1"], policy, reports=reports)


def test_round_robin_reserves_too_and_reports_the_overlap_it_gave_up(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    hashes = block_hashes(_tokens(15, 320), BS)
    publisher.publish([KvEvent("stored", "gpu0", tuple(hashes))])
    picks = [
        router.decide(f"r{i}", hashes, 320, BS, WORKERS, RoutingPolicy(), mode="round_robin")
        for i in range(8)
    ]
    assert [lease.worker for lease in picks] == WORKERS[1:] + WORKERS + WORKERS[:1]
    assert all(lease.decision.best_overlap == 20 for lease in picks)
    assert [lease.decision.overlap_given_up for lease in picks[:4]] == [20, 20, 20, 0]
    assert router.load.snapshot(WORKERS)["gpu1"].active_requests == 2


def test_a_lease_frees_its_load_exactly_once_and_runs_its_callbacks_once(router: KvRouter) -> None:
    hashes = block_hashes(_tokens(16, 320), BS)
    lease = router.decide("r1", hashes, 320, BS, ["gpu0"], RoutingPolicy())
    released: list[str] = []
    lease.on_release(lambda done: released.append(done.outcome or ""))
    assert lease.first_token() and not lease.first_token()
    assert router.load.snapshot(["gpu0"])["gpu0"] == (0, 20, 1)
    results = []
    threads = [threading.Thread(target=lambda: results.append(lease.release("done"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False, False, False, True]
    assert released == ["done"] and router.load.snapshot(["gpu0"])["gpu0"] == (0, 0, 0)
    lease.on_release(lambda done: released.append("late"))  # already released: runs at once
    assert released == ["done", "late"]


async def test_an_event_loop_moves_and_renews_a_lease_on_its_own_connections(
    router: KvRouter, redis_url: str
) -> None:
    # given a reservation that expires in 0.5 s unless renewed, followed from an event loop
    hashes = block_hashes(_tokens(19, 320), BS)
    lease = router.decide("r1", hashes, 320, BS, ["gpu0"], RoutingPolicy(), reservation_ttl_s=0.5)
    lines = AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(redis_url))

    # when its first token is read, then the lease leaves prefill at once, once
    before = router.load.snapshot(["gpu0"])["gpu0"]
    assert lease.first_token_read() and not lease.first_token_read()
    assert router.load.snapshot(["gpu0"])["gpu0"] == before != (0, 20, 1)

    # and its load moves to decode with the loop's next round trip, which brings back the replies
    # of the commands sent along
    assert await lease.amove_to_decode(lines, along=(("ECHO", "next read"),)) == [b"next read"]
    assert router.load.snapshot(["gpu0"])["gpu0"] == (0, 20, 1)

    # and while the loop renews it, a sweep past its first expiry leaves it
    for _ in range(4):
        await asyncio.sleep(0.2)
        assert await lease.arenew(lines, 0.5)
    router.load.sweep()
    assert router.load.snapshot(["gpu0"])["gpu0"].active_requests == 1
    assert lease.release("done") and not await lease.arenew(lines, 0.5)

    # and a move asked for after the release sends only what goes along
    assert await lease.amove_to_decode(lines, along=(("ECHO", "late"),)) == [b"late"]
    assert router.load.snapshot(["gpu0"])["gpu0"] == (0, 0, 0)
    await lines.close()


async def test_a_lease_released_on_the_loop_frees_its_load_and_awaits_each_callback_once(
    router: KvRouter, redis_url: str
) -> None:
    # given a lease with a plain and a coroutine callback riding on it
    hashes = block_hashes(_tokens(23, 320), BS)
    lease = router.decide("r1", hashes, 320, BS, ["gpu0"], RoutingPolicy())
    lines = AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(redis_url))
    ran: list[str] = []

    async def later(released: RequestLease) -> None:
        await asyncio.sleep(0)
        ran.append(f"awaited {released.outcome}")

    lease.on_release(lambda released: ran.append(f"plain {released.outcome}"))
    lease.on_release(later)

    # then the thread's release refuses it (it could not await the coroutine), changing nothing
    with pytest.raises(TypeError, match="arelease"):
        lease.release("done")
    assert not lease.released and router.load.snapshot(["gpu0"])["gpu0"].active_requests == 1

    # when it is released on the loop, twice
    assert await lease.arelease(lines, "done") and not await lease.arelease(lines, "done")

    # then the load is freed and each callback ran once, in order, the coroutine awaited
    assert router.load.snapshot(["gpu0"])["gpu0"] == (0, 0, 0)
    assert ran == ["plain done", "awaited done"]
    with pytest.raises(TypeError):  # too late to ride on it: nobody would await it
        lease.on_release(later)
    await lines.close()


def test_a_lease_moves_to_another_worker_before_its_first_token(router: KvRouter) -> None:
    hashes = block_hashes(_tokens(17, 320), BS)
    lease = router.decide("r1", hashes, 320, BS, ["gpu0"], RoutingPolicy())
    moved = router.decide("r1", hashes, 320, BS, ["gpu1"], RoutingPolicy())
    lease.reassign(moved.decision, instance="i2")
    assert (lease.worker, lease.instance) == ("gpu1", "i2")
    assert router.load.snapshot(["gpu0", "gpu1"]) == {"gpu0": (0, 0, 0), "gpu1": (320, 20, 1)}
    lease.release("done")
    assert router.load.snapshot(["gpu1"])["gpu1"] == (0, 0, 0)


@pytest.mark.usefixtures("redis_client")  # removes what the test wrote
def test_a_decision_reads_redis_in_one_round_trip(redis_url: str, key_namespace: str) -> None:
    pool = redis.ConnectionPool.from_url(redis_url, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    try:
        router = _router(client, key_namespace)
        hashes = block_hashes(_tokens(9, 2_000), BS)
        CountingConnection.writes = 0
        decision = router.route(
            hashes, 2_000, BS, [f"w{i}" for i in range(64)], RoutingPolicy(), session_key=SCOPE
        )
        assert CountingConnection.writes == 1
        assert len(decision.scores) == 64
        CountingConnection.writes = 0
        lease = router.decide("r1", hashes, 2_000, BS, [f"w{i}" for i in range(64)], RoutingPolicy())
        assert CountingConnection.writes == 1  # decided and reserved in the same round trip
        assert router.load.snapshot([lease.worker])[lease.worker].active_requests == 1
    finally:
        client.close()
        pool.disconnect()


def test_no_eligible_worker_is_an_error(router: KvRouter) -> None:
    with pytest.raises(NoEligibleWorker):
        router.route([1, 2], 32, BS, [], RoutingPolicy())


def test_raw_session_ids_are_refused_as_affinity_keys(router: KvRouter) -> None:
    with pytest.raises(ValueError):
        router.route([1], 16, BS, WORKERS, RoutingPolicy(), session_key="user-session-42")


def test_a_router_recovers_when_redis_forgot_its_scripts(
    router: KvRouter, publisher: KvEventPublisher
) -> None:
    # given: the router's script SHA is unknown to Redis, as after a restart of Redis
    hashes = block_hashes(_tokens(11, 160), BS)
    publisher.publish([KvEvent("stored", "gpu1", tuple(hashes))])
    router._decision.sha = "0" * 40

    # when
    decision = router.route(hashes, 160, BS, WORKERS, RoutingPolicy())

    # then
    assert (decision.worker, decision.overlap) == ("gpu1", 10)


def test_a_reservation_lives_only_while_its_frontend_renews_it(router: KvRouter) -> None:
    # given: two reservations that expire in 0.5 s unless renewed
    hashes = block_hashes(_tokens(18, 320), BS)
    kept = router.decide("kept", hashes, 320, BS, ["gpu0"], RoutingPolicy(), reservation_ttl_s=0.5)
    router.decide("orphan", hashes, 320, BS, ["gpu0"], RoutingPolicy(), reservation_ttl_s=0.5)

    # when: only one is renewed (its frontend is alive), and a worker sweeps after the TTL
    for _ in range(4):
        time.sleep(0.2)
        assert kept.renew(0.5)
    router.load.sweep()

    # then: the orphan's load is gone, the followed request's is not
    assert router.load.snapshot(["gpu0"])["gpu0"].active_requests == 1
    assert kept.release("done") and router.load.snapshot(["gpu0"])["gpu0"].active_requests == 0
    assert not kept.renew(0.5)


def _reserved_prefill_tokens(decision: RoutingDecision, worker: str, isl: int) -> float:
    """The prefill a decision counted on `worker` ahead of the request (its overlap being 0)."""
    score = next(s for s in decision.scores if s.worker == worker)
    return score.prefill_blocks * BS - isl


def test_reserved_prefill_drains_at_the_rate_each_worker_measures(router: KvRouter) -> None:
    # given: two workers whose engines prefill 1,000 tokens/s, and a 480-token prompt reserved
    # on one of them (about half a second of work)
    reports = {w: WorkerReport(prefill_tokens_per_s=1000.0) for w in ("gpu0", "gpu1")}
    started = time.monotonic()
    first = router.decide(
        "a", block_hashes(_tokens(20, 480), BS), 480, BS, ["gpu0"], RoutingPolicy(), reports=reports
    )
    probe = block_hashes(_tokens(21, 160), BS)

    # when: the router looks again at once, then after 0.25 s (each look's time since the
    # reservation bounded from above here: a loaded machine may take a while between them)
    at_once = router.route(probe, 160, BS, ["gpu0", "gpu1"], RoutingPolicy(), reports=reports)
    at_once_within = time.monotonic() - started
    time.sleep(0.25)
    later = router.route(probe, 160, BS, ["gpu0", "gpu1"], RoutingPolicy(), reports=reports)
    later_within = time.monotonic() - started
    undrained = router.route(
        probe, 160, BS, ["gpu0", "gpu1"], RoutingPolicy(prefill_drain=False), reports=reports
    )

    # then: what is left is what the worker has not had the time for at its 1,000 tokens/s (by
    # Redis's clock: 5 tokens of slack), never below 0 nor above what is reserved; without drain
    # (or without a rate) it counts in full until the first token
    def left_after(seconds: float) -> float:
        return max(0.0, 480 - 1000.0 * seconds)

    assert left_after(at_once_within) - 5 <= _reserved_prefill_tokens(at_once, "gpu0", 160) <= 480
    left = _reserved_prefill_tokens(later, "gpu0", 160)
    assert left_after(later_within) - 5 <= left <= left_after(0.25) + 5, (left, later_within)
    assert left >= 0
    assert _reserved_prefill_tokens(undrained, "gpu0", 160) == 480
    no_rate = router.route(probe, 160, BS, ["gpu0", "gpu1"], RoutingPolicy())
    assert _reserved_prefill_tokens(no_rate, "gpu0", 160) == 480
    first.release("done")


def test_rates_reach_the_script_in_order_past_a_thousand_workers_and_odd_rates_drain_nothing(
    router: KvRouter,
) -> None:
    # given: 1,100 workers (the script unpacks rates a thousand at a time), a prompt reserved on
    # the 1,050th, which reports 1,000 tokens/s; others report no rate, a NaN or one past i32
    workers = [f"gpu{i}" for i in range(1_100)]
    reports = {name: WorkerReport() for name in workers}
    reports["gpu1049"] = WorkerReport(prefill_tokens_per_s=1000.0)
    reports["gpu3"] = WorkerReport(prefill_tokens_per_s=math.nan)
    reports["gpu4"] = WorkerReport(prefill_tokens_per_s=1e12)
    # (and what a heartbeat's JSON can hold besides: an integer past any double, not a number)
    reports["gpu5"] = WorkerReport(prefill_tokens_per_s=10**400)
    reports["gpu6"] = WorkerReport(prefill_tokens_per_s="fast")  # type: ignore[arg-type]
    router.candidates_above = len(workers)  # the script over the whole fleet (its fallback)
    lease = router.decide(
        "a", block_hashes(_tokens(25, 480), BS), 480, BS, ["gpu1049"], RoutingPolicy(), reports=reports
    )
    other = block_hashes(_tokens(26, 480), BS)
    for name in ("gpu3", "gpu4", "gpu5", "gpu6"):
        router.decide(f"on-{name}", other, 480, BS, [name], RoutingPolicy(), reports=reports).release("done")

    # when: the router looks 0.25 s later
    time.sleep(0.25)
    probe = block_hashes(_tokens(27, 160), BS)
    decision = router.route(probe, 160, BS, workers, RoutingPolicy(), reports=reports)

    # then: the reservation drained at its own worker's rate, not another's, and nothing failed
    assert 0 < _reserved_prefill_tokens(decision, "gpu1049", 160) <= 480 - 200
    lease.release("done")


def test_of_two_workers_each_prefilling_a_prompt_the_one_nearer_done_gets_the_next(
    router: KvRouter,
) -> None:
    # given: equal prompts reserved on gpu0, then 0.2 s later on gpu1, both at 1,000 tokens/s
    reports = {w: WorkerReport(prefill_tokens_per_s=1000.0) for w in ("gpu0", "gpu1")}
    leases = [
        router.decide(
            "a", block_hashes(_tokens(30, 480), BS), 480, BS, ["gpu0"], RoutingPolicy(), reports=reports
        )
    ]
    time.sleep(0.2)
    leases.append(
        router.decide(
            "b", block_hashes(_tokens(31, 480), BS), 480, BS, ["gpu1"], RoutingPolicy(), reports=reports
        )
    )

    # when: a third prompt is decided over both, with drain and without
    probe = block_hashes(_tokens(32, 320), BS)
    drained = Counter(
        router.route(
            probe, 320, BS, ["gpu0", "gpu1"], RoutingPolicy(), reports=reports, rng=random.Random(seed)
        ).worker
        for seed in range(20)
    )
    counts = Counter(
        router.route(
            probe,
            320,
            BS,
            ["gpu0", "gpu1"],
            RoutingPolicy(prefill_drain=False),
            reports=reports,
            rng=random.Random(seed),
        ).worker
        for seed in range(20)
    )

    # then: with drain, gpu0 (its prompt two tenths of a second further on) wins every time;
    # without, the two reservations weigh the same and the choice is a coin toss
    assert drained == {"gpu0": 20}
    assert set(counts) == {"gpu0", "gpu1"}
    for lease in leases:
        lease.release("done")


def test_a_queued_prompt_drains_only_after_the_one_ahead_of_it(router: KvRouter) -> None:
    # given: two 480-token prompts reserved on gpu0 back to back, at 1,000 tokens/s
    reports = {"gpu0": WorkerReport(prefill_tokens_per_s=1000.0), "gpu1": WorkerReport()}
    leases = [
        router.decide(
            rid, block_hashes(_tokens(40 + n, 480), BS), 480, BS, ["gpu0"], RoutingPolicy(), reports=reports
        )
        for n, rid in enumerate(("a", "b"))
    ]
    probe = block_hashes(_tokens(42, 160), BS)

    # when: 0.25 s pass, then the first prompt's first token comes, then the second's
    time.sleep(0.25)
    queued = _reserved_prefill_tokens(
        router.route(probe, 160, BS, ["gpu0", "gpu1"], RoutingPolicy(), reports=reports), "gpu0", 160
    )
    leases[0].first_token()
    after_first = _reserved_prefill_tokens(
        router.route(probe, 160, BS, ["gpu0", "gpu1"], RoutingPolicy(), reports=reports), "gpu0", 160
    )
    estimate_while_reserved = router.load.totals("gpu0").drained_at_ms
    leases[1].first_token()

    # then: the second prompt waits behind the first (about 960 - 250 tokens left of both); what
    # is left never exceeds what is still reserved; with nothing reserved the estimate is gone
    assert 960 - 250 - 200 < queued <= 960 - 250, queued
    assert 0 < after_first <= 480
    assert estimate_while_reserved > 0
    assert router.load.totals("gpu0") == (0, 60, 2, 0)  # 2 x 30 blocks, 2 requests, no estimate
    for lease in leases:
        lease.release("done")
    assert router.load.totals("gpu0") is None
