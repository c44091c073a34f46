"""Runs the tests that start the platform's processes in parallel test processes without
starting any pool of them twice (`make test`'s integration tier: `-n 2 --dist loadgroup`).

A session-scoped fixture that starts processes (a pool of workers, the platform with a private
Redis) is set up once in each test process that runs one of its tests, and a module-scoped one
once in each process that runs one of its module's tests. So the tests that share such a
fixture form one group, which one test process runs whole and in order (some modules' tests
build on what an earlier test of theirs left); a test that shares none is grouped with its
module. Split that way, two test processes start each pool once, as one process would.

pytest-xdist's own `--dist loadgroup` reads a group from the `xdist_group` mark by appending it
to each test's node id, which pytest 9.2's structured node ids no longer allow
(pytest-dev/pytest-xdist#1386): its groups are silently ignored. So each test process writes the
groups it computed (they are the same in every process) to a file the controlling process named
before starting them, and `ProcessGroupScheduling` reads it when it splits the collection.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_FILE = "TEST_PROCESS_GROUPS_FILE"
_groups_file_key = pytest.StashKey[str]()


def configure(config: pytest.Config) -> None:
    """In the controlling process of a `--dist loadgroup` run: name the file the test processes
    (started after this, inheriting the environment) write their groups to."""
    if hasattr(config, "workerinput") or config.getoption("dist", None) != "loadgroup":
        return
    handle, path = tempfile.mkstemp(prefix="test-groups-", suffix=".json")
    os.close(handle)
    os.environ[GROUPS_FILE] = path
    config.stash[_groups_file_key] = path


def unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_groups_file_key, None)
    if path:
        os.environ.pop(GROUPS_FILE, None)
        for leftover in (path, *glob.glob(f"{glob.escape(path)}.gw*")):  # a process's partial file
            if os.path.exists(leftover):
                os.unlink(leftover)


def record(items: list[pytest.Item]) -> None:
    """In a test process of a `--dist loadgroup` run: write each test's group (`groups`)."""
    path = os.environ.get(GROUPS_FILE)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not path or not worker:
        return
    partial = f"{path}.{worker}"
    with open(partial, "w", encoding="utf-8") as out:
        json.dump(groups(items), out)
    os.replace(partial, path)  # whole or not at all: every process writes the same groups


def groups(items: list[pytest.Item]) -> dict[str, str]:
    """Each test's group, by node id: the tests that share a fixture which starts processes
    (directly or through other fixtures) are one group, named after one of those fixtures; a
    test that shares none is in its module's group."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys_of: dict[str, list[str]] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        module = item.nodeid.split("::")[0]
        if info is None:
            keys_of[item.nodeid] = [module]
            continue
        definitions = info.name2fixturedefs
        shared = [
            name if definitions[name][-1].scope == "session" else f"{module}::{name}"
            for name in definitions
            if definitions[name][-1].scope in ("session", "module") and _starts_processes(name, definitions)
        ]
        # A session fixture's name first, so that it names the group.
        keys_of[item.nodeid] = sorted(shared, key=lambda key: "::" in key) or [module]
        for key in keys_of[item.nodeid][1:]:
            parent[find(key)] = find(keys_of[item.nodeid][0])
    return {nodeid: find(keys[0]) for nodeid, keys in keys_of.items()}


def _starts_processes(name: str, definitions: dict, seen: frozenset[str] = frozenset()) -> bool:
    """Whether fixture `name` leads to `platform_harness` (what every start of the platform's
    processes goes through: tests/platform_harness.py) and is not that fixture itself."""
    if name in seen or name not in definitions:
        return False
    arguments = definitions[name][-1].argnames
    return "platform_harness" in arguments or any(
        _starts_processes(argument, definitions, seen | {name}) for argument in arguments
    )


class ProcessGroupScheduling(LoadScopeScheduling):
    """xdist's scheduling by scope, a scope being a test's group (`groups`): each test process
    takes whole groups, the largest first, in collection order within each."""

    _groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:
            path = os.environ.get(GROUPS_FILE)
            # Written by the test processes before they report their collections, which is
            # before the first split.
            with open(path, encoding="utf-8") as written:  # type: ignore[arg-type]
                self._groups = json.load(written)
        return self._groups.get(nodeid) or nodeid.split("::")[0]
