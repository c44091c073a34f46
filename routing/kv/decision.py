"""What a routing decision is: its outcome (`RoutingDecision`), what a worker's heartbeat says of
its engine (`WorkerReport`), and the refusals. The router makes decisions and the lease carries
one; both import these types from here, so neither imports the other for them.

Pure: no Redis, no Django.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from routing.kv.selection import Score


class NoEligibleWorker(Exception):
    """No worker can take the request (none live, enabled and compatible)."""


class StaleWorkers(Exception):
    """The key a reserving decision was made conditional on no longer holds the value the caller
    read its workers under (`KvRouter.decide`'s `only_if`): nothing was reserved, and the caller
    reads its workers again before deciding."""


class RequestsWaiting(Exception):
    """Requests wait in the admission queue ahead of this one (the key a reserving decision was
    made unless it exists, `KvRouter.decide`'s `unless_waiting`, does): nothing was reserved, and
    the request joins the queue behind them."""


class AllWorkersBusy(Exception):
    """Every eligible worker is past a busy threshold: the caller answers 503 with Retry-After."""

    def __init__(self, workers: Sequence[str]) -> None:
        self.workers = tuple(workers)
        super().__init__(f"every eligible worker is busy: {', '.join(workers)}")


@dataclass(frozen=True)
class WorkerReport:
    """What a worker's heartbeat says of its engine; None where it reports nothing."""

    capacity_blocks: int = 0
    running_and_waiting: int | None = None
    kv_used_blocks: int | None = None
    prefill_tokens_per_s: float = 0.0  # the engine's measured prefill rate (0: unknown)
    # Whether its engine computes the shortest prompt first (None: it does not say; the policy's
    # `shortest_first_queues` is assumed).
    shortest_first: bool | None = None


@dataclass(frozen=True)
class RoutingDecision:
    worker: str
    overlap: int  # leading blocks the chosen worker holds
    total_blocks: int  # ceil(isl / block_size)
    # DeferredScores from the router, computed when read: every candidate's, or the chosen
    # worker's alone where the decision was asked for no more (KvRouter.decide's `scores`)
    scores: Sequence[Score]
    reason: str  # "cost" | "affinity" | "load-bound" | "only-candidate" | "round_robin" | "random"
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    approximate: bool = False  # the worker publishes no events
    session_key: str | None = None  # scope hash the worker was remembered for
    best_overlap: int = 0  # the largest overlap any eligible, not busy worker had
    busy: tuple[str, ...] = ()  # eligible workers left out as busy

    @property
    def overlap_given_up(self) -> int:
        """Prefix blocks the choice gave up against the best candidate (load, affinity, baseline)."""
        return max(self.best_overlap - self.overlap, 0)
