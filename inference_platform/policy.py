"""The routing and media policy in force: the admin's row if an operator saved one, else the
environment's settings. Each process rereads it at most once a second, so an edit in the admin
reaches every frontend within a second, without a restart."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from django.conf import settings

from routing.models import RoutingPolicySettings
from routing.selection import RoutingPolicy

REFRESH_S = 1.0


@dataclass(frozen=True)
class LivePolicy:
    mode: str
    routing: RoutingPolicy
    session_affinity: bool
    frontend_decoding: bool
    source: str  # "admin" or "environment"


def _from_environment() -> LivePolicy:
    return LivePolicy(
        mode=settings.ROUTER_MODE,
        routing=RoutingPolicy(
            overlap_credit=settings.ROUTER_OVERLAP_CREDIT,
            prefill_load_scale=settings.ROUTER_PREFILL_LOAD_SCALE,
            temperature=settings.ROUTER_TEMPERATURE,
        ),
        session_affinity=settings.ROUTER_SESSION_AFFINITY,
        frontend_decoding=settings.DYN_MM_FRONTEND_DECODING,
        source="environment",
    )


def environment_defaults() -> dict[str, object]:
    """Field values of a first policy row: what applies until an operator saves one."""
    policy = _from_environment()
    return {
        "mode": policy.mode,
        "overlap_credit": policy.routing.overlap_credit,
        "prefill_load_scale": policy.routing.prefill_load_scale,
        "temperature": policy.routing.temperature,
        "session_affinity": policy.session_affinity,
        "frontend_decoding": policy.frontend_decoding,
    }


def _from_row(row: RoutingPolicySettings) -> LivePolicy:
    return LivePolicy(
        mode=row.mode,
        routing=RoutingPolicy(
            overlap_credit=row.overlap_credit,
            prefill_load_scale=row.prefill_load_scale,
            temperature=row.temperature,
        ),
        session_affinity=row.session_affinity,
        frontend_decoding=row.frontend_decoding,
        source="admin",
    )


_lock = threading.Lock()
_cached: tuple[float, LivePolicy] | None = None


def current_policy() -> LivePolicy:
    """The policy now (synchronous: call it from a thread in async code)."""
    global _cached
    now = time.monotonic()
    with _lock:
        if _cached is not None and now < _cached[0]:
            return _cached[1]
    row = RoutingPolicySettings.objects.filter(pk=1).first()
    policy = _from_row(row) if row is not None else _from_environment()
    with _lock:
        _cached = (now + REFRESH_S, policy)
    return policy


def forget_cached_policy() -> None:
    """Drop this process's copy (the admin calls it on save, so its own process sees it at once)."""
    global _cached
    with _lock:
        _cached = None
