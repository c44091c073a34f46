"""Per-tenant limits in Redis (shared by every frontend), usage counters, and the cache partition
a caller's requests live in: salts, session scopes bound to the tenant, the worker's partition."""

from __future__ import annotations

import time

import pytest
import redis

from routing.prompt.hashing import block_hashes, cache_salt, local_block_hashes
from tenants.keys import ANONYMOUS, Caller
from tenants.limits import LimitExceeded, TenantLimiter, duration, exceeded_headers
from tenants.usage import TenantUsage
from workers.runtime import WorkerRuntime


@pytest.fixture
def limiter(redis_client: redis.Redis, key_namespace: str) -> TenantLimiter:
    return TenantLimiter(redis_client, key_namespace, slot_ttl_s=5)


def test_requests_per_minute_admit_the_limit_then_refuse_with_a_retry_after(limiter):
    for n in range(3):
        limiter.admit(1, f"r{n}", requests_per_minute=3, max_concurrent=None)
    with pytest.raises(LimitExceeded) as refused:
        limiter.admit(1, "r3", requests_per_minute=3, max_concurrent=None)
    assert refused.value.limit == "requests_per_minute"
    assert 1 <= refused.value.retry_after_s <= 20  # one request comes back every 20 s
    limiter.admit(2, "other-tenant", requests_per_minute=3, max_concurrent=None)


def test_two_frontends_share_one_budget(redis_client, key_namespace):
    first, second = (TenantLimiter(redis_client, key_namespace) for _ in range(2))
    first.admit(7, "a", requests_per_minute=2, max_concurrent=None)
    second.admit(7, "b", requests_per_minute=2, max_concurrent=None)
    with pytest.raises(LimitExceeded):
        first.admit(7, "c", requests_per_minute=2, max_concurrent=None)


def test_concurrency_slots_are_freed_when_requests_end_and_expire_after_a_crash(
    limiter, redis_client, key_namespace
):
    limiter.admit(1, "a", requests_per_minute=None, max_concurrent=2)
    limiter.admit(1, "b", requests_per_minute=None, max_concurrent=2)
    with pytest.raises(LimitExceeded) as refused:
        limiter.admit(1, "c", requests_per_minute=None, max_concurrent=2)
    assert refused.value.limit == "max_concurrent_requests" and refused.value.retry_after_s == 1
    limiter.release(1, "a")
    limiter.admit(1, "c", requests_per_minute=None, max_concurrent=2)
    # a frontend that died holding "b" and "c": their slots expire on their own
    short = TenantLimiter(redis_client, key_namespace, slot_ttl_s=0.2)
    short.admit(3, "lost", requests_per_minute=None, max_concurrent=1)
    time.sleep(0.3)
    short.admit(3, "next", requests_per_minute=None, max_concurrent=1)


def test_a_refused_concurrency_slot_does_not_spend_a_request_of_the_minute(limiter):
    limiter.admit(1, "a", requests_per_minute=2, max_concurrent=1)
    with pytest.raises(LimitExceeded):
        limiter.admit(1, "b", requests_per_minute=2, max_concurrent=1)
    limiter.release(1, "a")
    limiter.admit(1, "c", requests_per_minute=2, max_concurrent=1)  # the refused one cost nothing


def test_prompt_tokens_per_minute_and_a_request_larger_than_the_limit(limiter):
    limiter.charge_prompt_tokens(1, 600, limit=1000)
    with pytest.raises(LimitExceeded) as refused:
        limiter.charge_prompt_tokens(1, 600, limit=1000)
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 10
    with pytest.raises(LimitExceeded) as never:
        limiter.charge_prompt_tokens(2, 1001, limit=1000)
    assert never.value.retry_after_s is None and "larger" in never.value.describe()


def test_an_admitted_request_reports_what_is_left_as_openais_ratelimit_headers(limiter):
    # given a tenant of 3 requests and 1,000 prompt tokens per minute
    requests = limiter.admit(1, "a", requests_per_minute=3, max_concurrent=None)
    tokens = limiter.charge_prompt_tokens(1, 600, limit=1000)
    # then each budget says its limit, what is left, and when its bucket is full again
    headers = requests.headers() | tokens.headers()
    assert headers["x-ratelimit-limit-requests"] == "3"
    assert headers["x-ratelimit-remaining-requests"] == "2"
    assert headers["x-ratelimit-reset-requests"] in ("20s", "19s")  # one request back in 60/3 s
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "400"
    assert headers["x-ratelimit-reset-tokens"] in ("36s", "35s")
    # a second request leaves one fewer
    assert limiter.admit(1, "b", requests_per_minute=3, max_concurrent=None).remaining == 1


def test_a_refusal_reports_nothing_left_until_its_retry_after(limiter):
    with pytest.raises(LimitExceeded) as refused:
        for n in range(3):
            limiter.admit(1, f"r{n}", requests_per_minute=2, max_concurrent=None)
    headers = exceeded_headers(refused.value)
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == duration(refused.value.retry_after_s * 1000)
    # a concurrency limit has no per-minute budget to report
    assert exceeded_headers(LimitExceeded("max_concurrent_requests", 2, 1)) == {}


@pytest.mark.parametrize(("ms", "shown"), [(20, "20ms"), (1000, "1s"), (1001, "2s"), (360_000, "6m0s")])
def test_reset_times_read_as_openai_writes_them(ms, shown):
    assert duration(ms) == shown


def test_no_limit_writes_nothing(limiter, redis_client, key_namespace):
    assert limiter.admit(1, "a", requests_per_minute=None, max_concurrent=None) is None
    assert limiter.charge_prompt_tokens(1, 10, limit=None) is None
    assert not list(redis_client.scan_iter(match=f"{key_namespace}rl:*"))


def test_usage_counters_add_up_per_tenant(redis_client, key_namespace):
    usage = TenantUsage(redis_client, key_namespace)
    busy, idle = "6f1c2a40-0000-4000-8000-000000000001", "6f1c2a40-0000-4000-8000-000000000002"
    usage.record(busy, prompt=10, cached=4, completion=3)
    usage.record(busy, prompt=5, completion=2)
    usage.refused(busy)
    totals = usage.totals([busy, idle])
    assert totals[busy] == {
        "requests": 2, "prompt_tokens": 15, "cached_tokens": 4, "completion_tokens": 5, "refused": 1,
    }  # fmt: skip
    assert totals[idle] == dict.fromkeys(totals[idle], 0)


def tenant(tenant_id: int, partition: str | None) -> Caller:
    return Caller(
        tenant_id=tenant_id, tenant_name=f"t{tenant_id}", key_prefix="x", staff=False, partition=partition
    )


def test_a_tenant_salt_changes_every_block_hash_and_no_local_hash():
    tokens = list(range(64))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, salt=cache_salt("tenant", "abc"))
    assert not set(plain) & set(salted)
    assert block_hashes(tokens, 16, salt=cache_salt("tenant", "abc")) == salted
    assert local_block_hashes(tokens, 16) == local_block_hashes(tokens, 16)  # what a block holds is unchanged


def test_callers_partitions_isolated_tenants_apart_and_sharing_tenants_together():
    alice, bob = tenant(1, "salt-of-alice"), tenant(2, "salt-of-bob")
    carol, dave = tenant(3, None), tenant(4, None)
    assert alice.cache_salt() != bob.cache_salt()
    assert alice.cache_salt() is not None
    assert carol.cache_salt() is None and dave.cache_salt() is None  # the shared pool
    assert ANONYMOUS.cache_salt() is None
    # a request's cache_salt narrows the partition, inside its tenant
    assert alice.cache_salt("x") not in (alice.cache_salt(), bob.cache_salt("x"))
    assert carol.cache_salt("x") == dave.cache_salt("x")  # both opted into sharing


def test_a_session_scope_is_bound_to_its_tenant(settings):
    from inference_platform.serving.prepare import session_scope_hash

    headers = {"x-session-id": "leaked-session-id"}
    alice = session_scope_hash(headers, tenant(1, "a"))
    assert alice == session_scope_hash(headers, tenant(1, "a"))
    assert alice != session_scope_hash(headers, tenant(2, "b"))
    assert alice != session_scope_hash(headers, ANONYMOUS)


def test_the_worker_partitions_images_and_embeddings_by_the_salt_without_scoping(redis_client, key_namespace):
    runtime = WorkerRuntime(name="w", engine=None, client=redis_client, namespace=key_namespace)
    assert runtime.cache_partition("scope-hash", None) is None  # scoping off: sessions share
    assert runtime.cache_partition(None, 0xAB) == "salt-00000000000000ab"
    scoped = WorkerRuntime(
        name="w", engine=None, client=redis_client, namespace=key_namespace, session_scoped=True
    )
    assert scoped.cache_partition("scope-hash", 0xAB) == "scope-hash"  # bound to the tenant already
    assert scoped.cache_partition(None, 0xAB) is None  # no scope: the caches are bypassed
