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


@dataclass(frozen=True)
class RateBudget:
    """What is left of one per-minute limit after a request took its share: OpenAI's
    `x-ratelimit-*` headers, `kind` "requests" or "tokens" (prompt tokens, here)."""

    kind: str
    limit: int
    remaining: int
    reset_ms: int  # until the bucket is full again (it refills continuously)

    def headers(self) -> dict[str, str]:
        return {
            f"x-ratelimit-limit-{self.kind}": str(self.limit),
            f"x-ratelimit-remaining-{self.kind}": str(max(0, self.remaining)),
            f"x-ratelimit-reset-{self.kind}": duration(self.reset_ms),
        }


def duration(ms: int) -> str:
    """A reset time as OpenAI writes it: `20ms`, `1s`, `6m0s`."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = math.ceil(ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    return f"{minutes}m{seconds}s" if minutes else f"{seconds}s"


def exceeded_headers(exceeded: LimitExceeded) -> dict[str, str]:
    """A 429's `x-ratelimit-*` headers: the limit it hit, nothing left, full again after the wait."""
    kind = {"requests_per_minute": "requests", "prompt_tokens_per_minute": "tokens"}.get(exceeded.limit)
    if kind is None or exceeded.retry_after_s is None:
        return {}  # concurrency has no per-minute budget; a request over the limit alone never fits
    return RateBudget(kind, exceeded.value, 0, exceeded.retry_after_s * 1000).headers()


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
    ) -> RateBudget | None:
        """Count one request and take a concurrency slot, both or neither; LimitExceeded if over.
        Returns what is left of the requests-per-minute budget (None without that limit)."""
        if not requests_per_minute and not max_concurrent:
            return None
        verdict, wait_ms, *left = self._admit(
            keys=[self.key(tenant_id, "rpm"), self.key(tenant_id, "active")],
            args=[requests_per_minute or 0, max_concurrent or 0, request_id, self._slot_ttl_ms],
        )
        if verdict == 1:
            raise LimitExceeded("requests_per_minute", int(requests_per_minute or 0), _seconds(wait_ms))
        if verdict == 2:
            raise LimitExceeded("max_concurrent_requests", int(max_concurrent or 0), _seconds(wait_ms))
        if not requests_per_minute or len(left) < 2:
            return None
        return RateBudget("requests", int(requests_per_minute), int(left[0]), int(left[1]))

    def charge_prompt_tokens(self, tenant_id: int, tokens: int, *, limit: int | None) -> RateBudget | None:
        """Take the prompt's tokens from the tenant's per-minute budget; LimitExceeded if over.
        Returns what is left of it (None without that limit)."""
        if not limit:
            return None
        verdict, wait_ms, *left = self._charge(keys=[self.key(tenant_id, "tpm")], args=[limit, tokens])
        if verdict == 3:
            raise LimitExceeded("prompt_tokens_per_minute", limit, None)
        if verdict == 1:
            raise LimitExceeded("prompt_tokens_per_minute", limit, _seconds(wait_ms))
        return RateBudget("tokens", int(limit), int(left[0]), int(left[1])) if len(left) >= 2 else None

    def release(self, tenant_id: int, request_id: str) -> None:
        """Free the request's concurrency slot (a no-op if it held none)."""
        self._client.zrem(self.key(tenant_id, "active"), request_id)

    def release_command(self, tenant_id: int, request_id: str) -> tuple[str, str, str]:
        """`release` as a command, for a caller that sends it in a round trip of its own making
        (a request's end: inference_platform.serving.served)."""
        return ("ZREM", self.key(tenant_id, "active"), request_id)

    def active(self, tenant_id: int) -> int:
        return int(self._client.zcard(self.key(tenant_id, "active")))


def _seconds(wait_ms: int) -> int:
    return max(1, math.ceil(int(wait_ms) / 1000))
