"""Session affinity: the worker a session scope was last sent to, shared by every frontend.

Keys are `aff:<scope hash>`, never the raw scope id (scopes are secrets); a key expires when
its session has been quiet for ttl_s.
"""

from __future__ import annotations

import re

import redis

from routing.state.redis_keys import reply_text

AFFINITY_FAMILY = "aff:"
DEFAULT_AFFINITY_TTL_S = 1800.0

# A keyed hash from routing.prompt.session_scope.scope_hash is hex; anything else may be a raw scope.
_SCOPE_HASH = re.compile(r"[0-9a-f]{16,128}")


def _checked(scope_hash: str) -> str:
    if not _SCOPE_HASH.fullmatch(scope_hash):
        raise ValueError("session affinity takes a scope hash (hex), never a raw scope id")
    return scope_hash


class SessionAffinity:
    def __init__(self, client: redis.Redis, namespace: str, ttl_s: float = DEFAULT_AFFINITY_TTL_S) -> None:
        self._client = client
        self._namespace = namespace
        self._ttl_ms = max(int(ttl_s * 1000), 1)

    @property
    def ttl_ms(self) -> int:
        return self._ttl_ms

    def key(self, scope_hash: str) -> str:
        return f"{self._namespace}{AFFINITY_FAMILY}{_checked(scope_hash)}"

    def get(self, scope_hash: str) -> str | None:
        raw = self._client.get(self.key(scope_hash))
        return self.parse(raw)

    def set(self, scope_hash: str, worker: str) -> None:
        self._client.set(self.key(scope_hash), worker, px=self._ttl_ms)

    @staticmethod
    def parse(raw: bytes | str | None) -> str | None:
        if raw is None:
            return None
        return reply_text(raw)
