"""Which tokens of which requests the next engine step computes (continuous batching).

Each step takes every running request's pending tokens (one for a decode, a chunk for a prompt
still being prefilled), oldest first, then admits waiting requests, all within a token budget
and a cap on running requests. Blocks come from the paged pool; when it runs dry the youngest
running request is preempted (its blocks freed, its tokens recomputed later), so a full pool
slows requests down instead of failing them. Pure bookkeeping: no torch, testable without a model.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from workers.kv_cache import KvPool

_arrival = itertools.count()


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
    cancelled: bool = False
    # A cached block to copy into the request's last prompt block before the step runs.
    copy_from: int | None = None

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
    def __init__(self, pool: KvPool, *, max_batch_tokens: int, max_running: int) -> None:
        if max_batch_tokens < 1 or max_running < 1:
            raise ValueError("max_batch_tokens and max_running must be >= 1")
        self.pool = pool
        self.block_size = pool.block_size
        self.max_batch_tokens = max_batch_tokens
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
    def schedule(self) -> StepPlan:
        budget = self.max_batch_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[SequenceState] = []
        scheduled: set[int] = set()
        prefilling = False  # whether this step already computes a prompt chunk
        for sequence in list(self.running):
            if budget == 0:
                break
            if sequence not in self.running:
                continue  # preempted below to make room for an older one
            count = min(sequence.pending, budget)
            while not self._ensure_blocks(sequence, sequence.computed + count):
                victim = self._youngest_unscheduled(scheduled)
                if victim is None:
                    victim = sequence  # nothing younger left: it waits itself
                self._preempt(victim)
                preempted.append(victim)
                if victim is sequence:
                    break
            else:
                chunks.append(ScheduledChunk(sequence, sequence.computed, count))
                scheduled.add(id(sequence))
                budget -= count
                prefilling = prefilling or count > 1
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not preempted:
            sequence = self.waiting[0]
            if sequence.cancelled:
                self.waiting.popleft()
                continue
            if not sequence.block_ids:
                self._reuse_prefix(sequence)
            count = min(sequence.pending, budget)
            if count < sequence.pending <= self.max_batch_tokens and prefilling:
                # It would fit a step of its own: split, it would take two prefill steps to its
                # first token (and arrive with its neighbour again next time); it waits for one.
                self._reset(sequence)
                break
            if not self._ensure_blocks(sequence, sequence.computed + count):
                # Room comes back as running requests finish; waiting ones never preempt them.
                self._reset(sequence)
                break
            self.waiting.popleft()
            self.running.append(sequence)
            chunks.append(ScheduledChunk(sequence, sequence.computed, count))
            budget -= count
            prefilling = prefilling or count > 1
        return StepPlan(chunks, preempted)

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
