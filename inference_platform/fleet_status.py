"""Whether any worker takes new requests for a model, and if none, why.

The 503 a request gets, `/ready` and the admin's banner all read `fleet_availability`, so they
never disagree: a fleet an operator drained is not reported as "no live worker", and a draining
worker that still beats is live, it just takes nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis
from asgiref.sync import async_to_sync
from django.conf import settings
from django.http import HttpRequest

from inference_platform.serving.dispatch import worker_states
from inference_platform.serving.errors import ApiError

# Held back on purpose, by an operator or by a worker's own shutdown: waiting (a drain ended, a
# restarted worker) helps, and an operator can end it at once.
HELD_BACK = ("draining", "disabled in the admin", "shutting down")
# What a client is told to wait before trying again when no worker takes requests: about what a
# worker takes to restart after a drain, or to register after its start.
RETRY_AFTER_S = 15


@dataclass(frozen=True)
class Availability:
    model: str
    accepting: tuple[str, ...]
    # Live workers of the model that take nothing new, by why (HELD_BACK's words).
    held_back: dict[str, tuple[str, ...]] = field(default_factory=dict)
    down: tuple[str, ...] = ()  # registered, no heartbeat
    live: int = 0  # workers with a heartbeat that serve this model, accepting or not

    @property
    def reason(self) -> str:
        """Why no worker takes requests, naming the workers (empty while one does)."""
        if self.accepting:
            return ""
        parts = [f"{', '.join(names)} {why}" for why, names in self.held_back.items()]
        if self.held_back:
            what_to_do = []
            if set(self.held_back) - {"shutting down"}:
                what_to_do.append("in the admin, Workers: 'Enable and stop draining' ends a drain")
            if "shutting down" in self.held_back:
                what_to_do.append("a worker shutting down takes requests again once restarted")
            return (
                f"No worker takes new requests for '{self.model}': {'; '.join(parts)} "
                f"({'; '.join(what_to_do)})"
            )
        down = f" (registered but down: {', '.join(self.down)})" if self.down else ""
        return f"No live worker serves '{self.model}' right now{down}"

    @property
    def summary(self) -> str:
        """The reason in counts, without names: what `/ready` may tell anyone."""
        if self.accepting:
            return ""
        if self.held_back:
            return f"{self.live} live worker(s), none taking new requests (draining, disabled or stopping)"
        return "no live worker"


async def fleet_availability(model: str, block_size: int) -> Availability:
    """Which workers take requests for this model now, and why the others do not."""
    accepting, down, live = [], [], 0
    held_back: dict[str, list[str]] = {}
    for state in await worker_states(model, block_size):
        if state.heartbeat is None:
            down.append(state.name)
            continue
        if state.heartbeat.model != model:
            continue  # another model's worker: not this model's fleet
        live += 1
        if state.ineligible_because is None:
            accepting.append(state.name)
        elif state.ineligible_because in HELD_BACK:
            held_back.setdefault(state.ineligible_because, []).append(state.name)
    return Availability(
        model=model,
        accepting=tuple(accepting),
        held_back={why: tuple(names) for why, names in held_back.items()},
        down=tuple(down),
        live=live,
    )


async def no_worker_error(model: str, block_size: int, request_id: str) -> ApiError:
    """The 503 for a request no worker takes: why, naming the workers, and when to retry."""
    availability = await fleet_availability(model, block_size)
    return ApiError(
        503,
        f"{availability.reason}; retry request {request_id} in {RETRY_AFTER_S} s.",
        code="no_worker_accepting" if availability.held_back else "no_live_worker",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def fleet_banner(request: HttpRequest) -> dict[str, str]:
    """Context processor: on the staff's admin pages, a banner while no worker takes requests."""
    if not request.path.startswith("/admin/") or not getattr(request.user, "is_staff", False):
        return {}
    from inference_platform.serving.frontend import frontend
    from inference_platform.serving.model_pool import deployment_model_name

    try:
        names = sorted({*frontend().models().rows(), deployment_model_name()})
        fleets = [async_to_sync(fleet_availability)(name, settings.KV_BLOCK_SIZE) for name in names]
    except redis.RedisError:
        return {}  # the pages say Redis is down where it matters
    if any(fleet.accepting for fleet in fleets):
        return {}
    reasons = "; ".join(fleet.reason for fleet in fleets if fleet.live or fleet.down) or fleets[0].reason
    banner = f"{reasons}. Requests get 503 with Retry-After until one does."
    return {"no_worker_accepting": banner}
