"""Per-tenant usage counters in Redis, added to by every frontend, read by the admin.

Key family (owned here): `usage:<tenant>`, a hash of running totals since the tenant was
created: requests, prompt_tokens, cached_tokens, completion_tokens, refused (over a limit).
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "refused")


class TenantUsage:
    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._client = client
        self._namespace = namespace

    def key(self, tenant_id: int) -> str:
        return f"{self._namespace}usage:{tenant_id}"

    def record(self, tenant_id: int, *, prompt: int = 0, cached: int = 0, completion: int = 0) -> None:
        """One answered request and its tokens."""
        pipe = self._client.pipeline(transaction=False)
        key = self.key(tenant_id)
        pipe.hincrby(key, "requests", 1)
        pipe.hincrby(key, "prompt_tokens", prompt)
        pipe.hincrby(key, "cached_tokens", cached)
        pipe.hincrby(key, "completion_tokens", completion)
        pipe.execute()

    def refused(self, tenant_id: int) -> None:
        self._client.hincrby(self.key(tenant_id), "refused", 1)

    def totals(self, tenant_ids: Iterable[int]) -> dict[int, dict[str, int]]:
        ids = list(tenant_ids)
        pipe = self._client.pipeline(transaction=False)
        for tenant_id in ids:
            pipe.hgetall(self.key(tenant_id))
        return {
            tenant_id: {field: int(raw.get(field.encode(), 0)) for field in FIELDS}
            for tenant_id, raw in zip(ids, pipe.execute(), strict=True)
        }
