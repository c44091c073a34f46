"""The KV-aware router on the real Redis: cache affinity against load, fairness, and its logs."""

from __future__ import annotations

import logging
import random
import re
from collections import Counter
from typing import Any

import pytest
import redis

from routing.affinity import SessionAffinity
from routing.hashing import MediaPlacement, block_hashes
from routing.index import KvIndex
from routing.kv_events import KvEvent, KvEventPublisher
from routing.load import LoadTracker
from routing.router import KvRouter, NoEligibleWorker
from routing.selection import RoutingPolicy

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
    first = router.route(hashes, len(tokens), BS, WORKERS, RoutingPolicy(), rng=rng)
    router.dispatch(first, "r1", len(tokens), BS)
    publisher.publish([KvEvent("stored", first.worker, tuple(hashes))])
    router.load.free(first.worker, "r1")
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
    router.load.add("gpu0", "light", prefill_tokens=160, blocks=10)
    light = router.route(hashes, 2_000, BS, pair, RoutingPolicy())
    # when gpu0 has 3,200 prefill tokens and 200 blocks queued: (3200+2000)/16-100 + 225 = 450
    router.load.add("gpu0", "heavy", prefill_tokens=3_040, blocks=190)
    heavy = router.route(hashes, 2_000, BS, pair, RoutingPolicy())

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
        decision = router.route(hashes, len(tokens), BS, WORKERS, RoutingPolicy(), rng=rng)
        router.dispatch(decision, f"r{i}", len(tokens), BS)
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
    assert lines[-1] == "[ROUTING] Best: worker_gpu2 with 6/7 blocks overlap"
    assert len(lines) == len(WORKERS) + 1
    for worker, line in zip(WORKERS, lines, strict=False):
        assert re.fullmatch(
            rf"\[ROUTING\] Formula for worker_{worker}: cost=[\d.]+ = 1\.000 \* prefill_blocks [\d.]+"
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


def test_a_session_goes_back_to_its_last_worker_while_it_is_eligible(router: KvRouter) -> None:
    hashes = block_hashes(_tokens(6, 320), BS)
    first = router.route(hashes, 320, BS, WORKERS, RoutingPolicy(), session_key=SCOPE, rng=random.Random(1))
    router.dispatch(first, "s1", 320, BS)
    router.load.add(first.worker, "burden", 5_000, 400)  # now the most expensive worker

    again = router.route(hashes, 320, BS, WORKERS, RoutingPolicy(), session_key=SCOPE)
    off = router.route(hashes, 320, BS, WORKERS, RoutingPolicy(), session_key=SCOPE, affinity_enabled=False)
    others = [w for w in WORKERS if w != first.worker]
    gone = router.route(hashes, 320, BS, others, RoutingPolicy(), session_key=SCOPE)

    assert (again.worker, again.reason) == (first.worker, "affinity")
    assert off.worker != first.worker and off.reason == "cost"
    assert gone.worker in others and gone.reason == "cost"


def test_dispatch_counts_the_request_and_a_single_worker_is_the_only_candidate(router: KvRouter) -> None:
    hashes = block_hashes(_tokens(7, 330), BS)
    decision = router.route(hashes, 330, BS, ["gpu3"], RoutingPolicy())
    assert decision.reason == "only-candidate"
    router.dispatch(decision, "r1", 330, BS)
    load = router.load.snapshot(["gpu3"])["gpu3"]
    assert (load.active_prefill_tokens, load.active_decode_blocks, load.active_requests) == (330, 21, 1)


def test_an_approximate_worker_gets_credit_for_what_was_routed_to_it(router: KvRouter) -> None:
    # given: workers that publish no events
    hashes = block_hashes(_tokens(8, 640), BS)
    first = router.route(hashes, 640, BS, WORKERS, RoutingPolicy(), approximate_workers=set(WORKERS))
    router.dispatch(first, "r1", 640, BS)
    router.load.free(first.worker, "r1")

    # when
    second = router.route(hashes, 640, BS, WORKERS, RoutingPolicy(), approximate_workers=set(WORKERS))

    # then
    assert (first.overlap, second.worker, second.overlap) == (0, first.worker, 40)


def test_an_event_publishing_worker_gets_no_credit_before_its_own_events(router: KvRouter) -> None:
    hashes = block_hashes(_tokens(8, 640), BS)
    first = router.route(hashes, 640, BS, ["gpu0"], RoutingPolicy(), approximate_workers={"gpu1"})
    router.dispatch(first, "r1", 640, BS)
    assert router.route(hashes, 640, BS, ["gpu0"], RoutingPolicy()).overlap == 0


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
