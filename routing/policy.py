"""The routing and media policy in force: the admin's row if an operator saved one, else the
environment's settings. Each process rereads it at most once a second, so an edit in the admin
reaches every frontend within a second, without a restart. A model may set its own routing fields
(`ModelPolicy`, from its row); those it leaves empty follow this one."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from routing.kv.selection import RoutingPolicy
from routing.models import RoutingPolicySettings

REFRESH_S = 1.0


@dataclass(frozen=True)
class LivePolicy:
    mode: str
    routing: RoutingPolicy
    session_affinity: bool
    frontend_decoding: bool
    source: str  # "admin" or "environment"


@dataclass(frozen=True)
class ModelPolicy:
    """A model's own routing policy (routing.models.Model): each field None (or "") follows the
    deployment's live policy."""

    mode: str = ""
    overlap_credit: float | None = None
    prefill_load_scale: float | None = None
    temperature: float | None = None

    def over(self, live: LivePolicy) -> LivePolicy:
        """The live policy with this model's own values in place of the deployment's."""
        routing = {
            field: value
            for field, value in (
                ("overlap_credit", self.overlap_credit),
                ("prefill_load_scale", self.prefill_load_scale),
                ("temperature", self.temperature),
            )
            if value is not None
        }
        if not routing and not self.mode:
            return live
        return dataclasses.replace(
            live, mode=self.mode or live.mode, routing=dataclasses.replace(live.routing, **routing)
        )


# A model that sets none of its own: the deployment's policy in every field.
DEPLOYMENT_POLICY = ModelPolicy()


def environment_defaults() -> dict[str, Any]:
    """Field values of a first policy row: what applies until an operator saves one."""
    return {
        "mode": settings.ROUTER_MODE,
        "overlap_credit": settings.ROUTER_OVERLAP_CREDIT,
        "prefill_load_scale": settings.ROUTER_PREFILL_LOAD_SCALE,
        "temperature": settings.ROUTER_TEMPERATURE,
        "session_affinity": settings.ROUTER_SESSION_AFFINITY,
        "frontend_decoding": settings.DYN_MM_FRONTEND_DECODING,
    }


def _policy(values: dict[str, Any], source: str) -> LivePolicy:
    return LivePolicy(
        mode=values["mode"],
        routing=RoutingPolicy(
            overlap_credit=values["overlap_credit"],
            prefill_load_scale=values["prefill_load_scale"],
            temperature=values["temperature"],
            affinity_cost_slack=settings.ROUTER_AFFINITY_COST_SLACK,
            affinity_max_overlap_lead=settings.ROUTER_AFFINITY_MAX_OVERLAP_LEAD_BLOCKS,
            load_bound_gap=settings.ROUTER_LOAD_BOUND_GAP,
            load_bound_ratio=settings.ROUTER_LOAD_BOUND_RATIO,
            shortest_first_queues=settings.ENGINE_SCHEDULE_POLICY == "shortest_first",
            busy_max_requests=settings.ROUTER_BUSY_MAX_REQUESTS,
            busy_kv_fraction=settings.ROUTER_BUSY_KV_FRACTION,
            prefill_drain=settings.ROUTER_PREFILL_DRAIN,
        ),
        session_affinity=values["session_affinity"],
        frontend_decoding=values["frontend_decoding"],
        source=source,
    )


_lock = threading.Lock()
_cached: tuple[float, LivePolicy] | None = None


def _fresh_copy(now: float) -> LivePolicy | None:
    """This process's copy of the policy while it is fresh, else None."""
    with _lock:
        if _cached is not None and now < _cached[0]:
            return _cached[1]
    return None


def current_policy() -> LivePolicy:
    """The policy now (synchronous: call it from a thread in async code)."""
    global _cached
    now = time.monotonic()
    fresh = _fresh_copy(now)
    if fresh is not None:
        return fresh
    row = RoutingPolicySettings.objects.filter(pk=1).values(*environment_defaults()).first()
    policy = _policy(row, "admin") if row is not None else _policy(environment_defaults(), "environment")
    with _lock:
        _cached = (now + REFRESH_S, policy)
    return policy


async def acurrent_policy() -> LivePolicy:
    """`current_policy` from async code: this process's copy while it is fresh (nearly always),
    else read in a thread."""
    fresh = _fresh_copy(time.monotonic())
    if fresh is not None:
        return fresh
    return await asyncio.to_thread(current_policy)


def forget_cached_policy() -> None:
    """Drop this process's copy (the admin calls it on save, so its own process sees it at once)."""
    global _cached
    with _lock:
        _cached = None
