"""The deployment's identity, and the Redis prefix of everything it counts.

Live state (heartbeats, the KV index, load, the broker) is keyed by `REDIS_KEY_PREFIX` alone: it
expires or is rebuilt, and processes of one deployment must find each other's. What is counted
and kept (telemetry, cache hit counters, tenant usage) is keyed by `statistics_namespace()`,
which adds the id of the deployment's database (`routing.models.Deployment`): two databases on
one Redis never add to, or read, each other's figures, and `reset_stats` can clear one
deployment's figures without touching another's.
"""

from __future__ import annotations

import secrets
import threading

from django.conf import settings
from django.db import IntegrityError, transaction

STATISTICS_FAMILY = "dep:"

_lock = threading.Lock()
_known: dict[str, str] = {}  # database alias -> deployment id, read once per process


def deployment_id(using: str = "default") -> str:
    """This database's deployment id, made (and stored) the first time any process asks."""
    with _lock:
        known = _known.get(using)
        if known is not None:
            return known
    from routing.models import Deployment

    row = Deployment.objects.using(using).order_by("pk").first()
    if row is None:
        try:
            with transaction.atomic(using=using):
                row = Deployment.objects.using(using).create(pk=1, deployment_id=secrets.token_hex(6))
        except IntegrityError:  # another process made it first: theirs is the id
            row = Deployment.objects.using(using).get(pk=1)
    with _lock:
        _known[using] = row.deployment_id
    return row.deployment_id


def statistics_namespace(using: str = "default") -> str:
    """The Redis prefix of this deployment's counters: `<REDIS_KEY_PREFIX>dep:<id>:`."""
    return _namespace_of(deployment_id(using))


def known_statistics_namespace(using: str = "default") -> str | None:
    """`statistics_namespace` if this process has read the deployment id already, else None
    (for a caller on an event loop, which must not read the database)."""
    with _lock:
        known = _known.get(using)
    return None if known is None else _namespace_of(known)


def _namespace_of(deployment: str) -> str:
    return f"{settings.REDIS_KEY_PREFIX}{STATISTICS_FAMILY}{deployment}:"


def forget_deployment_id() -> None:
    """Read the id from the database again at next use (tests swap databases under a process)."""
    with _lock:
        _known.clear()


def statistics_keys(client, namespace: str, *, keep_families: tuple[str, ...] = ()) -> list[bytes]:
    """Every key under a deployment's statistics namespace, but those of `keep_families`.

    `client` is a redis.Redis. A SCAN (not KEYS): the Redis may hold millions of index keys.
    """
    pattern = "".join("\\" + c if c in "*?[]\\" else c for c in namespace) + "*"
    kept = tuple(f"{namespace}{family}".encode() for family in keep_families)
    return [key for key in client.scan_iter(match=pattern, count=1000) if not key.startswith(kept)]
