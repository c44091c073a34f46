"""The arrival gate (inference_platform.serving.arrivals): at most its width of requests at work,
the others let through in the admission queue's own order, within its bounds."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from inference_platform.serving.arrivals import ArrivalGate, ArrivalTimeout, Bounds
from routing.admission.queue import QueueFull

BOUNDS = Bounds(max_wait_s=10.0, max_depth=100, max_flow_depth=100)


class Arrivals:
    """Requests at one gate, each holding its place until released by the test."""

    def __init__(self, gate: ArrivalGate) -> None:
        self.gate = gate
        self.order: list[str] = []
        self._release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def arrive(self, name: str, tenant: str, priority: int = 0, weight: float = 1.0, **bounds: float) -> None:
        release = self._release[name] = asyncio.Event()

        async def request() -> None:
            async with self.gate.turn(tenant, priority, weight, dataclasses.replace(BOUNDS, **bounds)):
                self.order.append(name)
                await release.wait()

        self.tasks[name] = asyncio.ensure_future(request())

    async def release(self, name: str) -> None:
        self._release[name].set()
        await self.tasks[name]
        await settle()

    async def release_all(self) -> None:
        while len(self.order) < len(self.tasks) or not all(t.done() for t in self.tasks.values()):
            for name in list(self.order):
                self._release[name].set()
            await settle()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_at_most_its_width_work_at_once_and_the_rest_wait():
    async def scenario():
        arrivals = Arrivals(ArrivalGate(2))
        for n in range(4):
            arrivals.arrive(f"r{n}", "t")
        await settle()
        assert arrivals.order == ["r0", "r1"]
        assert arrivals.gate.waiting == 2
        await arrivals.release("r0")
        assert arrivals.order == ["r0", "r1", "r2"]
        await arrivals.release_all()
        assert arrivals.order == ["r0", "r1", "r2", "r3"]
        assert arrivals.gate.waiting == 0

    asyncio.run(scenario())


def order_behind_a_busy_gate(*requests: tuple[str, str, dict]) -> list[str]:
    """The order in which `requests` (name, tenant, options), all arriving while a one-place
    gate is taken, are let through."""

    async def scenario() -> list[str]:
        arrivals = Arrivals(ArrivalGate(1))
        arrivals.arrive("first", "other")
        await settle()
        for name, tenant, options in requests:
            arrivals.arrive(name, tenant, **options)
        await settle()
        await arrivals.release_all()
        return arrivals.order[1:]

    return asyncio.run(scenario())


def test_a_light_tenant_goes_ahead_of_a_flood_that_came_first():
    flood = [(f"h{n}", "heavy", {}) for n in range(5)]
    order = order_behind_a_busy_gate(*flood, ("l0", "light", {}), ("l1", "light", {}))
    # one turn each while both wait, then the flood's remainder
    assert order == ["h0", "l0", "h1", "l1", "h2", "h3", "h4"]


def test_a_tenant_of_twice_the_weight_gets_twice_the_turns():
    both = [(f"{t}{n}", t, {"weight": w}) for n in range(4) for t, w in (("a", 1.0), ("b", 2.0))]
    assert order_behind_a_busy_gate(*both)[:6] == ["a0", "b0", "b1", "a1", "b2", "b3"]


def test_a_higher_priority_always_goes_first_and_weight_zero_is_arrival_order():
    order = order_behind_a_busy_gate(
        *[(f"low{n}", "flood", {"weight": 0}) for n in range(3)],
        ("high", "flood", {"priority": 9, "weight": 0}),
        ("low3", "light", {"weight": 0}),
    )
    assert order == ["high", "low0", "low1", "low2", "low3"]


def test_a_request_that_goes_away_while_waiting_is_skipped_and_its_turn_passes_on():
    async def scenario():
        arrivals = Arrivals(ArrivalGate(1))
        for name in ("a", "b", "c"):
            arrivals.arrive(name, name)
        await settle()
        arrivals.tasks["b"].cancel()
        await settle()
        assert arrivals.gate.waiting == 1
        await arrivals.release("a")
        assert arrivals.order == ["a", "c"]
        await arrivals.release("c")
        # the gate is free again: the next comes straight through
        arrivals.arrive("d", "d")
        await settle()
        assert arrivals.order == ["a", "c", "d"]

    asyncio.run(scenario())


def test_a_place_handed_to_a_request_gone_in_the_same_moment_passes_on():
    async def scenario():
        gate = ArrivalGate(1)
        arrivals = Arrivals(gate)
        arrivals.arrive("a", "a")
        arrivals.arrive("b", "b")
        arrivals.arrive("c", "c")
        await settle()
        # "a" frees its place, handing it to "b", and "b" is cancelled before it resumes
        arrivals._release["a"].set()
        await asyncio.sleep(0)  # "a" leaves its block: the place is "b"'s
        arrivals.tasks["b"].cancel()
        await settle()
        assert arrivals.order == ["a", "c"]
        await arrivals.release("c")
        assert gate.waiting == 0
        arrivals.arrive("d", "d")
        await settle()
        assert arrivals.order[-1] == "d"

    asyncio.run(scenario())


def test_past_its_bounds_a_request_is_refused_at_once_and_past_its_wait_timed_out():
    async def scenario():
        gate = ArrivalGate(1)
        arrivals = Arrivals(gate)
        arrivals.arrive("busy", "x")
        arrivals.arrive("h0", "heavy", max_flow_depth=2)
        arrivals.arrive("h1", "heavy", max_flow_depth=2)
        await settle()
        with pytest.raises(QueueFull) as tenant_full:
            async with gate.turn("heavy", 0, 1.0, Bounds(10, 100, 2)):
                pass
        assert tenant_full.value.cause == "tenant"
        with pytest.raises(QueueFull) as total_full:
            async with gate.turn("light", 0, 1.0, Bounds(10, 2, 100)):
                pass
        assert total_full.value.cause == "total"
        with pytest.raises(ArrivalTimeout) as late:
            async with gate.turn("light", 0, 1.0, Bounds(0.05, 100, 100)):
                pass
        # the light tenant's first request would have gone after heavy's first, before its second
        assert late.value.ahead == 1 and late.value.waited_s >= 0.05
        await arrivals.release_all()
        assert arrivals.order == ["busy", "h0", "h1"]
        assert gate.waiting == 0

    asyncio.run(scenario())


def test_every_wait_is_reported_begun_and_ended_however_it_ends():
    async def scenario():
        gate = ArrivalGate(1)
        arrivals = Arrivals(gate)
        arrivals.arrive("busy", "x")
        await settle()
        reported: list[int] = []

        async def waits(timeout_s: float) -> None:
            async with gate.turn("t", 0, 1.0, Bounds(timeout_s, 9, 9), on_wait=reported.append):
                pass

        with pytest.raises(ArrivalTimeout):
            await waits(0.01)
        cancelled = asyncio.ensure_future(waits(10))
        await settle()
        cancelled.cancel()
        await settle()
        served = asyncio.ensure_future(waits(10))
        await settle()
        await arrivals.release("busy")
        await served
        assert reported == [1, -1, 1, -1, 1, -1]
        # a request let through at once never waited
        await waits(10)
        assert len(reported) == 6

    asyncio.run(scenario())


def test_while_the_shared_state_is_out_of_reach_nobody_waits_for_a_place():
    async def scenario():
        gate = ArrivalGate(1)
        arrivals = Arrivals(gate)
        arrivals.arrive("holder", "x")
        arrivals.arrive("waiting", "y")
        await settle()
        assert arrivals.order == ["holder"]
        # when: the holder finds Redis gone, and sends the waiting on
        gate.let_everyone_through()
        await settle()
        # then: the waiting one works beside it, without a place; a newcomer passes while bypass() says so
        assert arrivals.order == ["holder", "waiting"] and gate.working == 1
        async with gate.turn("z", 0, 1.0, BOUNDS, bypass=lambda: True):
            assert gate.working == 1
        assert gate.unplaced == 2
        # and: the places are as before once they leave (the unplaced give back none)
        await arrivals.release_all()
        assert (gate.working, gate.waiting) == (0, 0)
        arrivals.arrive("after", "z")
        await settle()
        assert arrivals.order[-1] == "after" and gate.working == 1

    asyncio.run(scenario())
