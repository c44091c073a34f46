"""A worker's heartbeat loop (`run_worker`'s `_HeartbeatLoop`) when its engine dies: the worker
leaves the fleet at once and no beat brings it back, not even one under way at that moment."""

from __future__ import annotations

from routing.fleet.registry import Heartbeat, WorkerRegistry
from workers.engine.api import EngineLoad
from workers.management.commands.run_worker import _HeartbeatLoop


class EngineThatDiesDuringABeat:
    """Fault injection: an engine whose death is found by the heartbeat's own load report (as
    vLLM's engine core found dead by the heartbeat), and whose worker then leaves the fleet."""

    max_running = 4
    schedule_policy = "fcfs"

    def __init__(self) -> None:
        self.on_dead = None
        self.reports = 0

    def load_report(self) -> EngineLoad:
        self.reports += 1
        if self.reports == 2 and self.on_dead is not None:
            self.on_dead()
        return EngineLoad(0, 0, 0, 0, 0, 0, 0, 0, 0)


class Runtime:
    def __init__(self, engine) -> None:
        self.engine = engine

    def report_engine_gauges(self) -> None:
        pass


def test_a_worker_whose_engine_dies_during_a_beat_stays_out_of_the_fleet(redis_client, key_namespace) -> None:
    # given a worker beating with its engine's load
    registry = WorkerRegistry(redis_client, key_namespace)
    engine = EngineThatDiesDuringABeat()
    beats = _HeartbeatLoop(
        registry, Heartbeat(name="w1", model="demo", block_size=16, instance="i1"), Runtime(engine)
    )
    beats._beat()
    assert registry.get("w1") is not None

    # when the next beat finds the engine dead and the worker leaves the fleet (as
    # run_worker's leave_without_engine does), in the middle of that beat
    def leave() -> None:
        beats.go_dark()
        registry.remove("w1", "i1")

    engine.on_dead = leave
    beats._beat()

    # then the beat under way wrote nothing, and none comes after
    assert registry.get("w1") is None
    beats.mark_stopping()  # SIGTERM's warm shutdown beats once more
    assert registry.get("w1") is None
