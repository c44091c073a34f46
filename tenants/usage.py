"""Per-tenant usage counters in Redis, added to by every frontend, read by the admin.

Key family (owned here): `usage:<tenant usage id>` under the deployment's statistics namespace
(routing.deployment), a hash of running totals since the tenant was created: requests,
prompt_tokens, cached_tokens, completion_tokens, refused (over a limit). Keyed by the tenant's
`usage_id` (a UUID), never its database id, which a new database hands out again from 1.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis

FIELDS = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "refused")
USAGE_FAMILY = "usage:"


class TenantUsage:
    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._client = client
        self._namespace = namespace

    def key(self, usage_id: str) -> str:
        return f"{self._namespace}{USAGE_FAMILY}{usage_id}"

    def record(self, usage_id: str, *, prompt: int = 0, cached: int = 0, completion: int = 0) -> None:
        """One answered request and its tokens."""
        pipe = self._client.pipeline(transaction=False)
        for command in self.record_commands(usage_id, prompt=prompt, cached=cached, completion=completion):
            pipe.execute_command(*command)
        pipe.execute()

    def record_commands(
        self, usage_id: str, *, prompt: int = 0, cached: int = 0, completion: int = 0
    ) -> list[tuple[str, str, str, int]]:
        """`record` as commands, for a caller that sends them in a round trip of its own making
        (a request's end: inference_platform.serving.served)."""
        key = self.key(usage_id)
        return [
            ("HINCRBY", key, "requests", 1),
            ("HINCRBY", key, "prompt_tokens", prompt),
            ("HINCRBY", key, "cached_tokens", cached),
            ("HINCRBY", key, "completion_tokens", completion),
        ]

    def refused(self, usage_id: str) -> None:
        self._client.hincrby(self.key(usage_id), "refused", 1)

    def totals(self, usage_ids: Iterable[str]) -> dict[str, dict[str, int]]:
        ids = list(usage_ids)
        pipe = self._client.pipeline(transaction=False)
        for usage_id in ids:
            pipe.hgetall(self.key(usage_id))
        return {
            usage_id: {field: int(raw.get(field.encode(), 0)) for field in FIELDS}
            for usage_id, raw in zip(ids, pipe.execute(), strict=True)
        }
