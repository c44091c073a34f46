"""What a worker asks of an inference engine, whichever engine it is: the request, its events,
its result, the engine's load, and `InferenceEngine`, the one protocol `workers.runtime` uses.

The native engine (`workers.engine.core.Engine`) implements it; so does an engine hosted from
another project (vLLM). This module imports no torch itself (the package's `__init__` does).
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from routing.contract.tasks import ENGINE_DEAD
from workers.prompt_layout import ImageInput, VideoInput

# (text, its tokens' log probabilities or None, its token ids)
OnPiece = Callable[[str, list[dict[str, Any]] | None, list[int]], None]

# The events a RequestHandle's queue carries, in order: FIRST (its `perf_counter` instant) once,
# TOKEN ((text, logprobs, token ids)) per piece of text, then DONE (a GenerationResult) or ERROR (the
# exception), once.
FIRST = "first"
TOKEN = "token"
DONE = "done"
ERROR = "error"

# How long a follower waits for the next event before it asks `should_stop` again.
_EVENT_POLL_S = 0.05


@dataclass
class GenerationRequest:
    request_id: str
    prompt: str  # chat-templated; one image placeholder per image (<|image_pad|> or <image>)
    images: list[ImageInput]
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    scope_key: str | None = None  # session scope hash when scoping is on
    cache_salt: int | None = None  # the caller's cache partition (routing.prompt.hashing.cache_salt)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False
    top_logprobs: int = 0
    # False when scoping is on and the request has no scope: it must not read or fill shared caches.
    use_embedding_cache: bool = True
    # The frontend processor's model inputs (routing.prompt.processor_view.decode_processed): input_ids,
    # pixel_values, and image_grid_thw (Qwen) or image_sizes (LLaVA-NeXT). When present the engine
    # neither loads nor preprocesses images.
    processed: dict[str, Any] | None = None
    # Videos, decoded and sampled by the frontend (one <|video_pad|> each in the prompt).
    videos: list[VideoInput] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: generate max_tokens tokens whatever the model says
    # The router's hashes of the prompt's blocks (GenerateTask.block_hashes). An engine that lays
    # the prompt out itself (vLLM) checks its own against them; the native engine lays it out
    # with the router's code, and ignores them.
    expected_block_hashes: tuple[int, ...] = ()
    # An answer continued after a migration: the tokens another worker already generated and the
    # client has. They follow the prompt, and generation goes on after them.
    continued_token_ids: list[int] = field(default_factory=list)
    # The router's prompt length and each image's placeholder end (GenerateTask.prompt_tokens,
    # image_ends): what an engine without a tokenizer (workers.sim_engine) goes by; 0 and (): not
    # sent. Engines that lay the prompt out themselves ignore them.
    prompt_tokens: int = 0
    image_ends: tuple[int, ...] = ()
    # Its priority (GenerateTask.priority): the scheduler computes higher ones' prompts first.
    priority: int = 0


@dataclass
class GenerationResult:
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    prefill_ms: float
    total_ms: float
    encoder_calls: int
    embedding_cache_hits: int
    embedding_cache_misses: int
    block_hashes: list[int]  # of the prompt
    preemptions: int = 0  # times the request went back to waiting because the pool ran dry
    embeddings_received: int = 0  # E/PD: images whose encode worker's features were used
    embedding_fallbacks: int = 0  # E/PD: received features that did not fit, encoded here instead
    # With `logprobs`: per completion token {token, logprob, bytes, top_logprobs}, OpenAI's shape.
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class EngineLoad:
    """What the engine is doing now, as its worker reports it with each heartbeat."""

    running: int  # requests in the batch
    running_peak: int  # the most requests ever in one batch, since start
    waiting: int  # requests accepted, not yet in the batch
    kv_blocks_used: int  # pool blocks running requests hold
    kv_blocks_free: int  # blocks a request could get now (free, or cached and evictable)
    kv_blocks_cached: int  # blocks of the prefix cache (held or not)
    forward_passes: int  # model steps since start
    generated_tokens: int  # tokens chosen since start
    preemptions: int  # requests sent back to waiting because the pool ran dry, since start
    # Prompt tokens computed per second of step time (images encoded, decodes riding along),
    # averaged over recent steps that prefilled; 0 until one has. The router drains the prefill
    # it reserved on this worker at this rate (routing.kv.router, "Prefill drain").
    prefill_tokens_per_s: float = 0.0


class EngineFailure(RuntimeError):
    """An engine's own named failure, not a client's: the worker answers it with its status,
    code and message (a bare exception is answered as "the worker failed")."""

    status = 502
    code = "engine_failure"


class EngineDead(EngineFailure):
    """The engine is gone (vLLM's engine core process died): this request and every later one
    fail with it, and the worker goes away. Its code tells the frontend to move the request to
    another worker, as for a worker that vanished."""

    status = 503
    code = ENGINE_DEAD


class RequestHandle:
    """A submitted request: its events (`FIRST` / `TOKEN` / `DONE` / `ERROR`, in that order) and a
    way to cancel it. The engine that made it says what cancelling and features arriving do."""

    def __init__(
        self,
        request_id: str,
        events: queue.SimpleQueue,
        cancel: Callable[[], None],
        features_arrived: Callable[[], None] | None = None,
    ) -> None:
        self.request_id = request_id
        self.events = events
        self._cancel = cancel
        self._features_arrived = features_arrived

    def cancel(self) -> None:
        """The request stops at the engine's next step; what it held goes back to the engine."""
        self._cancel()

    def features_arrived(self) -> None:
        """E/PD: whatever was coming from encode workers has come (or never will). The request
        may now be scheduled; an expected image without its features is encoded here."""
        if self._features_arrived is not None:
            self._features_arrived()


def follow(
    handle: RequestHandle,
    *,
    on_token: Callable[[str], None] | None = None,
    on_first_token: Callable[[], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_piece: OnPiece | None = None,
    await_features: Callable[[], None] | None = None,
) -> GenerationResult:
    """Waits for a submitted request's result in the calling thread, running its callbacks there
    (never in the engine's thread). `should_stop` is asked while waiting; True cancels the request.
    `on_piece` gets each piece of text as `on_token` does, with the log probabilities of the tokens
    the piece completes (None when the request did not ask for them).

    E/PD: `await_features` runs here once the request is queued and sets the `embedding` of the
    images marked `features_expected` that arrive. Meanwhile the engine encodes the request's
    other uncovered images, so the two encodings overlap instead of adding up."""
    finished = False
    try:
        if await_features is not None:
            try:
                await_features()
            finally:
                handle.features_arrived()
        while True:
            try:
                kind, value = handle.events.get(timeout=_EVENT_POLL_S)
            except queue.Empty:
                if should_stop is not None and should_stop():
                    handle.cancel()
                continue
            if kind == TOKEN:
                text, logprobs, token_ids = value
                if on_piece is not None:
                    on_piece(text, logprobs, token_ids)
                if on_token is not None:
                    on_token(text)
                if should_stop is not None and should_stop():
                    handle.cancel()
            elif kind == FIRST:
                if on_first_token is not None:
                    on_first_token()
            elif kind == DONE:
                finished = True
                return value
            else:
                finished = True
                raise value
    finally:
        if not finished:
            handle.cancel()  # the caller went away (an exception in a callback, say)


class FollowsSubmitted:
    """`generate` for an engine whose `submit` hands back a RequestHandle: both engines wait on a
    request the same way (`follow`), so the waiting is written once."""

    def submit(self, request: GenerationRequest) -> RequestHandle:
        raise NotImplementedError

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_token: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_piece: OnPiece | None = None,
        await_features: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """Serves one request and waits for it; thread-safe. Callbacks run in the calling thread."""
        return follow(
            self.submit(request),
            on_token=on_token,
            on_first_token=on_first_token,
            should_stop=should_stop,
            on_piece=on_piece,
            await_features=await_features,
        )


class OnTheNativeScheduler:
    """What an engine built on the native scheduler (workers.scheduler) and prefix pool
    (workers.kv_cache.KvPool) reports of itself: the native and the simulated engine hold the same
    three parts (`scheduler`, `kv_pool`, `counters`), so their load and cache answers are written
    once. `_queued_outside_the_scheduler` counts what was submitted but not yet handed to it."""

    scheduler: Any
    kv_pool: Any
    counters: Any

    @property
    def schedule_policy(self) -> str:
        return self.scheduler.policy

    @property
    def max_running(self) -> int:
        return self.scheduler.max_running

    def _queued_outside_the_scheduler(self) -> int:
        raise NotImplementedError

    def load_report(self) -> EngineLoad:
        scheduler, counters = self.scheduler, self.counters
        return EngineLoad(
            running=len(scheduler.running),
            running_peak=counters.running_peak,
            waiting=len(scheduler.waiting) + self._queued_outside_the_scheduler(),
            kv_blocks_used=self.kv_pool.held_blocks,
            kv_blocks_free=self.kv_pool.free_blocks,
            kv_blocks_cached=len(self.kv_pool),
            forward_passes=counters.forward_passes,
            generated_tokens=counters.generated_tokens,
            preemptions=counters.preemptions,
            prefill_tokens_per_s=counters.prefill_tokens_per_s,
        )

    def kv_block_hashes(self) -> set[int]:
        return self.kv_pool.block_hashes()

    def clear_kv_cache(self) -> int:
        return self.kv_pool.clear()


@runtime_checkable
class InferenceEngine(Protocol):
    """The engine a generating worker serves its tasks with.

    Requests: `submit` queues one and returns its handle (events, cancel); `generate` submits and
    follows it (`follow`), streaming its pieces to callbacks in the calling thread. Load:
    `load_report` for the heartbeat, with `schedule_policy` and `max_running` telling the router
    how the engine orders its queue. Prefix cache: `kv_block_hashes` lists the routing hashes of
    the blocks it holds (the worker re-announces them when the index was lost), and
    `clear_kv_cache` flushes them (announced as `cleared`)."""

    model_name: str
    block_size: int

    @property
    def schedule_policy(self) -> str: ...

    @property
    def max_running(self) -> int: ...

    def submit(self, request: GenerationRequest) -> RequestHandle: ...

    def generate(
        self,
        request: GenerationRequest,
        *,
        on_token: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_piece: OnPiece | None = None,
        await_features: Callable[[], None] | None = None,
    ) -> GenerationResult: ...

    def load_report(self) -> EngineLoad: ...

    def kv_block_hashes(self) -> set[int]: ...

    def clear_kv_cache(self) -> int: ...

    def warm_up(self) -> float: ...

    def close(self, timeout: float = 30.0) -> None: ...
