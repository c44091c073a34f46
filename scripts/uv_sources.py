"""Prints the `uv pip install` options that make uv take packages from where pip would.

uv reads none of pip's configuration, and a machine's pip may be told to look on its own disk
first (find-links, a local index, a constraints file: where a CPU build of torch lies, say).
Read from `pip config list` (its files and PIP_* variables): find-links, index-url,
extra-index-url and constraint; a local path or file:// index that does not exist is left out,
as pip itself ignores it with a warning where uv would stop.

Usage: uv pip install $(python scripts/uv_sources.py) -r requirements-vllm.txt
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

OPTIONS = {  # pip's key -> uv's option
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_config() -> dict[str, str]:
    """Each key's value as pip applies it: a later line (a narrower scope, or the environment)
    overrides an earlier one."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    values: dict[str, str] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        key = key.rsplit(".", 1)[-1]
        if key in OPTIONS:
            values[key] = value.strip().strip("'\"")
    return values


def reachable(location: str) -> bool:
    """False only for a local place that is not there (a URL is left for uv to try)."""
    parsed = urlparse(location)
    if parsed.scheme in ("http", "https"):
        return True
    return Path(parsed.path if parsed.scheme == "file" else location).exists()


def uv_options(values: dict[str, str]) -> list[str]:
    options: list[str] = []
    for key, option in OPTIONS.items():
        for location in values.get(key, "").split():
            if reachable(location):
                options += [option, location]
    if any(option != "--constraint" for option in options[::2]):
        # pip takes the best version from all of them; uv, by default, the first index that has
        # the package at all.
        options += ["--index-strategy", "unsafe-best-match"]
    return options


if __name__ == "__main__":
    print(shlex.join(uv_options(pip_config())))
