"""The test tiers keep themselves: a test that starts the platform's processes is marked
`integration` by the fixtures it uses, and one that starts them some other way is refused."""

from __future__ import annotations

import pytest

from tests import process_groups
from tests.conftest import pytest_collection_modifyitems
from tests.platform_harness import run_worker_args, worker_starts


def test_a_worker_started_by_a_test_without_the_integration_marker_is_refused_and_not_counted() -> None:
    # given this test, which uses no fixture that starts processes (so `make check` runs it)
    before = worker_starts()

    # when it asks for a worker's command line, then it is refused before anything starts
    with pytest.raises(RuntimeError, match="without the `integration` marker"):
        run_worker_args("stray")
    assert worker_starts() == before


class _Item:
    """What the collection hook reads of a collected test: its fixture closure and markers."""

    def __init__(self, *fixturenames: str) -> None:
        self.fixturenames = list(fixturenames)
        self.markers: list[str] = []

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.markers else None

    def add_marker(self, marker: str) -> None:
        self.markers.append(marker)


def test_markers_follow_from_the_fixtures_a_test_uses() -> None:
    # given tests as collected: their fixture closures, as pytest computes them
    pooled = _Item("pooled_platform", "worker_pool", "platform_harness", "demo_model_dir", "tmp_path")
    browser = _Item("browser", "chromium", "observed_platform", "platform_harness", "demo_model_dir")
    engine = _Item("demo_engine", "shared_parts", "demo_model_dir")
    plain = _Item("redis_client", "key_namespace")

    # when the hook marks them
    pytest_collection_modifyitems(None, [pooled, browser, engine, plain])

    # then each carries the tiers its fixtures bring, and `make check` would run only the last two
    assert pooled.markers == ["integration", "model"]
    assert browser.markers == ["integration", "model", "browser"]
    assert engine.markers == ["model"]
    assert plain.markers == []


class _Definition:
    """What `tests/process_groups.py` reads of a fixture: its scope and the fixtures it asks for."""

    def __init__(self, scope: str, *argnames: str) -> None:
        self.scope, self.argnames = scope, argnames


_DEFINITIONS = {
    "platform_harness": _Definition("session"),
    "tmp_path_factory": _Definition("session"),
    "demo_model_dir": _Definition("session", "tmp_path_factory"),
    "worker_pool": _Definition("session", "platform_harness", "demo_model_dir"),
    "shared_platform": _Definition("session", "worker_pool"),
    "sim_pool": _Definition("session", "platform_harness"),
    "two_workers": _Definition("module", "platform_harness"),
    "tmp_path": _Definition("function", "tmp_path_factory"),
}


class _Collected:
    """A collected test as `process_groups.groups` reads it: its node id and fixture closure."""

    def __init__(self, nodeid: str, *fixtures: str) -> None:
        self.nodeid = nodeid
        self._fixtureinfo = type("Info", (), {})()
        self._fixtureinfo.name2fixturedefs = {name: [_DEFINITIONS[name]] for name in fixtures}


def test_the_tests_sharing_a_fixture_that_starts_processes_are_one_group_and_the_rest_their_modules() -> None:
    # given tests whose fixtures start processes (through platform_harness) or not
    tests = [
        _Collected("tests/test_x.py::a", "worker_pool", "platform_harness", "demo_model_dir"),
        _Collected("tests/test_y.py::b", "shared_platform", "worker_pool", "platform_harness"),
        _Collected("tests/test_y.py::c", "sim_pool", "worker_pool", "platform_harness"),  # links the pools
        _Collected("tests/test_z.py::d", "sim_pool", "platform_harness", "tmp_path"),
        _Collected("tests/test_z.py::e", "two_workers", "platform_harness"),
        _Collected("tests/test_z.py::f", "demo_model_dir", "tmp_path"),
        _Collected("tests/test_z.py::g", "two_workers", "platform_harness"),
        _Collected("tests/test_w.py::h", "two_workers", "platform_harness"),  # another module's fixture
    ]

    # when they are grouped
    groups = process_groups.groups(tests)

    # then every test of a pool (or of pools one test links) is in one group, a module-scoped
    # fixture's tests in its module's group of them, and a test that starts nothing in its module's
    pooled = {groups[f"tests/test_{test}"] for test in ("x.py::a", "y.py::b", "y.py::c", "z.py::d")}
    assert len(pooled) == 1 and pooled <= {"worker_pool", "sim_pool", "shared_platform"}
    assert groups["tests/test_z.py::e"] == groups["tests/test_z.py::g"] == "tests/test_z.py::two_workers"
    assert groups["tests/test_w.py::h"] == "tests/test_w.py::two_workers"
    assert groups["tests/test_z.py::f"] == "tests/test_z.py"


def test_the_scheduler_takes_each_tests_group_from_what_the_test_processes_wrote(
    tmp_path, monkeypatch
) -> None:
    # given a test process of a `--dist loadgroup` run that recorded its groups
    monkeypatch.setenv(process_groups.GROUPS_FILE, str(tmp_path / "groups.json"))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    process_groups.record(
        [
            _Collected("tests/test_y.py::b", "worker_pool", "platform_harness"),
            _Collected("tests/test_z.py::d", "demo_model_dir"),
        ]
    )

    # when the controlling process splits the collection into work units
    scheduler = process_groups.ProcessGroupScheduling.__new__(process_groups.ProcessGroupScheduling)

    # then a test's unit is its group, and a test the processes did not group is its module's
    assert scheduler._split_scope("tests/test_y.py::b") == "worker_pool"
    assert scheduler._split_scope("tests/test_z.py::d") == "tests/test_z.py"
    assert scheduler._split_scope("tests/test_v.py::new") == "tests/test_v.py"
    assert list(tmp_path.iterdir()) == [tmp_path / "groups.json"]  # no partial file left
