"""Per-tenant limits shared by every frontend through Redis: requests and prompt tokens per
minute (token buckets refilled continuously) and concurrent requests (a set of live request ids).

Key family (owned here): `rl:<tenant>:rpm`, `rl:<tenant>:tpm` (buckets: tokens left, last
refill in ms) and `rl:<tenant>:active` (sorted set: request id → expiry in ms, so a frontend
that dies mid-request frees its slots when they expire). Time comes from Redis itself, so
frontends with skewed clocks agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis

from routing.state.lua import lua_script, lua_text

# The limiter's Lua, in tenants/lua/: the bucket functions, composed in front of each script.
_BUCKET_LUA = lua_text(__package__, "bucket_functions.lua")
_ADMIT_LUA = lua_script(__package__, "admit.lua", _BUCKET_LUA)
_CHARGE_LUA = lua_script(__package__, "charge.lua", _BUCKET_LUA)


@dataclass(frozen=True)
class LimitExceeded(Exception):
    """A tenant is over one of its limits; `retry_after_s` is None when waiting cannot help."""

    limit: str  # "requests_per_minute" | "prompt_tokens_per_minute" | "max_concurrent_requests"
    value: int
    retry_after_s: int | None

    def describe(self) -> str:
        what = {
            "requests_per_minute": f"{self.value} requests per minute",
            "prompt_tokens_per_minute": f"{self.value} prompt tokens per minute",
            "max_concurrent_requests": f"{self.value} concurrent requests",
        }[self.limit]
        if self.retry_after_s is None:
            return f"This request alone is larger than the tenant's limit of {what}."
        return f"Rate limit reached: the tenant's limit is {what}. Retry after {self.retry_after_s} s."


class TenantLimiter:
    def __init__(self, client: redis.Redis, namespace: str, *, slot_ttl_s: float = 600.0) -> None:
        self._client = client
        self._namespace = namespace
        self._slot_ttl_ms = int(slot_ttl_s * 1000)
        self._admit = client.register_script(_ADMIT_LUA)
        self._charge = client.register_script(_CHARGE_LUA)

    def key(self, tenant_id: int, kind: str) -> str:
        return f"{self._namespace}rl:{tenant_id}:{kind}"

    def admit(
        self, tenant_id: int, request_id: str, *, requests_per_minute: int | None, max_concurrent: int | None
    ) -> None:
        """Count one request and take a concurrency slot, both or neither; LimitExceeded if over."""
        if not requests_per_minute and not max_concurrent:
            return
        verdict, wait_ms = self._admit(
            keys=[self.key(tenant_id, "rpm"), self.key(tenant_id, "active")],
            args=[requests_per_minute or 0, max_concurrent or 0, request_id, self._slot_ttl_ms],
        )
        if verdict == 1:
            raise LimitExceeded("requests_per_minute", int(requests_per_minute or 0), _seconds(wait_ms))
        if verdict == 2:
            raise LimitExceeded("max_concurrent_requests", int(max_concurrent or 0), _seconds(wait_ms))

    def charge_prompt_tokens(self, tenant_id: int, tokens: int, *, limit: int | None) -> None:
        if not limit:
            return
        verdict, wait_ms = self._charge(keys=[self.key(tenant_id, "tpm")], args=[limit, tokens])
        if verdict == 3:
            raise LimitExceeded("prompt_tokens_per_minute", limit, None)
        if verdict == 1:
            raise LimitExceeded("prompt_tokens_per_minute", limit, _seconds(wait_ms))

    def release(self, tenant_id: int, request_id: str) -> None:
        """Free the request's concurrency slot (a no-op if it held none)."""
        self._client.zrem(self.key(tenant_id, "active"), request_id)

    def active(self, tenant_id: int) -> int:
        return int(self._client.zcard(self.key(tenant_id, "active")))


def _seconds(wait_ms: int) -> int:
    return max(1, math.ceil(int(wait_ms) / 1000))
