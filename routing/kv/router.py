"""The KV-aware router: overlap from the index and load from the tracker, scored, one worker chosen.

A decision is one Lua script, one round trip: it sweeps expired load, reads every candidate's
overlap (index and predicted blocks) and load, drops the busy ones, applies the load bound and
the bounded session affinity, chooses, and, when asked to (`decide`), reserves the request's load
on the chosen worker, records its blocks as predicted there, and remembers the session's worker,
all in the same atomic step. Two frontend processes deciding at the same instant therefore see each
other's reservations: requests with different prefixes spread over idle workers instead of
piling onto the one that looked idle to both.

`route` is the same decision without the writes (`/v1/route`, the benches); `decide` returns a
`RequestLease` (routing.kv.lease), the one owner of the request's load from then on.

The cost is `selection.score_workers`'s, computed again in Lua from the same numbers; the
scores returned for display and logs are Python's, from the numbers the script read, computed
only if something reads them.

Prefill drain: a worker's reserved prefill is what is left of it at the rate the worker's engine
measures (`WorkerReport.prefill_tokens_per_s`), not all of it until the first token; the script
keeps when each worker's reserved prompts should be done (in the worker's `load:totals` field,
routing.kv.load) and the prefill column it returns is the drained one, so the scores shown are the
ones it chose by.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import random
import struct
from collections.abc import Collection, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import redis

from routing.fleet.registry import ROUND_ROBIN_KEY
from routing.kv.affinity import SessionAffinity
from routing.kv.decision import (
    AllWorkersBusy,
    NoEligibleWorker,
    RequestsWaiting,
    RoutingDecision,
    StaleWorkers,
    WorkerReport,
)
from routing.kv.index import (
    DEFAULT_APPROXIMATE_TTL_S,
    INDEX_LUA_FUNCTIONS,
    OVERLAPS_LUA_FUNCTIONS,
    KvIndex,
    checked_workers,
    overlaps_choice,
    pack_hashes,
)
from routing.kv.lease import RequestLease
from routing.kv.load import SWEEP_LUA_FUNCTIONS, LoadTracker
from routing.kv.replica import IndexReplica, ReplicaFleet
from routing.kv.selection import DeferredScores, RoutingPolicy, Score, score_workers
from routing.state.lua import LuaScript, lua_constants, lua_script
from routing.state.pacing import pause_point
from routing.state.redis_direct import AsyncDirectCommands
from routing.state.redis_keys import reply_text

DEFAULT_PREDICTED_TTL_S = 3.0  # Dynamo's --router-predicted-ttl-secs is of this order
# Above this many eligible workers a decision weighs candidates, not the whole fleet
# (KvRouter._decide_among): at most HOLDERS_PER_PREFIX holders per cached prefix length, and
# LOAD_SAMPLE workers drawn at random. At or below it, every worker, exactly as before.
CANDIDATES_ABOVE = 64
PACKED_KEPT = 3  # fleet reads whose packed arguments a router keeps (KvRouter._packed)
HOLDERS_PER_PREFIX = 16
LOAD_SAMPLE = 16
MODES = ("kv", "round_robin", "random")
STALE = (b"stale", "stale")  # the decision script's reason when its `only_if` key moved
WAITING = (b"waiting", "waiting")  # its reason when its `unless_waiting` key exists
# its reasons when the fleet read's facts are gone, or their places (and maybe the facts too)
NO_FLEET_FACTS = (b"nofleet", "nofleet", b"noplaces", "noplaces")
NO_FLEET_PLACES = (b"noplaces", "noplaces")
# `fleet:facts:<digest>`: a fleet read's facts, for decisions among a large fleet's candidates:
# each eligible worker's record (FACTS_FORMAT), one string of them in the read's order; and
# `fleet:places:<digest of the names>`, each eligible worker's place in that order, by name. Named
# by digests of what they hold, so frontends that read the same share them; the router that wrote
# them unlinks them when it writes the next, and they expire in any case. Two keys, because the
# records move with every load a heartbeat reports and the places only when the fleet does: a
# thousand records are one SET of a 22 kB string (~4 us of Redis's one thread here), where a hash
# of them by name was an HSET of a thousand fields (~1.6 ms), written by each frontend at each read
# of a loaded fleet while every frontend's decisions waited behind it.
FLEET_FACTS_FAMILY = "fleet:facts:"
FLEET_PLACES_FAMILY = "fleet:places:"
FLEET_FACTS_TTL_MS = 60_000
# kv capacity, running + waiting (-1: none), kv in use (-1: none), prefill rate (tokens/s, as
# reported: 0 for none), b"1" if its engine computes the shortest prompt first else b"0", 1 if
# it is an approximate worker: the same format in Python and in the decision script.
FACTS_FORMAT = ">iiidBB"
FACTS_FORMAT_LUA = ">i4i4i4dBB"


# Embeds the index's and the load tracker's own Lua, so each key family is still read and
# written by the code of the module that owns it (kv_store / adjust / load_sweep ...); the overlap
# variant is the index's, chosen in `KvRouter.__init__`.
def _decision_lua(index: KvIndex) -> str:
    return lua_script(
        __package__,
        "decision.lua",
        lua_constants(FACTS_FORMAT=FACTS_FORMAT_LUA),
        INDEX_LUA_FUNCTIONS,
        OVERLAPS_LUA_FUNCTIONS,
        overlaps_choice(index.overlaps_function),
        SWEEP_LUA_FUNCTIONS,
    )


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
        predicted_ttl_s: float = DEFAULT_PREDICTED_TTL_S,
        replica: IndexReplica | None = None,
    ) -> None:
        """replica: this process's copy of the index (routing.kv.replica), which a large fleet's
        decisions find their candidates in while it is `ready` (else in Redis, as without one);
        the router starts it on its first such decision."""
        if index.namespace != namespace or load.namespace != namespace:
            raise ValueError("the router, its index and its load tracker must share one namespace")
        self._client = client
        self._namespace = namespace
        self._decision = LuaScript(client, _decision_lua(index))
        self._index = index
        self._load = load
        self._affinity = affinity
        self._logger = logger or logging.getLogger("routing")
        self._approximate_ttl_ms = max(int(approximate_ttl_s * 1000), 1)
        self._predicted_ttl_ms = max(int(predicted_ttl_s * 1000), 0)
        self._rng = random.Random()
        # The last fleet reads packed, newest last: a frontend's background re-read packs the
        # new read while requests still decide on the one before, and the request that first
        # uses either must find it packed (packing a thousand workers takes milliseconds).
        # (A tuple, replaced whole: a background thread adds to it while requests look in it.)
        self._recent_packed: tuple[_PackedWorkers, ...] = ()
        # The keys of the facts (and of the places) this router wrote last, newest last: the
        # newest read's and the one before, which requests still decide on while the newest is
        # being prepared.
        self._facts_written: list[str] = []
        self._places_written: list[str] = []
        self.candidates_above = CANDIDATES_ABOVE
        self._replica = replica
        self._policy_kept: tuple[RoutingPolicy, tuple[object, ...]] | None = None

    @property
    def index(self) -> KvIndex:
        return self._index

    @property
    def load(self) -> LoadTracker:
        return self._load

    @property
    def replica(self) -> IndexReplica | None:
        return self._replica

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
        reports: Mapping[str, WorkerReport] | None = None,
        mode: str = "kv",
        rng: random.Random | None = None,
    ) -> RoutingDecision:
        """The decision for a request, without reserving anything (see `decide`)."""
        return self._drive(
            self._steps(
                block_hashes,
                isl,
                block_size,
                workers,
                policy,
                request_id="",
                session_key=session_key,
                affinity_enabled=affinity_enabled,
                approximate_workers=approximate_workers,
                reports=reports,
                mode=mode,
                rng=rng,
            )
        )

    def decide(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        isl: int,
        block_size: int,
        workers: Sequence[str],
        policy: RoutingPolicy,
        *,
        instances: Mapping[str, str] | None = None,
        reservation_ttl_s: float | None = None,
        only_if: tuple[str, bytes] | None = None,
        scores: bool = True,
        **options: Any,
    ) -> RequestLease:
        """Decide and reserve in one atomic step; the lease frees the reservation exactly once.

        reservation_ttl_s: the reservation's expiry until the lease renews it (None: the load
        tracker's entry TTL). AllWorkersBusy when every eligible worker is past a busy threshold
        (nothing reserved). only_if: (key, value): decide only while that Redis key holds that
        value, checked in the same atomic step (a frontend's fleet read is checked against the
        rows' generation there instead of with a round trip of its own before); StaleWorkers
        when it does not (nothing reserved). unless_waiting (an option): a key whose existence
        means requests wait ahead of this one (the admission queue's, routing.admission), checked
        in the same atomic step; RequestsWaiting when it exists (nothing reserved). scores=False:
        the decision's `scores` hold the chosen worker's alone (unless the debug log wants them
        all), which is all a request being dispatched reads, and Redis then builds and sends none
        of the others. `options`: those of `route` (session_key, affinity_enabled,
        approximate_workers, reports, mode, rng).
        """
        options["scores"] = scores  # to _steps, with route's options
        steps = self._reserving(
            request_id, block_hashes, isl, block_size, workers, policy, reservation_ttl_s, only_if, options
        )
        return self._lease(request_id, self._drive(steps), instances)

    async def adecide(
        self,
        lines: AsyncDirectCommands,
        request_id: str,
        block_hashes: Sequence[int],
        isl: int,
        block_size: int,
        workers: Sequence[str],
        policy: RoutingPolicy,
        *,
        instances: Mapping[str, str] | None = None,
        reservation_ttl_s: float | None = None,
        only_if: tuple[str, bytes] | None = None,
        scores: bool = True,
        **options: Any,
    ) -> RequestLease:
        """`decide` on the running event loop: its round trip goes on `lines`, this loop's own
        connections, so a request's decision hands nothing to a thread and back (a hand-over
        cost a decision ~120 us on a 2-core machine, more than the round trip itself)."""
        options["scores"] = scores  # to _steps, with route's options
        steps = self._reserving(
            request_id, block_hashes, isl, block_size, workers, policy, reservation_ttl_s, only_if, options
        )
        return self._lease(request_id, await self._adrive(steps, lines), instances)

    def _reserving(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        isl: int,
        block_size: int,
        workers: Sequence[str],
        policy: RoutingPolicy,
        reservation_ttl_s: float | None,
        only_if: tuple[str, bytes] | None,
        options: dict[str, Any],
    ) -> _Steps:
        if not request_id:
            raise ValueError("a reservation needs a request id")
        return self._steps(
            block_hashes,
            isl,
            block_size,
            workers,
            policy,
            request_id=request_id,
            reservation_ttl_ms=None if reservation_ttl_s is None else max(int(reservation_ttl_s * 1000), 1),
            only_if=only_if,
            **options,
        )

    def _lease(
        self, request_id: str, decision: RoutingDecision, instances: Mapping[str, str] | None
    ) -> RequestLease:
        return RequestLease(
            self._load,
            request_id=request_id,
            decision=decision,
            instance=(instances or {}).get(decision.worker, ""),
        )

    def _drive(self, steps: _Steps) -> RoutingDecision:
        """Runs a decision's steps here: each script call on this thread's direct line."""
        reply: Any = None
        try:
            while True:
                step = steps.send(reply)
                reply = self._write_facts(step) if isinstance(step, _PackedWorkers) else self._decision(*step)
        except StopIteration as done:
            return done.value

    async def _adrive(self, steps: _Steps, lines: AsyncDirectCommands) -> RoutingDecision:
        """Runs a decision's steps on the event loop: script calls on `lines`; writing a fleet
        read's facts (rare: its decisions found them gone) in a thread."""
        reply: Any = None
        try:
            while True:
                step = steps.send(reply)
                if isinstance(step, _PackedWorkers):
                    reply = await asyncio.to_thread(self._write_facts, step)
                else:
                    reply = await self._decision.acall(lines, *step)
        except StopIteration as done:
            return done.value

    def _steps(
        self,
        block_hashes: Sequence[int],
        isl: int,
        block_size: int,
        workers: Sequence[str],
        policy: RoutingPolicy,
        *,
        request_id: str,
        session_key: str | None = None,
        affinity_enabled: bool = True,
        approximate_workers: Collection[str] = (),
        reports: Mapping[str, WorkerReport] | None = None,
        mode: str = "kv",
        rng: random.Random | None = None,
        reservation_ttl_ms: int | None = None,
        only_if: tuple[str, bytes] | None = None,
        unless_waiting: str | None = None,
        scores: bool = True,
    ) -> _Steps:
        """A decision as the steps it takes, none of which waits on Redis itself: it yields each
        script call's arguments (or a fleet read whose facts to write) and is sent the reply,
        so one sequence serves both the thread that calls `decide` (`_drive`) and the event loop
        that awaits `adecide` (`_adrive`)."""
        packed = self._packed(workers, reports, approximate_workers, policy)
        eligible = packed.eligible
        if not eligible:
            raise NoEligibleWorker("no eligible worker")
        if mode not in MODES:
            raise ValueError(f"routing mode {mode!r} is not one of {', '.join(MODES)}")
        if block_size < 1 or isl < 0:
            raise ValueError(f"invalid request size: isl {isl}, block size {block_size}")
        total_blocks = -(-isl // block_size)
        use_affinity = bool(affinity_enabled and session_key and self._affinity is not None and mode == "kv")
        affinity_key = self._affinity.key(session_key) if use_affinity else ""  # type: ignore[union-attr, arg-type]
        approximate = packed.approximate
        args: list[object] = [
            self._namespace,
            pack_hashes(block_hashes),
            affinity_key,
            request_id,
            isl,
            block_size,
            *self._policy_args(policy),
            mode,
            repr((rng or self._rng).random()),
            reservation_ttl_ms or self._load.entry_ttl_ms,
            self._predicted_ttl_ms,
            self._approximate_ttl_ms,
            self._affinity.ttl_ms if self._affinity is not None else 1,
            ROUND_ROBIN_KEY,
        ]
        condition = only_if or ("", b"")
        # '1': the chosen worker's figures alone (the script's ARGV 36), unless the debug log
        # below reads every candidate's.
        brief = "" if scores or self._logger.isEnabledFor(logging.DEBUG) else "1"
        tail = (brief, unless_waiting or "")  # ARGV 36 and 37
        reply = None
        if mode == "kv" and len(eligible) > self.candidates_above:
            # A large fleet: the script weighs candidates, not every worker (`_decide_among`);
            # only when none of them can take the request does it look at the whole fleet.
            draw = rng or self._rng
            sample = _positions(draw, len(eligible), LOAD_SAMPLE)
            replica = self._replica
            found = None
            if replica is not None and replica.ready:
                found = replica.candidates(
                    block_hashes, self._replica_fleet(replica, packed), HOLDERS_PER_PREFIX, sample, draw
                )
            elif replica is not None:
                replica.start()
            if found is not None:
                reply = yield from self._decide_given(args, packed, policy, condition, found, tail)
            else:  # no replica, or its bits moved just now: Redis's index
                sample_names = [eligible[position] for position in sample]
                reply = yield from self._decide_among(args, packed, policy, condition, sample_names, tail)
            self._check_fresh(reply, only_if)
            if not reply[0]:
                reply = None
        if reply is None:
            reply = yield self._over_args(args, packed, policy, condition, tail)
            self._check_fresh(reply, only_if)
        chosen_at, reason, best_overlap, *packed_columns, busy_at, weighed = reply
        # A large fleet's candidates, those weighed, as the script names them: decoded where read
        # (most are read only if something asks for the scores). A brief reply names the chosen
        # worker and the busy ones alone, as if they had been all those weighed.
        names: Sequence[str | bytes] = weighed or eligible
        overlaps, prefill, decode = (_integers(column) for column in packed_columns)
        busy = tuple(reply_text(names[j - 1]) for j in busy_at)
        if not chosen_at:
            raise AllWorkersBusy(list(map(reply_text, names)))
        chosen = reply_text(names[chosen_at - 1])
        reason = reply_text(reason)
        if busy:
            busy_positions = set(busy_at)
            kept = [i for i in range(len(names)) if i + 1 not in busy_positions]
            candidates = [names[i] for i in kept]
            columns = [[column[i] for i in kept] for column in (overlaps, prefill, decode)]
        else:
            candidates, columns = names, [overlaps, prefill, decode]
        # The script computed the same costs to choose; Python's Scores, for display and logs,
        # are built from the numbers it read only when something reads them.
        scores = DeferredScores(
            functools.partial(_scores, candidates, *columns, isl, block_size, policy), len(candidates)
        )
        decision = RoutingDecision(
            worker=chosen,
            overlap=overlaps[chosen_at - 1],
            total_blocks=total_blocks,
            scores=scores,
            reason=reason,
            block_hashes=tuple(block_hashes),
            approximate=chosen in approximate,
            session_key=session_key if use_affinity else None,
            best_overlap=int(best_overlap),
            busy=busy,
        )
        if self._logger.isEnabledFor(logging.DEBUG):
            self._log(decision, policy)
        return decision

    def _policy_args(self, policy: RoutingPolicy) -> tuple[object, ...]:
        """The decision script's arguments from the policy (ARGV 7 to 13), made again only for
        another policy object (a RoutingPolicy is frozen: a frontend decides on one for a while)."""
        kept = self._policy_kept
        if kept is not None and kept[0] is policy:
            return kept[1]
        args = (
            repr(float(policy.overlap_credit)),
            repr(float(policy.prefill_load_scale)),
            repr(float(policy.temperature)),
            repr(float(policy.affinity_cost_slack)),
            int(policy.affinity_max_overlap_lead),
            int(policy.busy_max_requests),
            repr(float(policy.busy_kv_fraction)),
        )
        self._policy_kept = (policy, args)  # replaced whole (threads decide too)
        return args

    @staticmethod
    def _check_fresh(reply: list, only_if: tuple[str, bytes] | None) -> None:
        if reply[0]:
            return
        if reply[1] in STALE and only_if is not None:
            raise StaleWorkers(f"{only_if[0]} moved since the workers were read")
        if reply[1] in WAITING:
            raise RequestsWaiting("requests wait in the admission queue ahead of this one")

    @staticmethod
    def _over_args(
        common: list[object],
        packed: _PackedWorkers,
        policy: RoutingPolicy,
        condition: tuple[str, bytes],
        tail: tuple[str, str],
    ) -> tuple[object, ...]:
        """The decision script's arguments over these workers. A reserving decision must run
        once: it only goes again if Redis lost the script, in which case the first attempt did
        nothing."""
        return (
            *common,
            packed.busy_facts,
            packed.names,
            int(policy.load_bound_gap),
            repr(float(policy.load_bound_ratio)),
            packed.prefill_rates,
            packed.approximate_at,
            packed.schedules,
            *condition,
            "",
            0,
            "",
            "",
            "",
            "",
            *tail,
        )

    def _decide_among(
        self,
        common: list[object],
        fleet: _PackedWorkers,
        policy: RoutingPolicy,
        condition: tuple[str, bytes],
        sample: Sequence[str],
        tail: tuple[str, str],
    ) -> Generator[tuple[object, ...] | _PackedWorkers, Any, list]:
        """The decision script among a large fleet's candidates, read in the same step: the
        holders of the request's longest cached prefixes (at most HOLDERS_PER_PREFIX per prefix
        length, and those a sibling prompt was just sent to), the session's last worker, and
        `sample`, drawn at random for load. Whatever the fleet's size, that is a few dozen
        workers, each with its exact overlap; those the fleet read's facts name (the eligible
        ones: `fleet:facts:<digest>` and its places, `_write_facts`) are weighed by their records
        there. One round trip, and no argument or pass per worker of the fleet in Lua. If the
        facts or their places are gone (expired, or Redis restarted), the script does nothing and
        says so: they are written and the decision made again.

        Why that is enough: a worker's cost grows with its load and falls with its overlap, so
        among workers of one overlap only the least loaded can win; the holders stand for each
        overlap present, and for overlap 0 the least loaded of LOAD_SAMPLE random workers is
        close to the least loaded of all (the power of d choices: with d random choices the
        heaviest load exceeds the mean by O(log log n / log d), not O(log n / log log n)), and
        reservations made by every frontend move the next draw's choice elsewhere."""
        args = (HOLDERS_PER_PREFIX, "\n".join(sample), "", "")
        return (yield from self._with_facts(common, fleet, policy, condition, args, tail))

    def _with_facts(
        self,
        common: list[object],
        fleet: _PackedWorkers,
        policy: RoutingPolicy,
        condition: tuple[str, bytes],
        among: tuple[object, ...],
        tail: tuple[str, str],
    ) -> Generator[tuple[object, ...] | _PackedWorkers, Any, list]:
        """A decision among candidates (`among`: ARGV 31 to 34), weighed by the fleet read's
        facts (and places: ARGV 30, 35), which are written first if the script finds them gone;
        `tail`: ARGV 36 and 37."""
        places = self._places_key(fleet)
        args = (
            *common,
            "",
            "",
            int(policy.load_bound_gap),
            repr(float(policy.load_bound_ratio)),
            "",
            "",
            "",
            *condition,
            self._facts_key(fleet),
            *among,
            places,
            *tail,
        )
        reply = yield args
        if not reply[0] and reply[1] in NO_FLEET_FACTS:
            if reply[1] in NO_FLEET_PLACES:
                # Gone (another router may have unlinked them): no longer counted as written, so
                # they are written again with the facts, and those written before still unlinked.
                self._places_written = [key for key in self._places_written if key != places]
            yield fleet  # its facts written
            reply = yield args
        return reply

    def _decide_given(
        self,
        common: list[object],
        fleet: _PackedWorkers,
        policy: RoutingPolicy,
        condition: tuple[str, bytes],
        found: Mapping[int, int],
        tail: tuple[str, str],
    ) -> Generator[tuple[object, ...] | _PackedWorkers, Any, list]:
        """`_decide_among` with the candidates this process's replica of the index found (the
        same ones: the holders of the longest cached prefixes, at most HOLDERS_PER_PREFIX per
        prefix length, and the sample), by position in the fleet read's list, sent with their
        names, overlaps and facts: the script adds those only Redis knows of (the workers the
        predicted marks name, the session's worker) and walks none of the index."""
        eligible, records = fleet.eligible, fleet.records_at
        args = (
            0,
            "\n".join([eligible[position] for position in found]),
            struct.pack(f">{len(found)}i", *found.values()),
            b"".join([records[position] for position in found]),
        )
        return (yield from self._with_facts(common, fleet, policy, condition, args, tail))

    @staticmethod
    def _replica_fleet(replica: IndexReplica, fleet: _PackedWorkers) -> ReplicaFleet:
        """The fleet read's eligible workers as the replica's bits, kept with the read and made
        again only when the replica's bits moved."""
        kept = fleet.replica_fleet[0] if fleet.replica_fleet else None
        if kept is not None and kept.version == replica.version():
            return kept
        made = replica.fleet(fleet.eligible)
        fleet.replica_fleet[:] = [made]  # one item, replaced whole (threads read it)
        return made

    def _facts_key(self, fleet: _PackedWorkers) -> str:
        return self._namespace + FLEET_FACTS_FAMILY + fleet.digest

    def _places_key(self, fleet: _PackedWorkers) -> str:
        return self._namespace + FLEET_PLACES_FAMILY + fleet.places_digest

    def _write_facts(self, fleet: _PackedWorkers) -> None:
        """Writes the fleet read's facts, and their places unless this router wrote the same
        last, in one transaction: a decision finds them whole or not at all. Unlinks those this
        router wrote before the last ones: the read before this one may still be decided on
        until this one replaces it, and deleting its facts would have its decisions write them
        again, on the request path.

        UNLINK, not DEL: a thousand workers' places are a hash Redis would free on its one thread
        (76 us here, against 9 us to unlink it and free it in the background), while every
        frontend's decisions wait behind it."""
        key, places = self._facts_key(fleet), self._places_key(fleet)
        pipe = self._client.pipeline(transaction=True)
        self._facts_written = _replace_written(pipe, self._facts_written, key)
        pipe.set(key, fleet.facts, px=FLEET_FACTS_TTL_MS)
        if places not in self._places_written[-1:]:
            self._places_written = _replace_written(pipe, self._places_written, places)
            pipe.hset(places, mapping=fleet.places)
        pipe.pexpire(places, FLEET_FACTS_TTL_MS)  # as long as the facts that need it
        pipe.execute()

    def pack_workers(
        self,
        workers: tuple[str, ...],
        reports: Mapping[str, WorkerReport] | None,
        approximate: frozenset[str],
        policy: RoutingPolicy,
    ) -> None:
        """Packs these workers' arguments now, for the decisions that will pass the same objects
        (a frontend's fleet read, prepared in the background); for a large fleet, writes its facts
        too, so its decisions among candidates find them (unless it wrote the same facts last:
        a decision that finds them gone, expired or lost with Redis, writes them again)."""
        packed = self._packed(workers, reports, approximate, policy)
        if len(packed.eligible) <= self.candidates_above:
            return
        pause_point()  # (between the steps of a paced pass: routing.state.pacing)
        packed.records  # noqa: B018 (a step of its own)
        pause_point()
        if self._facts_key(packed) not in self._facts_written[-1:]:
            self._write_facts(packed)
        replica = self._replica
        if replica is not None and replica.ready:
            pause_point()
            self._replica_fleet(replica, packed)

    def _packed(
        self,
        workers: Sequence[str],
        reports: Mapping[str, WorkerReport] | None,
        approximate: Collection[str],
        policy: RoutingPolicy,
    ) -> _PackedWorkers:
        """The per-worker arguments of the decision, packed; reused while a frontend decides on
        the same read of the fleet (the same immutable objects: a tuple of names, a read-only
        mapping of reports, a frozenset), so a decision's Python side does not grow with the
        fleet. Mutable arguments are packed every time."""
        key = (
            policy.busy_max_requests > 0 or policy.busy_kv_fraction > 0,
            bool(policy.prefill_drain),
            bool(policy.shortest_first_queues),
        )
        for kept in reversed(self._recent_packed):
            if kept.made_of(workers, reports, approximate, key):
                return kept
        packed = _PackedWorkers.pack(workers, reports, approximate, key)
        if (
            isinstance(workers, tuple)
            and isinstance(reports, MappingProxyType | None)
            and isinstance(approximate, frozenset)
        ):
            self._recent_packed = (*self._recent_packed[-(PACKED_KEPT - 1) :], packed)
        return packed

    def _log(self, decision: RoutingDecision, policy: RoutingPolicy) -> None:
        total_blocks = decision.total_blocks
        for s in decision.scores:
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
            "[ROUTING] Best: worker_%s with %d/%d blocks overlap (%s; best eligible overlap %d,"
            " given up %d%s)",
            decision.worker,
            decision.overlap,
            total_blocks,
            decision.reason,
            decision.best_overlap,
            decision.overlap_given_up,
            f"; busy: {', '.join(decision.busy)}" if decision.busy else "",
        )


def _replace_written(pipe: redis.client.Pipeline, written: list[str], key: str) -> list[str]:
    """Queues the unlinking of `key` (written again whole) and of those written before the last
    other one; the keys kept afterwards, `key` newest."""
    others = [older for older in written if older != key]
    for older in others[:-1]:
        pipe.unlink(older)
    pipe.unlink(key)
    return [*others[-1:], key]


_I32_MAX = 2**31 - 1
# A decision's steps (KvRouter._steps): it yields a script call's arguments, or a fleet read
# whose facts are to be written, is sent the reply, and returns the decision.
_Steps = Generator["tuple[object, ...] | _PackedWorkers", Any, RoutingDecision]


@dataclass(frozen=True, eq=False)
class _PackedWorkers:
    """The decision script's per-worker arguments (ARGV 21, 22, 25, 26, 27), from the objects
    they were made of (kept to tell whether the next decision's are the same ones)."""

    sources: tuple[object, object, object]
    key: tuple[bool, bool, bool]  # checks busy, drains prefill, assumes shortest first
    eligible: list[str]
    eligible_set: frozenset[str]
    approximate: frozenset[str]
    busy_facts: bytes
    names: str
    prefill_rates: bytes
    approximate_at: bytes
    schedules: bytes
    # [view]: the eligible workers as bits of this frontend's replica of the index, for one
    # version of its bit assignments (KvRouter._replica_fleet).
    replica_fleet: list[ReplicaFleet] = field(default_factory=list, repr=False)

    def made_of(
        self, workers: object, reports: object, approximate: object, key: tuple[bool, bool, bool]
    ) -> bool:
        return key == self.key and all(
            a is b for a, b in zip(self.sources, (workers, reports, approximate), strict=True)
        )

    @classmethod
    def pack(
        cls,
        workers: Sequence[str],
        reports: Mapping[str, WorkerReport] | None,
        approximate: Collection[str],
        key: tuple[bool, bool, bool],
    ) -> _PackedWorkers:
        checks_busy, drains, assumed = key
        eligible = list(dict.fromkeys(workers))
        approximate_set = frozenset(approximate)
        found = reports or {}
        approximate_at = (
            [j for j, name in enumerate(eligible, start=1) if name in approximate_set]
            if approximate_set
            else []
        )
        # A fleet's worth of work each: a paced pass may pause between them (routing.state.pacing).
        busy_facts = _busy_facts(eligible, found) if checks_busy else b""
        pause_point()
        names = "\n".join(checked_workers(eligible))
        pause_point()
        prefill_rates = _prefill_rates(eligible, found) if drains and found else b""
        pause_point()
        schedules = _schedules(eligible, found, assumed)
        return cls(
            sources=(workers, reports, approximate),
            key=key,
            eligible=eligible,
            eligible_set=frozenset(eligible),
            approximate=approximate_set,
            busy_facts=busy_facts,
            names=names,
            prefill_rates=prefill_rates,
            approximate_at=struct.pack(f">{len(approximate_at)}i", *approximate_at),
            schedules=schedules,
        )

    @functools.cached_property
    def records(self) -> dict[str, bytes]:
        """Each worker's facts (FACTS_FORMAT), for a decision among candidates that reads them
        at their places (`facts`, `places`): what the columns above hold of it."""
        facts = self.busy_facts
        busy = {
            struct.unpack_from(">i", facts, at)[0]: struct.unpack_from(">iii", facts, at + 4)
            for at in range(0, len(facts), 16)
        }
        rates = (
            struct.unpack(f">{len(self.eligible)}d", self.prefill_rates)
            if self.prefill_rates
            else (0.0,) * len(self.eligible)
        )
        approximate = self.approximate
        record = struct.Struct(FACTS_FORMAT).pack
        return {
            name: record(*busy.get(j, (0, -1, -1)), rates[j - 1], self.schedules[j - 1], name in approximate)
            for j, name in enumerate(self.eligible, start=1)
        }

    @functools.cached_property
    def records_at(self) -> list[bytes]:
        """`records` by position in `eligible`."""
        return list(self.records.values())

    @functools.cached_property
    def facts(self) -> bytes:
        """The records, one after the other in `eligible`'s order (`fleet:facts:`)."""
        return b"".join(self.records_at)

    @functools.cached_property
    def places(self) -> dict[str, int]:
        """Each eligible worker's place in `facts`, from 1 (`fleet:places:`)."""
        return {name: j for j, name in enumerate(self.eligible, start=1)}

    @functools.cached_property
    def places_digest(self) -> str:
        """Names the places: the same workers in the same order, the same digest."""
        return hashlib.blake2b(self.names.encode(), digest_size=16).hexdigest()

    @functools.cached_property
    def digest(self) -> str:
        """Names the fleet read's facts: the same facts of the same workers, the same digest."""
        digest = hashlib.blake2b(self.names.encode(), digest_size=16)
        digest.update(self.facts)
        return digest.hexdigest()


def _busy_facts(eligible: Sequence[str], reports: Mapping[str, WorkerReport]) -> bytes:
    """Four i32s per reporting worker for the busy check: index, capacity, requests, kv in use."""
    facts: list[int] = []
    extend, get = facts.extend, reports.get
    for j, name in enumerate(eligible, start=1):
        report = get(name)
        if report is not None:
            requests, kv_used = report.running_and_waiting, report.kv_used_blocks
            extend(
                (
                    j,
                    min(report.capacity_blocks, _I32_MAX),
                    -1 if requests is None else min(requests, _I32_MAX),
                    -1 if kv_used is None else min(kv_used, _I32_MAX),
                )
            )
    return struct.pack(f">{len(facts)}i", *facts)


def _schedules(eligible: Sequence[str], reports: Mapping[str, WorkerReport], assumed: bool) -> bytes:
    """One byte per worker in order: b"1" where its engine computes the shortest prompt first,
    b"0" where it goes in arrival order; `assumed` for a worker whose heartbeat does not say."""
    flags = bytearray()
    for report in map(reports.get, eligible):
        said = None if report is None else report.shortest_first
        flags.append(49 if (assumed if said is None else said) else 48)
    return bytes(flags)


def _prefill_rates(eligible: Sequence[str], reports: Mapping[str, WorkerReport]) -> bytes:
    """Each worker's measured prefill rate in tokens/s, one double each in order (0: none).

    As reported: the script takes whole tokens/s and drops NaN and rates under 1.
    """
    rates = [0.0 if report is None else report.prefill_tokens_per_s for report in map(reports.get, eligible)]
    try:
        return struct.pack(f">{len(rates)}d", *rates)
    except (OverflowError, TypeError, struct.error):
        # A heartbeat's JSON can hold an integer no double holds, or no number at all.
        return struct.pack(f">{len(rates)}d", *map(_as_rate, rates))


def _as_rate(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except OverflowError:
        return math.inf
    except (TypeError, ValueError):
        return 0.0


def _positions(rng: random.Random, n: int, k: int) -> list[int]:
    """`k` distinct positions of `n`, drawn at random (all of them if `k` >= `n`): for k << n,
    draws with few repeats, cheaper than `Random.sample`, which builds a list of the population."""
    if k >= n:
        return list(range(n))
    draw = rng.random
    drawn = {int(draw() * n) for _ in range(k)}
    while len(drawn) < k:
        drawn.add(int(draw() * n))
    return list(drawn)


def _scores(
    names: Sequence[str | bytes],
    overlaps: Sequence[int],
    prefill: Sequence[int],
    decode: Sequence[int],
    isl: int,
    block_size: int,
    policy: RoutingPolicy,
) -> list[Score]:
    return score_workers(list(map(reply_text, names)), overlaps, prefill, decode, isl, block_size, policy)


def _integers(packed: bytes) -> tuple[int, ...]:
    """A column the decision script packed as big-endian i64s."""
    return struct.unpack(f">{len(packed) // 8}q", packed)
