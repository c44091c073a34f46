"""Every management command has a test (a test or the harness calls it by name)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_every_management_command_is_exercised_by_some_test():
    commands = {
        path.stem for path in REPO.glob("*/management/commands/*.py") if not path.stem.startswith("_")
    }
    tests = "\n".join(
        path.read_text() for path in (REPO / "tests").glob("*.py") if path.name != Path(__file__).name
    )
    untested = {name for name in commands if not re.search(rf"[\"']{name}[\"']", tests)}
    assert len(commands) >= 6
    assert untested == set()
