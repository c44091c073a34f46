"""The test tiers keep themselves: a test that starts the platform's processes is marked
`integration` by the fixtures it uses, and one that starts them some other way is refused."""

from __future__ import annotations

import pytest

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
