"""When each API key was last used, for the admin: a hash in Redis, written by every frontend.

Key family (owned here): `keys:last-used`, a hash of key prefix → Unix time of its last
accepted request. A frontend writes a key's time at most once per RECORD_EVERY_S, so a busy key
costs one Redis write a minute per process, not one per request: "last used" is exact to a
minute. Without Redis nothing is recorded and the admin says "unknown".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime

import redis
from django.conf import settings

from routing.state.redis_keys import sync_client

logger = logging.getLogger("tenants.key_use")

LAST_USED_KEY = "keys:last-used"
RECORD_EVERY_S = 60.0
# Recording only informs the admin: a Redis slower than this skips it rather than hold a request.
_RECORD_TIMEOUT_S = 0.25

_lock = threading.Lock()
_recorded_at: dict[str, float] = {}  # prefix → monotonic time this process last wrote it


def _hash_key() -> str:
    return f"{settings.REDIS_KEY_PREFIX}{LAST_USED_KEY}"


def note_key_used(prefix: str) -> None:
    """The key with this prefix opened a request now (written at most once a minute per process)."""
    now = time.monotonic()
    with _lock:
        if not _due(prefix, now):
            return
        _recorded_at[prefix] = now
    try:
        client = sync_client(settings.REDIS_URL, timeout_s=_RECORD_TIMEOUT_S)
        client.hset(_hash_key(), prefix, f"{time.time():.0f}")
    except redis.RedisError as exc:
        logger.debug("could not record the use of key %s: %s", prefix, exc)


def use_due(prefix: str) -> bool:
    """Whether `note_key_used(prefix)` would write now (a look: it records nothing)."""
    with _lock:
        return _due(prefix, time.monotonic())


def _due(prefix: str, now: float) -> bool:
    """No use of this key written by this process in the last RECORD_EVERY_S (under `_lock`)."""
    return now - _recorded_at.get(prefix, -RECORD_EVERY_S) >= RECORD_EVERY_S


def forget_recorded_uses() -> None:
    """This process writes each key's next use at once (tests; the throttle is per process)."""
    with _lock:
        _recorded_at.clear()


def last_used(prefixes: Iterable[str]) -> dict[str, datetime | None] | None:
    """Each key's last use (None: never, as far as Redis knows), or None when Redis is unavailable."""
    wanted = list(prefixes)
    if not wanted:
        return {}
    try:
        raw = sync_client(settings.REDIS_URL).hmget(_hash_key(), wanted)
    except redis.RedisError:
        return None
    return {
        prefix: None if value is None else datetime.fromtimestamp(int(value), tz=UTC)
        for prefix, value in zip(wanted, raw, strict=True)
    }
