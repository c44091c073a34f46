"""`SimEngine`: an `InferenceEngine` with no model. The native engine's scheduler and paged pool,
the profile's step times, and tokens that are counted rather than sampled."""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass, field

from workers.engine.api import (
    DONE,
    ERROR,
    FIRST,
    TOKEN,
    FollowsSubmitted,
    GenerationRequest,
    GenerationResult,
    OnTheNativeScheduler,
    RequestHandle,
)
from workers.engine.counters import RATE_MIN_PROMPT_TOKENS, EngineCounters
from workers.kv_cache import KvPool
from workers.scheduler import Scheduler, SequenceState, StepPlan
from workers.sim_engine.clock import SimClock
from workers.sim_engine.profile import SimProfile

# What a simulated token reads as: one word per token, so a streamed answer has the right length.
SIM_TOKEN_TEXT = " sim"
SIM_TOKEN_ID = 0


@dataclass(eq=False)
class _SimRequest:
    """What the engine keeps with a sequence: its caller's queue and its timeline (clock seconds)."""

    request: GenerationRequest
    events: queue.SimpleQueue
    submitted_at: float
    image_ends: tuple[int, ...]
    images_encoded: bool = False
    encoder_calls: int = 0
    first_token_at: float | None = None
    tokens: list[int] = field(default_factory=list)


class SimEngine(OnTheNativeScheduler, FollowsSubmitted):
    """Serves requests in modelled time. Implements `workers.engine.api.InferenceEngine`.

    A request's prompt is `prompt_tokens` long (the router's count) and its full blocks are the
    router's `block_hashes`: the pool caches exactly what the router's index names, so its KV
    events and `cached_tokens` are real. Each step is the native scheduler's plan, timed by the
    profile; the clock (`workers.sim_engine.clock`) ends it after that long.
    """

    def __init__(
        self,
        *,
        name: str,
        model_name: str,
        profile: SimProfile,
        pool: KvPool,
        clock: SimClock,
    ) -> None:
        self.name = name
        self.model_name = model_name
        self.profile = profile
        self.kv_pool = pool
        self.block_size = pool.block_size
        self.clock = clock
        self.scheduler = Scheduler(
            pool,
            max_batch_tokens=profile.max_batch_tokens,
            max_running=profile.max_running,
            policy=profile.schedule_policy,
            join_tokens=profile.prefill_join_tokens,
        )
        self.counters = EngineCounters()
        self._lock = threading.Lock()
        self._inbox: deque[SequenceState] = deque()
        self._plan: StepPlan | None = None
        # The index may still list blocks of this worker's previous life: say it holds nothing.
        pool.clear()

    # --- the protocol (workers.engine.api.InferenceEngine) -------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        bs = self.block_size
        hashes = list(request.expected_block_hashes)
        prompt_len = request.prompt_tokens or max(len(hashes) * bs, 1)
        if len(hashes) > prompt_len // bs:
            hashes = hashes[: prompt_len // bs]
        state = _SimRequest(
            request=request,
            events=queue.SimpleQueue(),
            submitted_at=0.0,  # stamped when it is queued
            # An image whose end the frontend did not send is covered only by a whole-prompt hit.
            image_ends=tuple(request.image_ends) or (prompt_len,) * len(request.images),
        )
        sequence = SequenceState(
            request_id=request.request_id,
            tokens=[SIM_TOKEN_ID] * prompt_len,
            prompt_len=prompt_len,
            max_tokens=max(request.max_tokens, 1),
            sequence_hashes=hashes,
            local_hashes=[],
            payload=state,
            priority=request.priority,  # on the native scheduler, as the native engine's prompts
        )
        with self._lock:
            # Stamped with the append, so the inbox is in order of arrival.
            state.submitted_at = self.clock.now()
            self._inbox.append(sequence)
        self.clock.wake(self, state.submitted_at)

        def cancel() -> None:
            sequence.cancelled = True
            self.clock.wake(self)

        return RequestHandle(request.request_id, state.events, cancel)

    def _queued_outside_the_scheduler(self) -> int:
        return len(self._inbox)

    def warm_up(self) -> float:
        return 0.0  # nothing to warm: no model

    def close(self, timeout: float = 30.0) -> None:
        pass  # the clock, shared by the process's engines, is stopped by their owner

    # --- steps, driven by the clock -------------------------------------------------------------------
    def begin_step(self, start: float) -> float | None:
        """Plans the next step (the native scheduler's), starting at simulated time `start`, and
        returns its modelled seconds; with nothing to run, the wait until the next request that
        arrives later than `start` (a lagging clock runs steps whose time has passed), or None."""
        with self._lock:
            scheduler = self.scheduler
            while self._inbox and self._inbox[0].payload.submitted_at <= start:
                scheduler.add(self._inbox.popleft())
            for sequence in scheduler.drop_cancelled():
                self._finish(sequence, "stop", start, release=False)
            if not scheduler.has_work():
                return self._until_next_arrival(start)
            plan = scheduler.schedule()
            self.counters.preemptions += len(plan.preempted)
            self.counters.running_peak = max(self.counters.running_peak, len(scheduler.running))
            if not plan.chunks:
                if not scheduler.running and scheduler.waiting:
                    # Cannot happen for a request that fits an empty pool; never spin on it.
                    self._fail(scheduler.waiting[0], RuntimeError("the KV pool cannot hold this request"))
                return (
                    self.profile.step_seconds(0, 0)
                    if scheduler.has_work()
                    else self._until_next_arrival(start)
                )
            prefill_tokens = decodes = images = context = 0
            for chunk in plan.chunks:
                sequence = chunk.sequence
                if chunk.start >= sequence.prompt_len:
                    decodes += 1
                    context += chunk.start
                    continue
                prefill_tokens += min(chunk.start + chunk.count, sequence.prompt_len) - chunk.start
                images += self._images_to_encode(sequence)
            seconds = self.profile.step_seconds(prefill_tokens, decodes, images, context)
            self.counters.forward_passes += 1
            if prefill_tokens >= RATE_MIN_PROMPT_TOKENS:
                self.counters.note_prefill_rate(prefill_tokens, seconds)
            self._plan = plan
            return seconds

    def _until_next_arrival(self, start: float) -> float | None:
        """Nothing to run at `start`: the wait until the next request arrives, None if none has."""
        return self._inbox[0].payload.submitted_at - start if self._inbox else None

    def end_step(self, end: float) -> None:
        """The planned step's KV is written (blocks cached and announced) and its tokens chosen,
        at simulated time `end`."""
        with self._lock:
            plan, self._plan = self._plan, None
            if plan is None:
                return
            for chunk in plan.chunks:
                self.scheduler.computed(chunk)
            for chunk in plan.chunks:
                if chunk.samples and not chunk.sequence.cancelled:
                    self._accept(chunk.sequence, end)

    def _images_to_encode(self, sequence: SequenceState) -> int:
        """Images its cached prefix does not cover, encoded at its first prefill (once, as the
        native engine's embedding cache keeps them across a preemption)."""
        state: _SimRequest = sequence.payload
        if state.images_encoded:
            return 0
        state.images_encoded = True
        cached = sequence.cached_tokens or 0
        state.encoder_calls = sum(1 for end in state.image_ends if end > cached)
        return state.encoder_calls

    def _accept(self, sequence: SequenceState, now: float) -> None:
        state: _SimRequest = sequence.payload
        sequence.tokens.append(SIM_TOKEN_ID)
        self.counters.generated_tokens += 1
        if state.first_token_at is None:
            state.first_token_at = now
            state.events.put((FIRST, now))
        state.events.put((TOKEN, (SIM_TOKEN_TEXT, None, [SIM_TOKEN_ID])))
        if sequence.generated >= sequence.max_tokens:
            self._finish(sequence, "length", now)

    def _finish(
        self, sequence: SequenceState, finish_reason: str, finished: float, *, release: bool = True
    ) -> None:
        state: _SimRequest = sequence.payload
        if release:
            self.scheduler.finish(sequence)
        first = state.first_token_at if state.first_token_at is not None else finished
        generated = sequence.generated
        state.events.put(
            (
                DONE,
                GenerationResult(
                    text=SIM_TOKEN_TEXT * generated,
                    finish_reason=finish_reason,
                    prompt_tokens=sequence.prompt_len,
                    completion_tokens=generated,
                    cached_tokens=sequence.cached_tokens or 0,
                    ttft_ms=(first - state.submitted_at) * 1000,
                    prefill_ms=(first - state.submitted_at) * 1000,
                    total_ms=(finished - state.submitted_at) * 1000,
                    encoder_calls=state.encoder_calls,
                    embedding_cache_hits=0,
                    embedding_cache_misses=state.encoder_calls,
                    block_hashes=sequence.sequence_hashes,
                    preemptions=sequence.preemptions,
                ),
            )
        )

    def _fail(self, sequence: SequenceState, exc: Exception) -> None:
        self.scheduler.finish(sequence)
        sequence.payload.events.put((ERROR, exc))
