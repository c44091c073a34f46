"""scripts/uv_sources.py: uv looks where pip is configured to look, and nowhere that is not there."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "uv_sources.py"
spec = importlib.util.spec_from_file_location("uv_sources", SCRIPT)
uv_sources = importlib.util.module_from_spec(spec)
spec.loader.exec_module(uv_sources)


def test_every_place_pip_looks_becomes_uvs_option_and_best_version_wins_across_them(tmp_path) -> None:
    wheels, index = tmp_path / "wheels", tmp_path / "simple"
    wheels.mkdir()
    index.mkdir()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    options = uv_sources.uv_options(
        {
            "find-links": str(wheels),
            "extra-index-url": f"file://{index} https://pypi.example/simple",
            "constraint": str(constraints),
        }
    )
    assert options == [
        "--extra-index-url", f"file://{index}",
        "--extra-index-url", "https://pypi.example/simple",
        "--find-links", str(wheels),
        "--constraint", str(constraints),
        "--index-strategy", "unsafe-best-match",
    ]  # fmt: skip


def test_a_local_place_that_is_not_there_is_left_out_as_pip_ignores_it(tmp_path) -> None:
    gone = tmp_path / "gone"
    options = uv_sources.uv_options({"find-links": str(gone), "extra-index-url": f"file://{gone}/simple"})
    assert options == []


def test_pip_with_nothing_configured_gives_uv_nothing_to_add() -> None:
    assert uv_sources.uv_options({}) == []
    assert uv_sources.uv_options({"constraint": "/no/such/constraints.txt"}) == []
