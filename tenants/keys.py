"""API keys: made, checked and revoked here, and only here.

A key reads `sk-<prefix>.<secret>`: the prefix (8 hex characters) finds the row, the SHA-256 of
the whole key must match the stored one. A slow password hash buys nothing for 190 random bits
and would cost every request; the database never holds anything that opens the API.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

from django.utils import timezone

from routing.hashing import cache_salt
from tenants.models import ApiKey, Tenant

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
    """Revoke the key from now on; False if it was revoked already."""
    return ApiKey.objects.filter(pk=key.pk, revoked_at=None).update(revoked_at=timezone.now()) == 1


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
    )


def authenticate(presented: str) -> Caller:
    """The caller a presented key stands for; KeyRefused if it stands for nobody."""
    shape = _KEY_SHAPE.fullmatch(presented.strip())
    if shape is None:
        raise KeyRefused("Incorrect API key provided.")
    key = ApiKey.objects.select_related("tenant").filter(prefix=shape.group(1)).first()
    # Compared in constant time, and a missing row costs the same hash as a present one.
    expected = key.hashed_key if key is not None else hash_key("")
    if not hmac.compare_digest(hash_key(presented.strip()), expected) or key is None:
        raise KeyRefused("Incorrect API key provided.")
    refusal = key.refusal()
    if refusal is not None:
        raise KeyRefused(f"The API key sk-{key.prefix}.… was {refusal}.")
    return caller_for(key)
