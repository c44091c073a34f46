"""A queue of requests waiting for a worker, kept in Redis and shared by every frontend process
(the flow control of llm-d's inference gateway, Dynamo's router queue).

Order: priority band first (strictly: a higher band always leaves first), then start-time fair
queuing between tenants within a band, weighted by each tenant's weight (a tenant that floods
gets its share, not the band), then arrival order within a tenant. A weight of 0 queues in plain
arrival order (the baseline the bench compares against).

A request's lifecycle stays with its frontend: the frontend `join`s, polls its `turn`, and when
it is first in line and a worker can take it, decides, sends, and `leave`s with `dispatched`.
Only the entry's own frontend ever removes it as dispatched, and `leave` removes it once, so no
request is dispatched twice. Each frontend keeps a liveness mark (an expiry in
`admq:frontends`, renewed by its waiting requests' polls); the entries of a frontend whose mark
lapsed are swept by the next call of any frontend.

Key families (owned here, named once and given to the Lua in `lua/`):
- `admq:q:<model>\\n<band>` sorted set, member -> start tag; `admq:bands:<model>` its bands;
- `admq:e:<member>` hash: model, band, tenant, frontend;
- `admq:f:<model>\\n<band>` hash: tenant -> last finish tag, '' -> the band's virtual time;
- `admq:depth` hash "model\\ttenant\\tband" -> count; `admq:tenants` "tenant\\tband" (a flow: a tenant's
  requests at one priority, bounded on their own) -> count; `admq:total`;
- `admq:frontends` sorted set, frontend -> liveness expiry (ms); `admq:fe:<frontend>` its members;
- `admq:drained:<model>` sorted set of recent dispatches (the drain rate behind Retry-After);
- `admq:seq` the arrival counter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import redis

from routing.state.lua import LuaScript, lua_constants, lua_script, lua_text
from routing.state.redis_keys import reply_text

if TYPE_CHECKING:
    from routing.state.redis_direct import AsyncDirectCommands

QUEUE_FAMILY = "admq:q:"
BANDS_FAMILY = "admq:bands:"
ENTRY_FAMILY = "admq:e:"
FINISH_FAMILY = "admq:f:"
DEPTH_KEY = "admq:depth"
TENANT_DEPTH_KEY = "admq:tenants"
TOTAL_KEY = "admq:total"
FRONTENDS_KEY = "admq:frontends"
FRONTEND_FAMILY = "admq:fe:"
DRAINED_FAMILY = "admq:drained:"
SEQUENCE_KEY = "admq:seq"

# Request priorities, each a band: 0 (batch) to MAX_PRIORITY; a tenant's requests default to
# DEFAULT_PRIORITY unless the admin says otherwise.
MAX_PRIORITY = 9
DEFAULT_PRIORITY = 4

# The drain rate is the dispatches of the last this many seconds.
DRAIN_WINDOW_S = 10.0

_FUNCTIONS = lua_constants(
    QUEUE_FAMILY=QUEUE_FAMILY,
    BANDS_FAMILY=BANDS_FAMILY,
    ENTRY_FAMILY=ENTRY_FAMILY,
    FINISH_FAMILY=FINISH_FAMILY,
    DEPTH_KEY=DEPTH_KEY,
    TENANT_DEPTH_KEY=TENANT_DEPTH_KEY,
    TOTAL_KEY=TOTAL_KEY,
    FRONTENDS_KEY=FRONTENDS_KEY,
    FRONTEND_FAMILY=FRONTEND_FAMILY,
    DRAINED_FAMILY=DRAINED_FAMILY,
    SEQUENCE_KEY=SEQUENCE_KEY,
) + lua_text(__package__, "admission_functions.lua")


@dataclass(frozen=True)
class QueuedRequest:
    """What the queue needs to know of a request to place it."""

    request_id: str
    model: str
    tenant: str  # the tenant's id, or "anonymous"
    priority: int = 0  # its band: higher leaves first
    weight: float = 1.0  # its tenant's share within the band; 0: arrival order


class Ticket(NamedTuple):
    """A place in the queue, held by the frontend that joined it."""

    member: str
    model: str
    ahead: int  # entries ahead of it when it joined
    drain_per_s: float  # the model's recent dispatches per second when it joined


class QueueFull(Exception):
    """The queue takes no more: `cause` "tenant" (the depth of the tenant's own requests at that
    priority, its flow) or "total"."""

    def __init__(self, cause: str, depth: int, drain_per_s: float) -> None:
        self.cause = cause
        self.depth = depth
        self.drain_per_s = drain_per_s
        super().__init__(f"the admission queue is full ({cause}, {depth} queued)")


class QueueDepth(NamedTuple):
    model: str
    tenant: str
    priority: int
    depth: int


def wait_estimate_s(ahead: int, drain_per_s: float, fallback_s: float) -> int:
    """Whole seconds until `ahead` entries have left at the drain rate (a Retry-After), at least 1;
    `fallback_s` while nothing has drained lately."""
    if drain_per_s <= 0:
        return max(1, math.ceil(fallback_s))
    return max(1, math.ceil((ahead + 1) / drain_per_s))


class AdmissionQueue:
    """The shared queue, for one frontend process (`frontend`: its id, unique per process)."""

    def __init__(self, client: redis.Redis, namespace: str, frontend: str, *, frontend_ttl_s: float) -> None:
        self._namespace = namespace
        self.frontend = frontend
        self._ttl_ms = max(int(frontend_ttl_s * 1000), 1)
        self._window_ms = int(DRAIN_WINDOW_S * 1000)
        self._join = LuaScript(client, lua_script(__package__, "join.lua", _FUNCTIONS))
        self._turn = LuaScript(client, lua_script(__package__, "turn.lua", _FUNCTIONS))
        self._leave = LuaScript(client, lua_script(__package__, "leave.lua", _FUNCTIONS))
        self._depths = LuaScript(client, lua_script(__package__, "depths.lua", _FUNCTIONS))
        self._front = LuaScript(client, lua_script(__package__, "front.lua", _FUNCTIONS))
        self._look = LuaScript(client, lua_script(__package__, "look.lua", _FUNCTIONS))
        self._client = client

    def join(self, request: QueuedRequest, *, max_depth: int, max_tenant_depth: int) -> Ticket:
        """Queue `request` behind what is ahead of it; QueueFull past a bound (nothing queued)."""
        if "\n" in request.model or "\t" in request.model or "\t" in request.tenant:
            raise ValueError("a queued model or tenant name holds no tab or newline")
        if request.weight < 0 or not math.isfinite(request.weight):
            raise ValueError(f"a tenant's weight is finite and >= 0, not {request.weight}")
        joined, what, ahead, drained = self._join(
            self._namespace,
            request.model,
            int(request.priority),
            request.tenant,
            self.frontend,
            request.request_id,
            repr(float(request.weight)),
            int(max_depth),
            int(max_tenant_depth),
            self._ttl_ms,
            self._window_ms,
        )
        drain_per_s = int(drained) / DRAIN_WINDOW_S
        what = reply_text(what)
        if not joined:
            raise QueueFull(what, int(ahead), drain_per_s)
        return Ticket(what, request.model, int(ahead), drain_per_s)

    def turn(self, ticket: Ticket) -> int | None:
        """Entries ahead of the ticket (0: its turn), or None if it is no longer queued."""
        ahead = int(self._turn(self._namespace, ticket.member, self.frontend, self._ttl_ms))
        return None if ahead < 0 else ahead

    def front(self, model: str, count: int) -> list[str]:
        """The members of the first `count` entries of `model`'s order, first in line first; it
        renews this frontend's liveness mark (one call per frontend, for all its waiting requests)."""
        members = self._front(self._namespace, model, self.frontend, self._ttl_ms, int(count))
        return [reply_text(m) for m in members]

    def leave(self, ticket: Ticket, *, dispatched: bool) -> bool:
        """Take the ticket's entry out (at most once: False if it had gone already)."""
        return bool(self._leave(self._namespace, ticket.member, "1" if dispatched else "0", self._window_ms))

    def waiting(self, model: str) -> bool:
        """Whether any request of `model` is queued (a new one then joins behind them)."""
        return bool(self._client.exists(self.waiting_key(model)))

    def waiting_key(self, model: str) -> str:
        """The key that exists while requests of `model` wait (`waiting`): what a decision made
        only while none wait is conditional on (KvRouter.decide's `unless_waiting`)."""
        return f"{self._namespace}{BANDS_FAMILY}{model}"

    def full_for(
        self, model: str, tenant: str, priority: int, *, max_depth: int, max_tenant_depth: int
    ) -> QueueFull | None:
        """Whether a request of `tenant` at `priority` would find the queue full (a look, without
        a sweep), so a flood is shed before the work of preparing it: a tenant with requests queued
        has every new one queued behind them. The drain rate is the model's dispatches kept for the window
        (trimmed by the last join or leave)."""
        look = self._look(self._namespace, model, f"{tenant}\t{int(priority)}")
        return _full(look, max_depth=max_depth, max_tenant_depth=max_tenant_depth)

    async def afull_for(
        self,
        lines: AsyncDirectCommands,
        model: str,
        tenant: str,
        priority: int,
        *,
        max_depth: int,
        max_tenant_depth: int,
    ) -> QueueFull | None:
        """`full_for` on an event loop's own connections (`lines`)."""
        look = await self._look.acall(lines, self._namespace, model, f"{tenant}\t{int(priority)}")
        return _full(look, max_depth=max_depth, max_tenant_depth=max_tenant_depth)

    def depths(self) -> list[QueueDepth]:
        """What is queued, by model, tenant and priority (dead frontends' entries swept first)."""
        flat = self._depths(self._namespace)
        depths = []
        for field, count in zip(flat[::2], flat[1::2], strict=True):
            model, tenant, band = reply_text(field).split("\t")
            depths.append(QueueDepth(model, tenant, int(band), int(count)))
        return depths


def _full(look: Sequence[int], *, max_depth: int, max_tenant_depth: int) -> QueueFull | None:
    """The verdict of look.lua's reply: the flow's depth, the total, the drained count."""
    mine, total, drained = (int(n) for n in look[:3])
    cause = "tenant" if mine >= max_tenant_depth else "total" if total >= max_depth else None
    return None if cause is None else QueueFull(cause, total, drained / DRAIN_WINDOW_S)
