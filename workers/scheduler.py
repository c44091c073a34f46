"""Which tokens of which requests the next engine step computes (continuous batching).

Each step takes every running request's next token (its decode), then prompt chunks, within a
token budget and a cap on running requests. Which prompts go first is the policy's choice:

- `shortest_first` (the default): the prompt with the fewest tokens left to compute to its
  first token goes first (a cache hit's short tail before a cold prompt's images), and a prompt
  longer than `join_tokens` never rides a step that already computes another one. Each step that
  passes a prompt over brings it forward by a step's budget, so none waits for ever. Like
  SGLang's longest-prefix-match policy, it is what makes a prefix-cache hit fast under load.
- `fcfs`: running prompts, then waiting ones, in arrival order, packed into the budget (the
  engine before; what the scheduling benchmark measures against).

Under either policy, a prompt of a higher priority (its request's, routing.admission) goes before
every prompt of a lower one, and the policy orders prompts of one priority: a queue in the router
cannot help an interactive request already waiting in a worker behind a batch job's prompts.

Under either policy, a prompt whose next blocks another running prompt is computing right now
waits for them to be cached instead of computing them again: siblings of a burst about one new
picture arrive together on purpose (the router's predicted blocks send them to one worker), and
they would otherwise each prefill the shared prefix side by side, the second finding only the
chunks the first had finished.

Blocks come from the paged pool; when it runs dry the youngest running request is preempted (its
blocks freed, its tokens recomputed later), so a full pool slows requests down instead of failing
them. Pure bookkeeping: no torch, testable without a model.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workers.kv_cache import KvPool

_arrival = itertools.count()

SHORTEST_FIRST = "shortest_first"
FCFS = "fcfs"
POLICIES = (SHORTEST_FIRST, FCFS)

# shortest_first: a prompt with at most this many tokens left joins a step that already computes
# another prompt; a longer one waits for a step of its own. About a step's fixed cost in tokens
# for a small model on a CPU (a 3-token step takes ~5 ms, each further token ~0.1 ms): joining
# saves the joiner that overhead and costs the step's other prompts its tokens' time. A GPU's
# step costs the same for hundreds of tokens: set it higher there (ENGINE_PREFILL_JOIN_TOKENS).
DEFAULT_JOIN_TOKENS = 64


@dataclass(eq=False)
class SequenceState:
    """A request inside the engine: its tokens (prompt, then generated) and its place in the pool."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    max_tokens: int
    sequence_hashes: list[int]  # of the prompt's full blocks
    local_hashes: list[int]
    payload: Any = None  # what the engine keeps with it (sampler, images, output channel)
    arrival: int = field(default_factory=lambda: next(_arrival))
    block_ids: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose KV is in the pool
    committed: int = 0  # prompt blocks whose cache status is settled (reused or offered)
    cached_tokens: int | None = None  # reused from the prefix cache at first admission
    preemptions: int = 0
    passed_over: int = 0  # steps that computed another prompt while this one waited
    cancelled: bool = False
    # A cached block to copy into the request's last prompt block before the step runs.
    copy_from: int | None = None
    priority: int = 0  # its request's (GenerateTask.priority): higher prompts go first

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class ScheduledChunk:
    sequence: SequenceState
    start: int  # first token computed this step
    count: int

    @property
    def samples(self) -> bool:
        """Whether this step's logits choose the request's next token (its feed reaches the end)."""
        return self.start + self.count == len(self.sequence.tokens)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    preempted: list[SequenceState]


class Scheduler:
    def __init__(
        self,
        pool: KvPool,
        *,
        max_batch_tokens: int,
        max_running: int,
        policy: str = SHORTEST_FIRST,
        join_tokens: int = DEFAULT_JOIN_TOKENS,
    ) -> None:
        if max_batch_tokens < 1 or max_running < 1 or join_tokens < 0:
            raise ValueError("max_batch_tokens and max_running must be >= 1, join_tokens >= 0")
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_batch_tokens = max_batch_tokens
        self.policy = policy
        self.join_tokens = join_tokens
        self.max_running = max_running
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []  # oldest admission first

    def add(self, sequence: SequenceState) -> None:
        self.waiting.append(sequence)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    # --- one step ----------------------------------------------------------------------------------
    def prefill_left(self, sequence: SequenceState) -> int:
        """Tokens the sequence still has to compute before its next token: what it has pending if it
        runs, else what the pool does not hold of it right now (a look, not a hold)."""
        if sequence.block_ids or sequence in self.running:
            return sequence.pending
        cached = self.pool.cached_prefix_blocks(sequence.sequence_hashes) * self.block_size
        return len(sequence.tokens) - min(cached, sequence.prompt_len - 1)

    def prefill_order(self) -> list[SequenceState]:
        """Prompts to compute, the next first: running ones part-way through and waiting ones (a
        preempted one first, its turn came already), in the policy's order (see the module)."""
        running = [s for s in self.running if s.pending > 1]
        waiting = [s for s in self.waiting if not s.cancelled]
        if self.policy == FCFS:
            return sorted(running + waiting, key=lambda s: -s.priority)  # stable: arrival within one
        return sorted(
            running + waiting,
            key=lambda s: (
                -s.priority,
                -1 if s.preemptions and not s.block_ids else 0,
                self.prefill_left(s) - s.passed_over * self.max_batch_tokens,
                s.arrival,
            ),
        )

    def schedule(self) -> StepPlan:
        """The next step: every running decode, then prompt chunks in `prefill_order`."""
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[SequenceState] = []
        scheduled: set[int] = set()
        for sequence in list(self.running):
            if budget == 0:
                break
            if sequence not in self.running or sequence.pending != 1:
                continue  # preempted below to make room for an older one, or still a prompt
            if self._run(sequence, 1, scheduled, preempted):
                chunks.append(ScheduledChunk(sequence, sequence.computed, 1))
                budget -= 1
        prefilling = False  # whether this step already computes a prompt chunk
        joining = self.policy == SHORTEST_FIRST  # whether long prompts keep out of such a step
        admitting = True  # whether waiting prompts may still join the running ones this step
        order = self.prefill_order()
        for sequence in order:
            if budget == 0:
                break
            if id(sequence) in scheduled:
                continue
            if joining and prefilling and self.prefill_left(sequence) > self.join_tokens:
                continue  # it waits for a step of its own (see the module)
            if sequence in self.running:
                count = min(sequence.pending, budget)
                if self._run(sequence, count, scheduled, preempted):
                    chunks.append(ScheduledChunk(sequence, sequence.computed, count))
                    budget -= count
                    prefilling = True
                continue
            if not admitting or len(self.running) >= self.max_running or preempted:
                continue
            if not sequence.block_ids:
                if self._computed_by_another(sequence):
                    continue  # it reuses those blocks once they are cached (see the module)
                self._reuse_prefix(sequence)
            count = min(sequence.pending, budget)
            if count < sequence.pending <= self.max_batch_tokens and prefilling:
                # It would fit a step of its own: split, it would take two prefill steps to its
                # first token (and arrive with its neighbour again next time); it waits for one.
                self._reset(sequence)
                admitting = self.policy != FCFS  # fcfs: nobody overtakes it
                continue
            if not self._ensure_blocks(sequence, sequence.computed + count):
                # Room comes back as running requests finish; waiting ones never preempt them,
                # and none takes the room it waits for.
                self._reset(sequence)
                admitting = False
                continue
            self.waiting.remove(sequence)
            self.running.append(sequence)
            scheduled.add(id(sequence))
            chunks.append(ScheduledChunk(sequence, sequence.computed, count))
            budget -= count
            prefilling = True
        if prefilling:
            for sequence in order:
                if id(sequence) not in scheduled:
                    sequence.passed_over += 1
        return StepPlan(chunks, preempted)

    def _run(
        self, sequence: SequenceState, count: int, scheduled: set[int], preempted: list[SequenceState]
    ) -> bool:
        """Blocks for a running sequence's next `count` tokens, preempting the youngest running
        sequence not yet in this step while the pool is dry; False if it was preempted itself."""
        while not self._ensure_blocks(sequence, sequence.computed + count):
            victim = self._youngest_unscheduled(scheduled)
            if victim is None:
                victim = sequence  # nothing younger left: it waits itself
            self._preempt(victim)
            preempted.append(victim)
            if victim is sequence:
                return False
        scheduled.add(id(sequence))
        return True

    def _computed_by_another(self, sequence: SequenceState) -> bool:
        """Whether a running prompt is computing the first block of this one that the pool does
        not hold (block hashes are chained: the same hash there means the same whole prefix)."""
        hashes = sequence.sequence_hashes
        first = self.pool.cached_prefix_blocks(hashes)
        if first >= len(hashes):
            return False
        return any(
            other.pending > 1 and other.committed <= first < len(other.sequence_hashes)
            and other.sequence_hashes[first] == hashes[first]
            for other in self.running
        )  # fmt: skip

    def _reuse_prefix(self, sequence: SequenceState) -> None:
        bs = self.block_size
        blocks = self.pool.acquire_prefix(sequence.sequence_hashes, sequence.prompt_len // bs)
        sequence.committed = len(blocks)
        if blocks and len(blocks) * bs == sequence.prompt_len:
            # The whole prompt is cached, but its last token must run again (its logits choose the
            # first token): the last block is copied into one of the request's own, which that
            # token then rewrites, so the cached block is never written to.
            own = self.pool.allocate(1)
            self.pool.release(blocks[-1:])
            if own is not None:
                sequence.copy_from = blocks[-1]
                blocks = blocks[:-1] + own
                sequence.computed = sequence.prompt_len - 1
            else:
                blocks = blocks[:-1]
                sequence.computed = len(blocks) * bs
        else:
            sequence.computed = len(blocks) * bs
        sequence.block_ids = blocks
        if sequence.cached_tokens is None:
            sequence.cached_tokens = sequence.computed

    def _ensure_blocks(self, sequence: SequenceState, tokens: int) -> bool:
        missing = self.blocks_needed(tokens) - len(sequence.block_ids)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing)
        if blocks is None:
            return False
        sequence.block_ids.extend(blocks)
        return True

    def _youngest_unscheduled(self, scheduled: set[int]) -> SequenceState | None:
        for sequence in reversed(self.running):
            if id(sequence) not in scheduled:
                return sequence
        return None

    def _preempt(self, sequence: SequenceState) -> None:
        self.running.remove(sequence)
        self._reset(sequence)
        sequence.preemptions += 1
        self.waiting.appendleft(sequence)

    def _reset(self, sequence: SequenceState) -> None:
        self.pool.release(sequence.block_ids)
        sequence.block_ids = []
        sequence.computed = 0
        sequence.committed = 0
        sequence.copy_from = None

    # --- after the step ------------------------------------------------------------------------------
    def computed(self, chunk: ScheduledChunk) -> None:
        """The step wrote the chunk's KV: prompt blocks it filled become cacheable."""
        sequence = chunk.sequence
        sequence.computed = chunk.start + chunk.count
        full = min(sequence.computed, sequence.prompt_len) // self.block_size
        full = min(full, len(sequence.sequence_hashes))
        if full > sequence.committed:
            self.pool.commit(
                sequence.block_ids,
                sequence.committed,
                full,
                sequence.sequence_hashes,
                sequence.local_hashes,
            )
            sequence.committed = full

    def finish(self, sequence: SequenceState) -> None:
        """The request is done (finished, stopped, cancelled or failed): its blocks go back."""
        if sequence in self.running:
            self.running.remove(sequence)
        elif sequence in self.waiting:
            self.waiting.remove(sequence)
        self.pool.release(sequence.block_ids)
        sequence.block_ids = []

    def drop_cancelled(self) -> list[SequenceState]:
        gone = [s for s in (*self.running, *self.waiting) if s.cancelled]
        for sequence in gone:
            self.finish(sequence)
        return gone


def fits(pool: KvPool, prompt_tokens: int, max_tokens: int) -> bool:
    """Whether a request could ever run: all its tokens' KV in a pool nobody else uses."""
    return -(-(prompt_tokens + max_tokens) // pool.block_size) <= pool.capacity_blocks
