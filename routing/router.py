"""The KV-aware router: overlap from the index and load from the tracker, scored, one worker chosen.

`route` reads overlaps, load and session affinity in one pipelined round trip (a Lua script,
then the load totals) and decides;
`dispatch` records the decision (load, approximate blocks, affinity) once the request was
actually sent, so a failed send leaves no phantom load behind.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import redis

from routing.affinity import SessionAffinity
from routing.index import (
    DEFAULT_APPROXIMATE_TTL_S,
    INDEX_LUA_FUNCTIONS,
    OVERLAPS_LUA_FUNCTIONS,
    KvIndex,
    LuaScript,
    checked_workers,
    execute_pipeline,
    pack_hashes,
)
from routing.load import SWEEP_LUA_FUNCTIONS, LoadTracker
from routing.selection import RoutingPolicy, Score, score_workers, select_worker

# Embeds the index's and the load tracker's own Lua, so each key family is still read by the
# code of the module that owns it.
_DECISION_LUA = (
    INDEX_LUA_FUNCTIONS
    + OVERLAPS_LUA_FUNCTIONS
    + SWEEP_LUA_FUNCTIONS
    + """
-- ARGV: ns, packed block hashes, affinity key or '', worker...
-- The load totals are read by the HGETALLs pipelined right after this script, once it swept.
load_sweep(ARGV[1])
local sticky = false
if ARGV[3] ~= '' then sticky = redis.call('GET', ARGV[3]) end
return {{overlaps}(ARGV[1], ARGV[2], {unpack(ARGV, 4)}), sticky}
"""
)


class NoEligibleWorker(Exception):
    """No worker can take the request (none live, enabled and compatible)."""


@dataclass(frozen=True)
class RoutingDecision:
    worker: str
    overlap: int  # leading blocks the chosen worker holds
    total_blocks: int  # ceil(isl / block_size)
    scores: list[Score]
    reason: str  # "cost" | "affinity" | "only-candidate"
    block_hashes: tuple[int, ...] = field(default=(), repr=False)
    approximate: bool = False  # the worker publishes no events: dispatch records its blocks
    session_key: str | None = None  # scope hash to remember the worker for


class KvRouter:
    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        *,
        index: KvIndex,
        load: LoadTracker,
        affinity: SessionAffinity | None = None,
        logger: logging.Logger | None = None,
        approximate_ttl_s: float = DEFAULT_APPROXIMATE_TTL_S,
    ) -> None:
        if index.namespace != namespace or load.namespace != namespace:
            raise ValueError("the router, its index and its load tracker must share one namespace")
        self._client = client
        self._namespace = namespace
        self._decision = LuaScript(client, _DECISION_LUA.replace("{overlaps}", index.overlaps_function))
        self._index = index
        self._load = load
        self._affinity = affinity
        self._logger = logger or logging.getLogger("routing")
        self._approximate_ttl_s = approximate_ttl_s
        self._rng = random.Random()

    @property
    def index(self) -> KvIndex:
        return self._index

    @property
    def load(self) -> LoadTracker:
        return self._load

    def route(
        self,
        block_hashes: Sequence[int],
        isl: int,
        block_size: int,
        workers: Sequence[str],
        policy: RoutingPolicy,
        *,
        session_key: str | None = None,
        affinity_enabled: bool = True,
        approximate_workers: Collection[str] = (),
        rng: random.Random | None = None,
    ) -> RoutingDecision:
        """Choose the worker for a request; records nothing (see `dispatch`)."""
        eligible = list(dict.fromkeys(workers))
        if not eligible:
            raise NoEligibleWorker("no eligible worker")
        total_blocks = -(-isl // block_size)
        use_affinity = bool(affinity_enabled and session_key and self._affinity is not None)

        affinity_key = self._affinity.key(session_key) if use_affinity else ""  # type: ignore[union-attr, arg-type]
        pipe = self._client.pipeline(transaction=False)
        self._decision.queue(
            pipe, self._namespace, pack_hashes(block_hashes), affinity_key, *checked_workers(eligible)
        )
        self._load.queue_totals(pipe, with_requests=False)
        (overlaps, sticky_reply), *totals = execute_pipeline(pipe, [self._decision])
        prefill_tokens, decode_blocks = LoadTracker.totals_columns(totals, eligible)
        sticky = SessionAffinity.parse(sticky_reply) if use_affinity else None
        scores = score_workers(eligible, overlaps, prefill_tokens, decode_blocks, isl, block_size, policy)
        if sticky is not None and sticky in eligible:
            chosen, reason = scores[eligible.index(sticky)], "affinity"
        elif len(scores) == 1:
            chosen, reason = scores[0], "only-candidate"
        else:
            chosen, reason = select_worker(scores, policy, rng or self._rng), "cost"

        if self._logger.isEnabledFor(logging.DEBUG):
            for s in scores:
                self._logger.debug(
                    "[ROUTING] Formula for worker_%s: cost=%.3f = %.3f * prefill_blocks %.3f"
                    " + decode_blocks %.3f (overlap %d/%d)",
                    s.worker,
                    s.cost,
                    policy.prefill_load_scale,
                    s.prefill_blocks,
                    s.decode_blocks,
                    s.overlap,
                    total_blocks,
                )
            self._logger.debug(
                "[ROUTING] Best: worker_%s with %d/%d blocks overlap",
                chosen.worker,
                chosen.overlap,
                total_blocks,
            )
        return RoutingDecision(
            worker=chosen.worker,
            overlap=chosen.overlap,
            total_blocks=total_blocks,
            scores=scores,
            reason=reason,
            block_hashes=tuple(block_hashes),
            approximate=chosen.worker in approximate_workers,
            session_key=session_key if use_affinity else None,
        )

    def dispatch(self, decision: RoutingDecision, request_id: str, isl: int, block_size: int) -> None:
        """Count the request against its worker; called after the send succeeded.

        Prefill tokens are the ones the worker must still compute (the cached prefix is
        skipped); blocks are all of the prompt's, resident until the request is freed.
        """
        prefill_tokens = max(isl - decision.overlap * block_size, 0)
        self._load.add(decision.worker, request_id, prefill_tokens, decision.total_blocks)
        if decision.approximate:
            self._index.record_routed(decision.worker, decision.block_hashes, self._approximate_ttl_s)
        if decision.session_key is not None and self._affinity is not None:
            self._affinity.set(decision.session_key, decision.worker)
