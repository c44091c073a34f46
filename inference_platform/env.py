"""Typed readers for settings taken from the environment.

Each helper fails loudly on a value it cannot parse, so a typo in a deployment's
environment stops the process at start-up instead of silently using a default.
"""

from __future__ import annotations

import os


class EnvError(ValueError):
    """An environment variable holds a value of the wrong shape."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return default if value is None else value


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise EnvError(f"{name}={value!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        parsed = int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer") from None
    if minimum is not None and parsed < minimum:
        raise EnvError(f"{name}={parsed} must be at least {minimum}")
    return parsed


def env_float(name: str, default: float, *, positive: bool = False, minimum: float | None = None) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not a number") from None
    if positive and not parsed > 0:
        raise EnvError(f"{name}={parsed} must be positive")
    if minimum is not None and parsed < minimum:
        raise EnvError(f"{name}={parsed} must be at least {minimum}")
    return parsed


def env_list(name: str, default: list[str] | None = None) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return list(default or [])
    return [item.strip() for item in value.split(",") if item.strip()]
