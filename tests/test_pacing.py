"""What keeps a frontend's event loop from waiting behind the rest of its process: a paced pass
(routing.state.pacing) lets the interpreter go at its pause points once per slice, and only there,
and the fleet's re-read offers them (a clock of the test's own: nothing here waits); the start-up's
objects are out of the collector's way."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.state import pacing
from tests import model_configs
from tests.conftest import TEST_REDIS_URL


class Clock:
    """`time` as pacing reads it: each reading moves `step` seconds on; sleeps are recorded."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.slept = 0.0, step, []

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock(step=pacing.SLICE_S / 4)
    monkeypatch.setattr(pacing, "time", clock)
    return clock


def test_a_pause_point_outside_a_paced_pass_never_pauses(clock):
    for _ in range(100):
        pacing.pause_point()
    assert clock.slept == []


def test_a_paced_pass_pauses_once_each_slice_it_ran(clock):
    # given a pass whose pause points come a quarter slice apart (the clock's step)
    def work() -> str:
        for _ in range(40):
            pacing.pause_point()
        return "done"

    # when it runs paced, then its points are met again outside it
    assert pacing.paced(work) == "done"
    pauses = len(clock.slept)
    for _ in range(40):
        pacing.pause_point()

    # then it paused about once every slice (the clock moves a step per reading), each pause
    # PAUSE_S long, and not at all once the pass was over
    assert 8 <= pauses <= 20
    assert set(clock.slept) == {pacing.PAUSE_S}
    assert len(clock.slept) == pauses


def test_a_paced_pass_inside_another_leaves_the_outer_one_paced(clock):
    def inner() -> None:
        pacing.pause_point()

    def outer() -> None:
        pacing.paced(inner)
        for _ in range(40):
            pacing.pause_point()

    pacing.paced(outer)
    assert clock.slept, "the outer pass stopped pausing after the inner one"
    clock.slept.clear()
    pacing.pause_point()
    assert clock.slept == []


def test_parsing_a_fleets_new_heartbeats_in_a_paced_pass_pauses_between_them(clock):
    # given 200 heartbeats read for the first time (each one parsed)
    registry = WorkerRegistry(client=None, namespace="test:pacing:")
    names = [f"w{i}" for i in range(200)]
    raw = [Heartbeat(name=name, model="m", block_size=16).to_json().encode() for name in names]

    # when the registry turns them into heartbeats in a paced pass, then again (nothing new)
    beats = pacing.paced(registry._beats, names, raw)
    paused_parsing = len(clock.slept)
    clock.slept.clear()
    again = pacing.paced(registry._beats, names, raw)

    # then it paused while parsing, and read the same bytes again without a pause point
    assert list(beats) == names and all(again[name] is beats[name] for name in names)
    assert paused_parsing >= 10
    assert clock.slept == []


def test_a_started_frontend_keeps_its_start_up_objects_out_of_every_collection(tmp_path: Path) -> None:
    # given: a migrated database and a model directory, as `make run` gives a frontend
    env = {
        **os.environ,
        "MODEL_PATH": str(model_configs.write_family_dir(tmp_path / "model", "qwen3_5")),
        "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        "REDIS_URL": TEST_REDIS_URL,
        "REDIS_KEY_PREFIX": f"test:{uuid.uuid4().hex[:12]}:",
        "DJANGO_SETTINGS_MODULE": "inference_platform.settings",
    }
    code = (
        "import django; django.setup(); from django.core.management import call_command; "
        "call_command('migrate', verbosity=0); import gc; frozen = gc.get_freeze_count(); "
        "import inference_platform.asgi; print(frozen, gc.get_freeze_count())"
    )

    # when: the ASGI application (what uvicorn loads) is imported
    started = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )

    # then: what its start-up made is frozen (tens of thousands of objects), none before it
    assert started.returncode == 0, started.stderr[-2000:]
    before, after = map(int, started.stdout.split()[-2:])
    assert before == 0 and after > 20_000
