"""API keys: made, checked and revoked here, and only here.

A key reads `sk-<prefix>.<secret>`: the prefix (8 hex characters) finds the row, the SHA-256 of
the whole key must match the stored one. A slow password hash buys nothing for 190 random bits
and would cost every request; the database never holds anything that opens the API.

Verified keys: a frontend keeps the callers of the keys it verified lately, by their SHA-256
(`VerifiedKeys`, API_KEY_CACHE_SECS), so a request's key costs one Redis read instead of a
database connection and query (under ASGI each request's database work runs on a thread of its
own, so the connection is a new one every time). Any change to a key or a tenant, by any
process (the admin, `api_keys revoke`, a tenant's limits edited), sets a new random token as
`keys:generation` in Redis; a frontend that reads a generation other than the one it verified
under forgets every key it kept. Without Redis nothing says whether a key changed: every
request asks the database.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from routing.prompt.hashing import cache_salt
from routing.state.expiring import ExpiringLru
from routing.state.redis_keys import read_generation, renew_generation, sync_client
from tenants.key_use import note_key_used, use_due
from tenants.models import DEFAULT_PRIORITY, ApiKey, Tenant

if TYPE_CHECKING:
    from routing.state.redis_direct import AsyncDirectCommands

logger = logging.getLogger("tenants.keys")

KEY_PREFIX = "sk-"
_KEY_SHAPE = re.compile(r"sk-([0-9a-f]{8})\.([A-Za-z0-9_-]{32,64})")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who is calling, as the API needs to know it (no secret inside)."""

    tenant_id: int | None  # None: anonymous, with authentication turned off
    tenant_name: str
    key_prefix: str | None
    staff: bool
    partition: str | None  # the tenant's cache partition; None: the shared pool
    requests_per_minute: int | None = None
    prompt_tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    usage_id: str | None = None  # keys the tenant's usage counters (tenants.usage)
    queue_weight: float = 1.0  # its share of a busy platform within a priority band
    default_priority: int = DEFAULT_PRIORITY  # a request's priority when it names none
    max_priority: int = DEFAULT_PRIORITY  # the highest a request may ask for
    allowed_models: frozenset[str] | None = None  # the models it may use; None: every model

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    def cache_salt(self, request_salt: str | None = None) -> int | None:
        """The salt of this caller's cache partition (None: the shared, unsalted pool).

        A tenant's own salt isolates it; tenants that opted into sharing have none, so they
        share with each other. A request's `cache_salt` narrows either one further.
        """
        if self.partition is None and request_salt is None:
            return None
        parts = ("tenant", self.partition or "shared")
        return cache_salt(*parts, *(("request", request_salt) if request_salt is not None else ()))

    @property
    def scope_binding(self) -> str | None:
        """What a session scope is bound to, so one tenant's scope id names nothing of another's."""
        return None if self.tenant_id is None else _binding(self.tenant_id)

    @property
    def label(self) -> str:
        """How logs name the caller: tenant and key prefix, never the key."""
        return f"{self.tenant_name}/{self.key_prefix or '-'}"


def _binding(tenant_id: int) -> str:
    return f"tenant:{tenant_id}"


def tenant_scope_binding(tenant_name: str) -> str | None:
    """The scope binding of a tenant named by an operator (flush_caches --tenant), or None."""
    tenant_id = Tenant.objects.filter(name=tenant_name).values_list("pk", flat=True).first()
    return None if tenant_id is None else _binding(tenant_id)


ANONYMOUS = Caller(tenant_id=None, tenant_name="anonymous", key_prefix=None, staff=False, partition=None)


class KeyRefused(Exception):
    """The presented key opens nothing; the message is safe to show (it never echoes the key)."""


def new_key_parts() -> tuple[str, str]:
    """A fresh (prefix, plaintext key), the prefix unused by any stored key."""
    while True:
        prefix = secrets.token_hex(4)
        if not ApiKey.objects.filter(prefix=prefix).exists():
            return prefix, f"{KEY_PREFIX}{prefix}.{secrets.token_urlsafe(32)}"


def create_api_key(
    tenant: Tenant, name: str, *, staff: bool = False, expires_at: datetime | None = None
) -> tuple[ApiKey, str]:
    """A new key for the tenant; the plaintext is returned once and stored nowhere."""
    prefix, plaintext = new_key_parts()
    key = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        prefix=prefix,
        hashed_key=hash_key(plaintext),
        staff=staff,
        expires_at=expires_at,
    )
    return key, plaintext


def revoke_api_key(key: ApiKey) -> bool:
    """Revoke the key from now on, in every frontend; False if it was revoked already."""
    revoked = ApiKey.objects.filter(pk=key.pk, revoked_at=None).update(revoked_at=timezone.now()) == 1
    if revoked:  # an update() sends no post_save: say it here
        keys_changed()
    return revoked


def caller_for(key: ApiKey) -> Caller:
    return _tenant_caller(key.tenant, key_prefix=key.prefix, staff=key.staff)


def tenant_caller(tenant_name: str) -> Caller:
    """A tenant's caller with no key: what an operator's command (inspect_request --tenant) acts
    as to see the tenant's requests as the router sees them. Tenant.DoesNotExist if none."""
    return _tenant_caller(Tenant.objects.get(name=tenant_name), key_prefix=None, staff=False)


def _tenant_caller(tenant: Tenant, *, key_prefix: str | None, staff: bool) -> Caller:
    return Caller(
        tenant_id=tenant.pk,
        tenant_name=tenant.name,
        key_prefix=key_prefix,
        staff=staff,
        partition=None if tenant.share_prefix_cache else tenant.cache_salt,
        requests_per_minute=tenant.requests_per_minute,
        prompt_tokens_per_minute=tenant.prompt_tokens_per_minute,
        max_concurrent_requests=tenant.max_concurrent_requests,
        usage_id=str(tenant.usage_id),
        queue_weight=tenant.queue_weight,
        default_priority=tenant.default_priority,
        max_priority=tenant.max_priority,
        allowed_models=tenant.allowed_model_names,
    )


def authenticate(presented: str) -> Caller:
    """The caller a presented key stands for; KeyRefused if it stands for nobody."""
    presented = presented.strip()
    shape = _KEY_SHAPE.fullmatch(presented)
    if shape is None:
        raise KeyRefused("Incorrect API key provided.")
    digest = hash_key(presented)
    # Read before the database: a change committed after this read bumps past it, so what the
    # database says below is never kept under a generation that already knew better.
    generation = _generation()
    if generation is not None:
        caller = verified_keys().get(digest, generation)
        if caller is not None:
            note_key_used(shape.group(1))
            return caller
    key = ApiKey.objects.select_related("tenant").filter(prefix=shape.group(1)).first()
    # Compared in constant time, and a missing row costs the same hash as a present one.
    expected = key.hashed_key if key is not None else hash_key("")
    if not hmac.compare_digest(digest, expected) or key is None:
        raise KeyRefused("Incorrect API key provided.")
    refusal = key.refusal()
    if refusal is not None:
        raise KeyRefused(f"The API key sk-{key.prefix}.… was {refusal}.")
    caller = caller_for(key)
    if generation is not None:
        verified_keys().put(digest, generation, caller, key.expires_at)
    note_key_used(key.prefix)
    return caller


async def averified_caller(presented: str, lines: AsyncDirectCommands) -> Caller | None:
    """The caller of a key verified lately under the current generation, the generation read on
    an event loop's own connections (`lines`): no thread, no database. None where only
    `authenticate` can tell (a key not verified lately, no generation from Redis, keeping off)."""
    presented = presented.strip()
    shape = _KEY_SHAPE.fullmatch(presented)
    if shape is None:
        return None
    generation = await _ageneration(lines)
    if generation is None:
        return None
    caller = verified_keys().get(hash_key(presented), generation)
    if caller is not None and use_due(shape.group(1)):  # once a minute: its write in a thread
        await asyncio.to_thread(note_key_used, shape.group(1))
    return caller


GENERATION_KEY = "keys:generation"  # Redis: set anew by every change to a key or a tenant
# The generation is read before each key check: a Redis that does not answer within this makes
# the check ask the database instead, and costs the request no more than this wait (its own
# Redis operations then fail within REDIS_TIMEOUT_SECS, as they would have anyway).
_GENERATION_TIMEOUT_S = 0.25
_GENERATION_RETRY_S = 1.0
_generation_failed: tuple[str, float] = ("", -math.inf)  # the Redis URL a read last failed on, and when


class VerifiedKeys:
    """Callers of keys verified lately, by the key's SHA-256 (never the key), for one generation.

    An entry lives at most `max_age_s`, never past its key's expiry, and only while the
    generation it was verified under is the current one; at most `max_entries` are kept (the
    least recently used go first). Refusals are never kept: a guessed key always costs a query.
    """

    def __init__(self, max_age_s: float, max_entries: int = 4096) -> None:
        self.max_age_s = max_age_s
        self._lock = threading.Lock()  # the generation and what is kept under it change together
        self._generation: bytes | None = None
        self._entries: ExpiringLru[tuple[Caller, datetime | None]] = ExpiringLru(max_entries)

    def get(self, digest: str, generation: bytes) -> Caller | None:
        with self._lock:
            if generation != self._generation:
                self._entries.clear()
                self._generation = generation
                return None
            entry = self._entries.get(digest)
            if entry is None:
                return None
            caller, expires_at = entry
            if expires_at is not None and expires_at <= timezone.now():
                self._entries.pop(digest)
                return None
            return caller

    def put(self, digest: str, generation: bytes, caller: Caller, expires_at: datetime | None) -> None:
        with self._lock:
            if generation != self._generation:
                return  # verified under a generation already gone (or not yet seen): not kept
            self._entries.put(digest, (caller, expires_at), self.max_age_s)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._generation = None


@functools.lru_cache(maxsize=1)
def _verified_keys(max_age_s: float) -> VerifiedKeys:
    return VerifiedKeys(max_age_s)


def verified_keys() -> VerifiedKeys:
    """This process's verified keys (API_KEY_CACHE_SECS)."""
    return _verified_keys(settings.API_KEY_CACHE_SECS)


def _generation() -> bytes | None:
    """The current generation of keys and tenants; None: keep nothing (turned off, or no Redis).

    After a read that failed, the next _GENERATION_RETRY_S do not ask Redis: the API's key checks
    share one thread (inference_platform.api.handler), so a frozen Redis would otherwise cost
    every waiting request its timeout, one after another. None is always safe: the key is then
    checked against the database."""
    if not _generation_worth_asking():
        return None
    try:
        client = sync_client(settings.REDIS_URL, timeout_s=_GENERATION_TIMEOUT_S)
        return read_generation(client, f"{settings.REDIS_KEY_PREFIX}{GENERATION_KEY}")
    except redis.RedisError:
        _generation_read_failed()
        return None


async def _ageneration(lines: AsyncDirectCommands) -> bytes | None:
    """`_generation` on an event loop's own connections, with its timeout and its pause after a
    failed read; None too where Redis holds none yet (`authenticate` makes one)."""
    if not _generation_worth_asking():
        return None
    try:
        async with asyncio.timeout(_GENERATION_TIMEOUT_S):
            return await lines.execute("GET", f"{settings.REDIS_KEY_PREFIX}{GENERATION_KEY}")
    except (redis.RedisError, TimeoutError):
        _generation_read_failed()
        return None


def _generation_worth_asking() -> bool:
    """Keeping is on, and no read of this Redis failed in the last _GENERATION_RETRY_S."""
    if settings.API_KEY_CACHE_SECS <= 0:
        return False
    failed_url, failed_at = _generation_failed
    return failed_url != settings.REDIS_URL or time.monotonic() - failed_at >= _GENERATION_RETRY_S


def _generation_read_failed() -> None:
    global _generation_failed
    _generation_failed = (settings.REDIS_URL, time.monotonic())


def keys_changed() -> None:
    """A key or a tenant changed: every frontend forgets the keys it verified (tenants.apps wires
    this to every save and delete of either; `revoke_api_key` calls it for its update()).

    Announced once the change is committed: a frontend that learned of it earlier could read the
    old row again and keep it under the new generation. This process forgets at once as well.
    """
    _forget_verified()
    transaction.on_commit(_announce_keys_changed)


def _forget_verified() -> None:
    verified_keys().clear()


def _announce_keys_changed() -> None:
    _forget_verified()
    try:
        renew_generation(sync_client(settings.REDIS_URL), f"{settings.REDIS_KEY_PREFIX}{GENERATION_KEY}")
    except redis.RedisError:
        logger.warning(
            "could not tell other frontends that API keys changed (Redis unavailable): they keep "
            "the keys they verified for up to API_KEY_CACHE_SECS=%g s",
            settings.API_KEY_CACHE_SECS,
        )
