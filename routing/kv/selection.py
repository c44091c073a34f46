"""Scoring and selection of a worker for one request: cache overlap weighed against load.

Pure (no Redis, no Django): the cost formula of DESIGN.md "Router", which is Dynamo's
(`lib/kv-router/src/scheduling/selector.rs`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload


@dataclass(frozen=True)
class RoutingPolicy:
    overlap_credit: float = 1.0  # blocks of prefill saved per cached block
    # Weight of prefill work against decode blocks (Dynamo's overlap_score_weight). TTFT on a
    # batching engine is the prefill queued ahead plus the request's own uncached prefill; a
    # request already decoding adds one token to each step, yet weighs all of its blocks in the
    # decode term. At 1 a worker with two short decodes looked costlier than a cold one, and a
    # cached prefix was given up for a full prefill elsewhere (bench/workload.py shape (b)).
    # 4: a decode block weighed a quarter of a prefill block. 8 since reserved prefill drains
    # (prefill_drain): what is left of a prompt is now measured, and a decode block weighed at a
    # quarter still sent requests behind a prompt rather than beside decodes (bench/workload.py,
    # docs/decisions/2026-12-01-prefill-load-scale-32.md). 32 since the shared system prompt of shape (d):
    # at 8 each request decoding beside it weighed its whole prompt, shared prefix included, as
    # 152 prompt tokens (76 blocks / 8), and kv queued prompts behind a prefill rather than
    # beside decodes that end within a few steps; at 32 such a decode weighs 38 prompt tokens,
    # still more than the token per step it costs a newcomer. KV pressure has its own threshold.
    prefill_load_scale: float = 32.0
    temperature: float = 0.0  # 0: always the cheapest; > 0: softmax sampling over costs
    # Session affinity is a preference bounded like consistent hashing with bounded loads: the
    # session's last worker wins while its cost is at most (1 + slack) x the best candidate's,
    # and no other candidate holds more than `affinity_max_overlap_lead` more prefix blocks.
    affinity_cost_slack: float = 0.25
    affinity_max_overlap_lead: int = 2
    # Bounded loads (SGLang's balance thresholds, per worker): a worker `load_bound_gap` or more
    # requests in flight ahead of the least loaded candidate and `load_bound_ratio` x its load or
    # more is passed over when the best of the others costs no more than it plus its queued
    # prefill (giving up its cache then costs the request at most its queue's wait); a gap of 0
    # turns it off. The cost weighs a request's own TTFT only: a prefix every later request
    # shares (a system prompt) outweighs a queue of several prompts, so under steady arrivals
    # every request went to the one worker holding it while the other idled and never came to
    # hold it (bench/workload.py --load). A gap of 2 still lets two requests about one new
    # picture land together; the ratio keeps a busy fleet's bound proportionate; the queue
    # condition keeps a long cached prefix from being given up for a short queue.
    load_bound_gap: int = 2
    load_bound_ratio: float = 1.5
    # Whether workers compute the shortest prompt first (ENGINE_SCHEDULE_POLICY shortest_first):
    # the bound's queue condition then charges a request, of each request in flight on a worker,
    # at most its own uncached tokens there (it goes before every longer queued prompt), so a
    # question about a cached picture is not sent away for a queue it would not wait for. Each
    # worker's heartbeat says its own policy (WorkerReport.shortest_first); this is assumed of
    # a worker that does not say.
    shortest_first_queues: bool = True
    # Busy thresholds (Dynamo's): a worker at or past one is no candidate. 0 turns one off.
    busy_max_requests: int = 0  # requests running + waiting on the worker
    busy_kv_fraction: float = 0.0  # KV blocks held by active requests / the worker's capacity
    # Reserved prefill drains at each worker's measured prefill rate (routing.kv.router, "Prefill
    # drain"); off: a request's prompt counts in full until its first token, as in Dynamo.
    prefill_drain: bool = True

    def __post_init__(self) -> None:
        values = (
            self.overlap_credit,
            self.prefill_load_scale,
            self.temperature,
            self.affinity_cost_slack,
            self.affinity_max_overlap_lead,
            self.busy_max_requests,
            self.busy_kv_fraction,
            self.load_bound_gap,
        )
        if any(value < 0 for value in values):
            raise ValueError(f"routing policy values must be >= 0: {self}")
        if not 1 <= self.load_bound_ratio < math.inf:
            raise ValueError(f"load_bound_ratio must be a finite factor >= 1, got {self.load_bound_ratio}")


# Candidates and scores are built for every worker on every decision: slots make a frozen
# dataclass about twice as quick to create.
@dataclass(frozen=True, slots=True)
class Candidate:
    worker: str
    overlap: int  # leading blocks of the request the worker holds
    active_prefill_tokens: int
    active_decode_blocks: int


@dataclass(frozen=True, slots=True)
class Score:
    worker: str
    overlap: int
    prefill_blocks: float
    decode_blocks: float
    cost: float


# A frozen dataclass sets each field through object.__setattr__ in __init__; the router builds
# one Score per worker on every decision, and writing the slots directly halves that cost
# (about 0.8 us per Score here). Same object, same equality and hash as Score(...).
_new_object = object.__new__
_SET_SCORE_FIELDS = tuple(
    Score.__dict__[name].__set__ for name in ("worker", "overlap", "prefill_blocks", "decode_blocks", "cost")
)


def _new_score(worker: str, overlap: int, prefill_blocks: float, decode_blocks: float, cost: float) -> Score:
    score = _new_object(Score)
    set_worker, set_overlap, set_prefill, set_decode, set_cost = _SET_SCORE_FIELDS
    set_worker(score, worker)
    set_overlap(score, overlap)
    set_prefill(score, prefill_blocks)
    set_decode(score, decode_blocks)
    set_cost(score, cost)
    return score


def score_candidates(
    candidates: Sequence[Candidate], isl: int, block_size: int, policy: RoutingPolicy
) -> list[Score]:
    """The cost of sending a request of `isl` prompt tokens to each candidate, in their order."""
    return score_workers(
        [c.worker for c in candidates],
        [c.overlap for c in candidates],
        [c.active_prefill_tokens for c in candidates],
        [c.active_decode_blocks for c in candidates],
        isl,
        block_size,
        policy,
    )


def score_workers(
    workers: Sequence[str],
    overlaps: Sequence[int],
    active_prefill_tokens: Sequence[int],
    active_decode_blocks: Sequence[int],
    isl: int,
    block_size: int,
    policy: RoutingPolicy,
) -> list[Score]:
    """`score_candidates` on parallel columns: the router's hot path builds no Candidate."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if isl < 0:
        raise ValueError(f"isl must be >= 0, got {isl}")
    n_blocks = -(-isl // block_size)
    credit, scale = policy.overlap_credit, policy.prefill_load_scale
    scores = []
    for worker, overlap, prefill_tokens, decode in zip(
        workers, overlaps, active_prefill_tokens, active_decode_blocks, strict=True
    ):
        prefill_blocks = max((prefill_tokens + isl) / block_size - credit * overlap, 0.0)
        decode_blocks = float(decode + n_blocks - overlap)
        scores.append(
            _new_score(worker, overlap, prefill_blocks, decode_blocks, scale * prefill_blocks + decode_blocks)
        )
    return scores


class DeferredScores(Sequence[Score]):
    """`score_workers` of a decision's candidates, computed the first time they are read.

    Only `/v1/route` and the debug log read every worker's score; a request being dispatched
    needs the chosen worker alone, and 64 Scores cost about a tenth of a whole decision.
    """

    __slots__ = ("_compute", "_length", "_scores")

    def __init__(self, compute: Callable[[], list[Score]], length: int) -> None:
        """`compute`: the scores (`functools.partial(score_workers, ...)`), `length` of them."""
        self._compute = compute
        self._length = length
        self._scores: list[Score] | None = None

    def _computed(self) -> list[Score]:
        if self._scores is None:
            self._scores = self._compute()
        return self._scores

    @overload
    def __getitem__(self, index: int) -> Score: ...
    @overload
    def __getitem__(self, index: slice) -> list[Score]: ...
    def __getitem__(self, index: int | slice) -> Score | list[Score]:
        return self._computed()[index]

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[Score]:
        return iter(self._computed())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeferredScores | list | tuple):
            return self._computed() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so unhashable like one

    def __repr__(self) -> str:
        return repr(self._computed())


def select_worker(scores: Sequence[Score], policy: RoutingPolicy, rng: random.Random) -> Score:
    """Lowest cost, ties at random; with temperature T > 0, p ∝ exp(-(cost-min)/((max-min)·T))."""
    if not scores:
        raise ValueError("no scores to select from")
    costs = [s.cost for s in scores]
    lowest, highest = min(costs), max(costs)
    if policy.temperature <= 0:
        # Equal up to float rounding: costs come from sums of the same kinds of terms.
        tied_below = lowest + 1e-9 * max(1.0, abs(lowest))
        best = [s for s in scores if s.cost <= tied_below]
        return best[0] if len(best) == 1 else rng.choice(best)
    spread = highest - lowest
    if spread <= 0:
        return rng.choice(list(scores))
    weights = [math.exp(-(cost - lowest) / (spread * policy.temperature)) for cost in costs]
    return rng.choices(list(scores), weights=weights, k=1)[0]
