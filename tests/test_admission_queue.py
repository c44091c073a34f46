"""The admission queue's order and bounds, in real Redis: priority bands strictly, tenants within
a band by weighted fair share, arrival order within a tenant; one removal per entry; a dead
frontend's entries swept with its liveness mark."""

from __future__ import annotations

import time

import pytest
import redis
import redis.asyncio

from routing.admission.queue import AdmissionQueue, QueuedRequest, QueueFull, Ticket, wait_estimate_s
from routing.state.redis_direct import AsyncDirectCommands


@pytest.fixture
def make_queue(redis_client: redis.Redis, key_namespace: str):
    def make(frontend: str = "fe1", ttl_s: float = 5.0) -> AdmissionQueue:
        return AdmissionQueue(redis_client, key_namespace, frontend, frontend_ttl_s=ttl_s)

    return make


def join(queue: AdmissionQueue, request_id: str, tenant: str = "a", **fields) -> Ticket:
    request = QueuedRequest(request_id=request_id, model="demo", tenant=tenant, **fields)
    return queue.join(request, max_depth=100, max_tenant_depth=100)


def drain_order(queue: AdmissionQueue, tickets: list[Ticket]) -> list[str]:
    """Dispatch whichever ticket's turn it is, until none is left: the order they leave in."""
    order, left = [], list(tickets)
    while left:
        first = next(ticket for ticket in left if queue.turn(ticket) == 0)
        assert queue.leave(first, dispatched=True)
        order.append(first.member.split(":", 1)[1])
        left.remove(first)
    return order


def test_a_tenant_flooding_first_shares_the_band_with_one_that_comes_later(make_queue):
    # given tenant H's six requests queued before tenant L's two, both of weight 1
    queue = make_queue()
    tickets = [join(queue, f"h{n}", "H") for n in range(6)]
    tickets += [join(queue, f"l{n}", "L") for n in range(2)]

    # then they leave in turn between the tenants, each tenant's own in arrival order
    assert drain_order(queue, tickets) == ["h0", "l0", "h1", "l1", "h2", "h3", "h4", "h5"]


def test_weights_share_a_band_in_proportion(make_queue):
    # given tenant A of weight 2 and tenant B of weight 1, six requests each
    queue = make_queue()
    tickets = [join(queue, f"a{n}", "A", weight=2.0) for n in range(6)]
    tickets += [join(queue, f"b{n}", "B", weight=1.0) for n in range(6)]

    # then of the first six to leave, A has four and B two
    first_six = drain_order(queue, tickets)[:6]
    assert sum(name.startswith("a") for name in first_six) == 4


def test_weight_zero_is_arrival_order(make_queue):
    queue = make_queue()
    tickets = [join(queue, f"h{n}", "H", weight=0) for n in range(3)]
    tickets += [join(queue, "l0", "L", weight=0)]
    assert drain_order(queue, tickets) == ["h0", "h1", "h2", "l0"]


def test_a_higher_band_always_leaves_first(make_queue):
    queue = make_queue()
    tickets = [join(queue, f"low{n}", "B", priority=0) for n in range(3)]
    tickets += [join(queue, "high", "B", priority=5), join(queue, "mid", "A", priority=2)]
    assert drain_order(queue, tickets) == ["high", "mid", "low0", "low1", "low2"]


def test_a_tenant_whose_requests_left_unserved_is_not_charged_for_them(make_queue):
    # given tenant H's requests queued then abandoned, and then H and L queue one each
    queue = make_queue()
    for ticket in [join(queue, f"gone{n}", "H") for n in range(5)]:
        assert queue.leave(ticket, dispatched=False)
    tickets = [join(queue, "l0", "L"), join(queue, "h0", "H")]
    # then H waits behind no turn it never had
    assert drain_order(queue, tickets) == ["l0", "h0"]


def test_an_entry_leaves_once(make_queue):
    queue = make_queue()
    ticket = join(queue, "r1")
    assert queue.leave(ticket, dispatched=True)
    assert not queue.leave(ticket, dispatched=True)
    assert queue.turn(ticket) is None and queue.depths() == [] and not queue.waiting("demo")


def test_depths_count_by_model_tenant_and_priority(make_queue):
    queue = make_queue()
    join(queue, "r1", "A", priority=1)
    join(queue, "r2", "A", priority=1)
    join(queue, "r3", "B", priority=0)
    assert sorted(queue.depths()) == [("demo", "A", 1, 2), ("demo", "B", 0, 1)]


def test_past_a_tenants_depth_it_is_refused_as_its_own_share_and_past_the_total_as_the_queues(make_queue):
    queue = make_queue()
    request = QueuedRequest(request_id="x", model="demo", tenant="A")
    queue.join(request, max_depth=2, max_tenant_depth=1)
    with pytest.raises(QueueFull) as tenant:
        queue.join(request, max_depth=2, max_tenant_depth=1)
    queue.join(QueuedRequest(request_id="y", model="demo", tenant="B"), max_depth=2, max_tenant_depth=1)
    with pytest.raises(QueueFull) as total:
        queue.join(QueuedRequest(request_id="z", model="demo", tenant="C"), max_depth=2, max_tenant_depth=1)
    assert (tenant.value.cause, total.value.cause) == ("tenant", "total")


def test_a_tenants_depth_is_bounded_per_priority_so_its_batch_flood_leaves_room_for_the_rest(make_queue):
    # given: tenant A's batch requests fill its depth at priority 0
    queue = make_queue()
    for n in range(2):
        join_bounded = QueuedRequest(request_id=f"batch{n}", model="demo", tenant="A", priority=0)
        queue.join(join_bounded, max_depth=100, max_tenant_depth=2)
    with pytest.raises(QueueFull):
        queue.join(
            QueuedRequest(request_id="batch2", model="demo", tenant="A"), max_depth=100, max_tenant_depth=2
        )
    assert queue.full_for("demo", "A", 0, max_depth=100, max_tenant_depth=2).cause == "tenant"
    # then: its interactive requests still queue, and their flow is bounded on its own
    assert queue.full_for("demo", "A", 9, max_depth=100, max_tenant_depth=2) is None
    high = QueuedRequest(request_id="high", model="demo", tenant="A", priority=9)
    queue.join(high, max_depth=100, max_tenant_depth=2)
    # and: when one leaves, its flow has room again
    first = queue.front("demo", 1)[0]
    assert first.endswith(":high")
    assert queue.leave(Ticket(first, "demo", 0, 0.0), dispatched=True)
    assert queue.full_for("demo", "A", 9, max_depth=100, max_tenant_depth=1) is None


def test_a_dead_frontends_entries_go_with_its_liveness_mark(make_queue):
    # given a frontend with queued requests that stops polling, and a live one
    dead, live = make_queue("dead", ttl_s=2.0), make_queue("live", ttl_s=2.0)
    orphans = [join(dead, f"d{n}") for n in range(3)]
    mine = join(live, "l0")
    assert live.turn(mine) == 3

    # when its liveness mark lapses
    time.sleep(2.1)

    # then the next call of any frontend sweeps them, and the live one's request is first
    assert live.turn(mine) == 0
    assert [dead.turn(ticket) for ticket in orphans] == [None, None, None]
    assert live.depths() == [("demo", "a", 0, 1)]


def test_retry_after_follows_the_drain_rate():
    assert wait_estimate_s(ahead=9, drain_per_s=2.0, fallback_s=30) == 5
    assert wait_estimate_s(ahead=0, drain_per_s=100.0, fallback_s=30) == 1
    assert wait_estimate_s(ahead=9, drain_per_s=0.0, fallback_s=2.5) == 3


def test_a_full_queue_is_seen_before_joining_it(make_queue):
    queue = make_queue()
    join(queue, "r1", "A")
    assert queue.full_for("demo", "A", 0, max_depth=10, max_tenant_depth=2) is None
    assert queue.full_for("demo", "A", 0, max_depth=10, max_tenant_depth=1).cause == "tenant"
    assert queue.full_for("demo", "B", 0, max_depth=1, max_tenant_depth=5).cause == "total"


async def test_an_event_loop_sees_the_queue_as_a_thread_does(make_queue, redis_url) -> None:
    # given a queue with one request of tenant A, and two dispatches in the drain window
    queue = make_queue()
    join(queue, "r1", "A")
    for done in ("d1", "d2"):
        assert queue.leave(join(queue, done, "C"), dispatched=True)
    lines = AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(redis_url))

    # when a frontend's event loop looks on its own connections, then it finds what full_for
    # and waiting find
    for model, tenant, max_depth, max_tenant_depth in (
        ("demo", "A", 10, 2),
        ("demo", "A", 10, 1),
        ("demo", "B", 1, 5),
        ("other", "A", 1, 5),
    ):
        bounds = {"max_depth": max_depth, "max_tenant_depth": max_tenant_depth}
        threaded = queue.full_for(model, tenant, 0, **bounds)
        looped = await queue.afull_for(lines, model, tenant, 0, **bounds)
        assert (looped is None) == (threaded is None)
        if threaded is not None:
            assert (looped.cause, looped.depth, looped.drain_per_s) == (
                threaded.cause,
                threaded.depth,
                threaded.drain_per_s,
            )
            assert threaded.drain_per_s > 0 or model == "other"
    # and the key a decision made only while none wait is conditional on exists for the one
    assert queue.waiting("demo") and not queue.waiting("other")
    assert await lines.execute("EXISTS", queue.waiting_key("demo"), queue.waiting_key("other")) == 1
    await lines.close()


def test_the_front_is_the_first_entries_across_bands_in_order(make_queue):
    queue = make_queue()
    low = join(queue, "low", "A", priority=0)
    high = join(queue, "high", "B", priority=5)
    join(queue, "low2", "A", priority=0)
    assert queue.front("demo", 2) == [high.member, low.member]
    assert queue.front("other", 2) == []
