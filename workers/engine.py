"""The worker's inference engine: continuous batching of many requests over one paged KV pool.

Callers (the Celery task threads) submit requests and wait for their events; one engine thread
owns the model and runs steps while there is work. Each step is one forward pass over every
running request's next token plus chunks of waiting prompts (`workers.scheduler`), run by
`workers.model_runner`; each request then chooses its token (`workers.sampler`) and streams text
(`workers.detokenizer`). Prompts are laid out by `workers.prompt_layout` (or checked by
`workers.processed_inputs`), cached prefixes are reused from the pool by reference, and images
the reused prefix covers are neither loaded nor encoded.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash
from PIL import Image

from routing.contract.kv_events import KvEvent
from routing.media.images import (
    MediaPolicy,
    decode_data_url,
    decode_image,
    fetch_bytes,
    is_data_url,
    routing_hash,
)
from routing.prompt.hashing import MediaPlacement, chain_sequence_hashes, local_block_hashes
from workers.detokenizer import IncrementalDetokenizer, TextStream
from workers.embedding_cache import EmbeddingCache, EmbeddingKey
from workers.kv_cache import KvPool
from workers.processed_inputs import processed_prompt
from workers.processors import load_processor
from workers.prompt_layout import (
    LLAVA_MODEL_TYPES,
    ContextLengthExceeded,
    DeclaredSize,
    ImageChangedError,
    ImageInput,
    PromptError,
    PromptImage,
    PromptLayout,
    VideoInput,
)
from workers.sampler import RequestSampler, SamplingParams, choose_tokens
from workers.scheduler import (
    DEFAULT_JOIN_TOKENS,
    SHORTEST_FIRST,
    ScheduledChunk,
    Scheduler,
    SequenceState,
    fits,
)
from workers.video_inputs import VideoPreprocessor

if TYPE_CHECKING:
    import torch

    from workers.model_runner import ChunkInput

logger = logging.getLogger("workers.engine")

PublishEvents = Callable[[Sequence[KvEvent]], None]

# Sized for a small model on a CPU: a step of this many tokens takes tens of milliseconds, so a
# prompt chunk delays the running decodes by about that much.
DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_MAX_RUNNING = 16
# The prefill rate the router drains reservations at is an exponential average over steps that
# computed at least this many prompt tokens: a step of a few decode tokens and a short warm tail
# says more about per-step overhead than about how fast a prompt goes through.
_RATE_MIN_PROMPT_TOKENS = 32
_RATE_SMOOTHING = 0.25  # weight of the newest step
# `Engine.warm_up`'s prompt: plain text any tokenizer takes, long enough to be a prefill step
# (at least _RATE_MIN_PROMPT_TOKENS tokens) rather than a decode-sized one.
WARM_UP_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)

__all__ = [
    "LLAVA_MODEL_TYPES",
    "Engine",
    "EngineLoad",
    "GenerationRequest",
    "GenerationResult",
    "ImageChangedError",
    "ImageInput",
    "IncrementalDetokenizer",
    "PromptError",
    "RequestHandle",
    "VideoInput",
    "load_image_directly",
]


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
    # An answer continued after a migration: the tokens another worker already generated and the
    # client has. They follow the prompt, and generation goes on after them.
    continued_token_ids: list[int] = field(default_factory=list)


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


ImageLoader = Callable[[ImageInput, str | None], Image.Image]


def load_image_directly(image: ImageInput, scope_key: str | None = None) -> Image.Image:
    """The default loader: handed-over bytes, a data URL, or an http(s) fetch through the guard."""
    policy = MediaPolicy()
    if image.data is not None:
        data = image.data
    elif image.url is None:
        raise PromptError(f"image {image.identity} has neither bytes nor a URL")
    elif is_data_url(image.url):
        data = decode_data_url(image.url, max_bytes=policy.max_bytes)
    else:
        data = fetch_bytes(image.url, policy, expect_image=True)
    return decode_image(data, policy)


# Engine threads are daemons (a process may exit with requests in flight), but one still
# finishing a step when the interpreter shuts down would be killed inside torch: wait a little.
# An engine thread holding only requests that await features sleeps until woken (a request
# arrives, features arrive, a cancel); this bounds a missed wake-up, it is not a polling rate.
_STAGED_POLL_S = 0.5

_engine_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@atexit.register
def _let_engine_steps_finish() -> None:
    for thread in list(_engine_threads):
        thread.join(timeout=5)


class RequestHandle:
    """A submitted request: its events (first, with its `perf_counter` instant / token / done /
    error) and a way to cancel it."""

    def __init__(
        self, sequence: SequenceState, events: queue.SimpleQueue, wake: threading.Event | None = None
    ) -> None:
        self._sequence = sequence
        self.events = events
        self._wake = wake

    @property
    def request_id(self) -> str:
        return self._sequence.request_id

    def cancel(self) -> None:
        """The request leaves the batch at the next step; its blocks go back to the pool."""
        self._sequence.cancelled = True
        self._wake_engine()

    def features_arrived(self) -> None:
        """E/PD: whatever was coming from encode workers has come (or never will). The request
        may now be scheduled; an expected image without its features is encoded here."""
        state: _RequestState = self._sequence.payload
        if state.features_gate is not None:
            state.features_gate.set()
        self._wake_engine()

    def _wake_engine(self) -> None:
        if self._wake is not None:
            self._wake.set()


@dataclass(eq=False)
class _RequestState:
    """What the engine keeps with a request while it runs."""

    request: GenerationRequest
    placed: list[PromptImage]
    sampler: RequestSampler
    events: queue.SimpleQueue
    submitted_at: float
    stream: TextStream = field(init=False)
    # With `logprobs`: OpenAI's entries of the tokens streamed so far, in order.
    logprob_entries: list[dict[str, Any]] = field(default_factory=list)
    mrope: torch.Tensor | None = None
    rope_delta: int = 0
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    first_token_at: float | None = None
    encoder_calls: int = 0
    embedding_hits: int = 0
    embedding_misses: int = 0
    embeddings_received: int = 0
    embedding_fallbacks: int = 0
    # E/PD: set once the encode workers' features arrived (or never will); until then the request
    # is held out of the scheduler while the engine encodes its other images ahead.
    features_gate: threading.Event | None = None
    covered_at_submit: int = 0  # prompt tokens the cached prefix covered at submission
    tokens_streamed: int = 0  # generated tokens the pieces sent so far carried
    encoded_ahead: bool = False  # its locally encoded images are done (or were tried)


class Engine:
    """A loaded model with its processor, paged KV pool (the prefix cache) and embedding cache."""

    def __init__(
        self,
        *,
        model: Any,
        processor: Any,
        model_name: str,
        device: str,
        kv_pool: KvPool,
        embedding_cache: EmbeddingCache,
        load_image: ImageLoader,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_running: int = DEFAULT_MAX_RUNNING,
        schedule_policy: str = SHORTEST_FIRST,
        prefill_join_tokens: int = DEFAULT_JOIN_TOKENS,
        video: VideoPreprocessor | None = None,
    ) -> None:
        from workers.model_runner import ModelRunner

        self.model = model
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.model_name = model_name
        self.model_type: str = model.config.model_type
        self.device = device
        self.kv_pool = kv_pool
        self.block_size = kv_pool.block_size
        self.embedding_cache = embedding_cache
        self._load_image = load_image
        self.image_token = processor.image_token
        self.image_token_id: int = model.config.image_token_id
        self.video = video  # the model's video settings; None: it takes no video
        self.layout = PromptLayout(
            processor,
            image_token_id=self.image_token_id,
            model_type=self.model_type,
            video=video,
            video_token_id=getattr(model.config, "video_token_id", None),
        )
        self.uses_mrope = self.layout.uses_mrope
        self.runner = ModelRunner(
            model, self.layout, device=device, blocks=kv_pool.capacity_blocks, block_size=self.block_size
        )
        self.scheduler = Scheduler(
            kv_pool,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            policy=schedule_policy,
            join_tokens=prefill_join_tokens,
        )
        self._eos_ids = self._end_of_sequence_ids()
        self.processor_fingerprint = self._fingerprint_image_processor()
        # Video embeddings depend on the video settings, not the image processor's.
        self.video_fingerprint = (
            xxhash.xxh3_64_hexdigest(video.fingerprint.encode()) if video is not None else "no-video"
        )
        # An `llm` worker drops the vision tower after loading (encode workers compute its images'
        # features); it is read back from this checkpoint on the first fallback.
        self.vision_unloaded_from: Path | None = None
        self.on_vision_loaded: Callable[[Any], None] | None = None  # gets the tower (hooks)
        self._lock = threading.Lock()
        self._inbox: deque[SequenceState] = deque()
        # E/PD: requests awaiting an encode worker's features, in arrival order (`_admit_staged`).
        self._staged: list[SequenceState] = []
        self._wake = threading.Event()  # something for an idle engine thread that holds staged ones
        self._thread: threading.Thread | None = None
        self.forward_passes = 0
        self.generated_tokens = 0
        self.preemptions = 0
        self.running_peak = 0
        self.prefill_tokens_per_s = 0.0
        self._encoder_seconds = 0.0  # spent encoding ahead since the last step that measured the rate
        # The index may still list blocks of this worker's previous life: say it holds nothing.
        kv_pool.clear()

    @classmethod
    def load(
        cls,
        model_dir: Path,
        *,
        device: str = "cpu",
        block_size: int = 16,
        kv_capacity_blocks: int = 4096,
        embedding_cache_bytes: int = 256 << 20,
        load_image: ImageLoader | None = None,
        publish_events: PublishEvents | None = None,
        worker_name: str = "local",
        model_name: str | None = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_running: int = DEFAULT_MAX_RUNNING,
        schedule_policy: str = SHORTEST_FIRST,
        prefill_join_tokens: int = DEFAULT_JOIN_TOKENS,
    ) -> Engine:
        """Loads a local checkpoint (no hub access) and announces an empty cache (`cleared`)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForImageTextToText

        model_dir = Path(model_dir)
        processor = load_processor(model_dir)
        # float32 on CPU (bf16 matmuls are slow there); the checkpoint's own dtype on accelerators.
        dtype = torch.float32 if torch.device(device).type == "cpu" else "auto"
        model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        return cls(
            model=model,
            processor=processor,
            model_name=model_name or model_dir.name,
            device=device,
            kv_pool=KvPool(
                capacity_blocks=kv_capacity_blocks,
                block_size=block_size,
                worker=worker_name,
                publish_events=publish_events,
            ),
            embedding_cache=EmbeddingCache(embedding_cache_bytes),
            load_image=load_image or load_image_directly,
            max_batch_tokens=max_batch_tokens,
            max_running=max_running,
            schedule_policy=schedule_policy,
            prefill_join_tokens=prefill_join_tokens,
            video=VideoPreprocessor.for_model_dir(model_dir),
        )

    # --- public ------------------------------------------------------------------------------------
    def generate(
        self,
        request: GenerationRequest,
        *,
        on_token: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        on_piece: Callable[[str, list[dict[str, Any]] | None, list[int]], None] | None = None,
        await_features: Callable[[], None] | None = None,
    ) -> GenerationResult:
        """Serves one request in the shared batch and waits for it; thread-safe. Callbacks run in
        the calling thread. `should_stop` is asked while waiting; True cancels the request.
        `on_piece` gets each piece of text as `on_token` does, with the log probabilities of the
        tokens the piece completes (None when the request did not ask for them) and their ids.

        E/PD: `await_features` runs here once the request is queued and sets the `embedding` of
        the images marked `features_expected` that arrive. Meanwhile the engine thread encodes
        the request's other uncovered images, so the two encodings overlap instead of adding up."""
        handle = self.submit(request)
        finished = False
        try:
            if await_features is not None:
                try:
                    await_features()
                finally:
                    handle.features_arrived()
            while True:
                try:
                    kind, value = handle.events.get(timeout=0.05)
                except queue.Empty:
                    if should_stop is not None and should_stop():
                        handle.cancel()
                    continue
                if kind == "token":
                    text, logprobs, token_ids = value
                    if on_piece is not None:
                        on_piece(text, logprobs, token_ids)
                    if on_token is not None:
                        on_token(text)
                    if should_stop is not None and should_stop():
                        handle.cancel()
                elif kind == "first":
                    if on_first_token is not None:
                        on_first_token()
                elif kind == "done":
                    finished = True
                    return value
                else:
                    finished = True
                    raise value
        finally:
            if not finished:
                handle.cancel()  # the caller went away (an exception in a callback, say)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Lays out the prompt and queues the request; its images load here, outside the model
        thread, and only those the cached prefix does not cover. Bad requests raise PromptError."""
        submitted_at = time.perf_counter()
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int):
            raise PromptError("max_tokens must be an integer")
        if request.max_tokens < 1:
            raise PromptError("max_tokens must be >= 1")
        params = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=tuple(sorted(request.logit_bias.items())),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
        )
        input_ids, placed = self._prompt(request)
        if request.continued_token_ids:
            # A continued answer: its earlier tokens are prompt here, computed in one prefill.
            input_ids = [*input_ids, *request.continued_token_ids]
        if not fits(self.kv_pool, len(input_ids), request.max_tokens):
            # The client hears the limit in tokens; the operator's log names the setting.
            logger.info(
                "request %s: %d prompt tokens + max_tokens %d exceed the KV pool of %d blocks "
                "(KV_CAPACITY_BLOCKS)",
                request.request_id,
                len(input_ids),
                request.max_tokens,
                self.kv_pool.capacity_blocks,
            )
            raise ContextLengthExceeded(
                self.kv_pool.capacity_blocks * self.block_size, len(input_ids), request.max_tokens
            )
        media = [MediaPlacement(routing_hash(p.source.identity), p.start, p.length) for p in placed]
        local_hashes = local_block_hashes(input_ids, self.block_size, media)
        sequence_hashes = chain_sequence_hashes(local_hashes, request.cache_salt)
        # A look, not a hold: pinning blocks while waiting would keep them from eviction. If they
        # are evicted before the request runs, the engine loads what it then lacks.
        cached = self.kv_pool.cached_prefix_blocks(sequence_hashes)
        usable = min(cached, (len(input_ids) - 1) // self.block_size)
        self._load_uncovered(
            placed, usable * self.block_size, request.scope_key, cached_embeddings=request.use_embedding_cache
        )
        events: queue.SimpleQueue = queue.SimpleQueue()
        sampler = RequestSampler(params)
        for token in request.continued_token_ids:
            # A continued answer's penalties count the tokens the first worker generated, too.
            sampler.counts[token] = sampler.counts.get(token, 0) + 1
        state = _RequestState(
            request=request,
            placed=placed,
            sampler=sampler,
            events=events,
            submitted_at=submitted_at,
            covered_at_submit=usable * self.block_size,
        )
        if any(image.features_expected for image in request.images):
            state.features_gate = threading.Event()
        state.stream = TextStream(
            self.tokenizer,
            list(request.stop),
            functools.partial(self._send_piece, state),
            prior=request.continued_token_ids,
        )
        if self.uses_mrope:
            state.mrope, state.rope_delta = self.runner.rope_positions(input_ids, placed)
        sequence = SequenceState(
            request_id=request.request_id,
            tokens=list(input_ids),
            prompt_len=len(input_ids),
            max_tokens=request.max_tokens,
            sequence_hashes=sequence_hashes,
            local_hashes=local_hashes,
            payload=state,
        )
        with self._lock:
            self._inbox.append(sequence)
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
                _engine_threads.add(self._thread)
                self._thread.start()
        return RequestHandle(sequence, events, self._wake)

    def load_report(self) -> EngineLoad:
        scheduler = self.scheduler
        return EngineLoad(
            running=len(scheduler.running),
            running_peak=self.running_peak,
            waiting=len(scheduler.waiting) + len(self._inbox) + len(self._staged),
            kv_blocks_used=self.kv_pool.held_blocks,
            kv_blocks_free=self.kv_pool.free_blocks,
            kv_blocks_cached=len(self.kv_pool),
            forward_passes=self.forward_passes,
            generated_tokens=self.generated_tokens,
            preemptions=self.preemptions,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )

    def unload_vision(self, model_dir: Path) -> None:
        """Frees the vision tower and projector (`run_worker --role llm`), before serving."""
        import torch

        from workers.vision_encoder import VISION_PARTS

        for part in VISION_PARTS[self.model_type]:
            module = getattr(self.model.model, part)
            if isinstance(module, torch.nn.Parameter):
                setattr(self.model.model, part, torch.nn.Parameter(module.to("meta"), requires_grad=False))
            else:
                module.to("meta")
        self.vision_unloaded_from = Path(model_dir)

    def load_vision(self) -> None:
        """Reads the vision parts back from the checkpoint (an `llm` worker's first fallback)."""
        from workers.vision_encoder import load_vision_parts, vision_tower

        if self.vision_unloaded_from is None:
            return
        logger.warning("loading the vision tower back from %s to encode locally", self.vision_unloaded_from)
        dtype = next(self.model.model.language_model.parameters()).dtype
        load_vision_parts(self.model.model, self.vision_unloaded_from, device=str(self.device), dtype=dtype)
        self.vision_unloaded_from = None
        if self.on_vision_loaded is not None:
            self.on_vision_loaded(vision_tower(self.model.model, self.model_type))

    @property
    def vision_loaded(self) -> bool:
        return self.vision_unloaded_from is None

    def close(self, timeout: float = 30.0) -> None:
        """Waits for the engine thread to finish what it holds (a process about to exit)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def warm_up(self) -> float:
        """Runs a short text prompt through the model once, before the worker takes requests;
        returns how long it took (ms). A process's first forward pass pays allocations and lazy
        initialisation, which a user's first request paid before: on the demo model, one torch
        thread, a 100-word prompt's first token took 41-45 ms the first time and 29-32 ms after
        (docs/decisions/2026-12-02-engine-warm-up.md).

        Leaves nothing behind: no block cached or announced to the router, and the counters the
        heartbeat reports as they were. The prefill rate above all: that slow step would have
        been its first measurement, and the router drains reservations at it."""
        started = time.perf_counter()
        with self.kv_pool.unannounced():
            self.generate(
                GenerationRequest(
                    request_id="warm-up", prompt=WARM_UP_PROMPT, images=[], max_tokens=2, ignore_eos=True
                )
            )
            self.close()  # the engine thread has let go of the request's blocks
            self.kv_pool.clear()
        self.forward_passes = self.generated_tokens = self.preemptions = self.running_peak = 0
        self.prefill_tokens_per_s = 0.0
        self._encoder_seconds = 0.0
        return (time.perf_counter() - started) * 1000

    def clear_kv_cache(self) -> int:
        return self.kv_pool.clear()

    def kv_block_hashes(self) -> set[int]:
        return self.kv_pool.block_hashes()

    def prompt_token_ids(self, prompt: str, images: Sequence[Image.Image]) -> list[int]:
        """The prompt's token ids with each image placeholder expanded, as the model sees them."""
        return self.layout.expand(prompt, [ImageInput(identity="0" * 32)] * len(images), images)[0]

    # --- prompt --------------------------------------------------------------------------------------
    def _prompt(self, request: GenerationRequest) -> tuple[list[int], list[PromptImage]]:
        """The input ids and image spans; images are loaded here only if their size is unknown."""
        if request.processed is not None:
            return processed_prompt(
                self.layout,
                request.images,
                request.processed,
                vocab_size=self.model.get_input_embeddings().num_embeddings,
                video_token_id=getattr(self.model.config, "video_token_id", None),
            )
        if all(image.width and image.height for image in request.images):
            sizes = [DeclaredSize(int(image.width), int(image.height)) for image in request.images]  # type: ignore[arg-type]
            return self.layout.expand(request.prompt, request.images, sizes, request.videos)
        loaded = [self._load_image(image, request.scope_key) for image in request.images]
        return self.layout.expand(request.prompt, request.images, loaded, request.videos)

    def _load_uncovered(
        self,
        placed: list[PromptImage],
        reused: int,
        scope_key: str | None,
        *,
        cached_embeddings: bool = False,
    ) -> None:
        for image in placed:
            if image.kind == "video":
                if image.frames is None and image.end > reused:
                    # A video whose embedding is cached needs no frames (a look, not a use).
                    key = EmbeddingKey(
                        scope_key, image.source.identity, self.model_name, self.video_fingerprint
                    )
                    if not (cached_embeddings and key in self.embedding_cache):
                        image.frames = self._load_frames(image.source)  # type: ignore[arg-type]
                continue
            if image.encoded_elsewhere:
                continue  # E/PD: loaded later only if the encode worker's features fail
            if image.image is None and image.pixel_values is None and image.end > reused:
                image.image = self._load_declared(image.source, scope_key)

    def _load_frames(self, video: VideoInput) -> bytes:
        """A video's sampled frames, from where the frontend left them (never the origin)."""
        if video.load_frames is None:
            raise PromptError(f"video {video.identity} came without its frames")
        frames = video.load_frames()
        count, height, width, channels = video.frame_shape
        if len(frames) != count * height * width * channels:
            raise PromptError(f"video {video.identity}: its stored frames are not {tuple(video.frame_shape)}")
        return frames

    def _load_declared(self, source: ImageInput, scope_key: str | None) -> Image.Image:
        """An image laid out from its declared size, loaded now; it must still have that size."""
        image = self._load_image(source, scope_key)
        # A loader may decode a large image reduced to the processor's size: its source size counts.
        if image.info.get("source_size", image.size) != (source.width, source.height):
            raise ImageChangedError(
                f"image {source.identity} is {image.width}x{image.height} now but was "
                f"{source.width}x{source.height} when the request was routed: it changed at its origin"
            )
        return image

    # --- the engine thread ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.clear()  # before looking: a wake-up from now on is not missed
            with self._lock:
                while self._inbox:
                    sequence = self._inbox.popleft()
                    if sequence.payload.features_gate is not None:
                        self._staged.append(sequence)
                    else:
                        self.scheduler.add(sequence)
                self._admit_staged()
                if not self.scheduler.has_work() and not self._staged:
                    self._thread = None
                    return
            busy = self.scheduler.has_work()
            if busy:
                try:
                    if self.scheduler.policy == SHORTEST_FIRST and self._encode_next_prompt():
                        continue  # a request that came meanwhile may go before the one just encoded
                    self._step()
                except Exception as exc:  # a bug or a device failure: no caller may wait forever
                    logger.exception("engine step failed; failing the requests it held")
                    for sequence in [*self.scheduler.running, *self.scheduler.waiting]:
                        self._fail(sequence, exc)
            if not self._encode_ahead() and not busy:
                self._wake.wait(_STAGED_POLL_S)  # only requests awaiting features: nothing to run

    def _admit_staged(self) -> None:
        """E/PD: requests whose features arrived (or that were cancelled) join the scheduler, in
        the order they came."""
        admitted = [s for s in self._staged if s.cancelled or s.payload.features_gate.is_set()]
        for sequence in admitted:
            self._staged.remove(sequence)
            self.scheduler.add(sequence)

    def _encode_ahead(self) -> bool:
        """E/PD: encodes one image of a request awaiting an encode worker's features, of those
        this worker keeps, while the features travel. Returns whether it encoded anything.

        One image per loop turn, between steps: the running requests' decode steps keep going.
        Best effort: an image that fails here fails again, and is reported, when its chunk runs."""
        for sequence in self._staged:
            state: _RequestState = sequence.payload
            if state.encoded_ahead or sequence.cancelled:
                continue
            for index, image in enumerate(state.placed):
                if index in state.embeddings or image.end <= state.covered_at_submit:
                    continue
                if image.encoded_elsewhere or not self._loaded(image):
                    continue
                try:
                    self._image_embedding(state, index)
                except Exception:
                    logger.debug("encoding ahead failed for %s", sequence.request_id, exc_info=True)
                    break
                return True
            state.encoded_ahead = True
        return False

    def _encode_next_prompt(self) -> bool:
        """Encodes, between steps, one image of the next prompt to compute (the scheduler's first)
        that its next chunk needs. Returns whether it encoded anything.

        The step that then computes the chunk is its forward pass alone, and a shorter request
        that arrives while the encoder runs goes first: in a step, it would have waited for the
        encoder and the longer prompt's whole chunk. An image that fails fails its request here,
        as it would in the step."""
        order = self.scheduler.prefill_order()
        if not order:
            return False
        sequence = order[0]
        if sequence.cancelled:
            return False
        state: _RequestState = sequence.payload
        start = len(sequence.tokens) - self.scheduler.prefill_left(sequence)
        end = min(start + self.scheduler.max_batch_tokens, sequence.prompt_len)
        for index, image in enumerate(state.placed):
            if index in state.embeddings or image.end <= start or image.start >= end:
                continue
            if image.encoded_elsewhere:
                continue  # the step takes the encode worker's features (or falls back)
            started = time.perf_counter()
            try:
                self._image_embedding(state, index)
            except Exception as exc:
                self._fail(sequence, exc)
            self._encoder_seconds += time.perf_counter() - started
            return True
        return False

    @staticmethod
    def _loaded(image: PromptImage) -> bool:
        if image.kind == "video":
            return image.frames is not None
        return image.image is not None or image.pixel_values is not None

    def _step(self) -> None:
        started = time.perf_counter()
        for sequence in self.scheduler.drop_cancelled():
            self._finish(sequence, "stop", release=False)
        plan = self.scheduler.schedule()
        self.preemptions += len(plan.preempted)
        self.running_peak = max(self.running_peak, len(self.scheduler.running))
        chunks: list[ScheduledChunk] = []
        inputs: list[ChunkInput] = []
        for chunk in plan.chunks:
            try:
                inputs.append(self._chunk_input(chunk))
            except Exception as exc:  # this request's image failed to load or encode
                self._fail(chunk.sequence, exc)
                continue
            chunks.append(chunk)
        if not chunks:
            if not plan.chunks and not self.scheduler.running and self.scheduler.waiting:
                # Cannot happen for an admitted request (it fits an empty pool); never spin on it.
                self._fail(self.scheduler.waiting[0], RuntimeError("the KV pool cannot hold this request"))
            return
        logits = self.runner.run(inputs)
        self.forward_passes += 1
        prompt_tokens = sum(
            min(chunk.start + chunk.count, chunk.sequence.prompt_len) - chunk.start
            for chunk in chunks
            if chunk.start < chunk.sequence.prompt_len
        )
        for chunk in chunks:
            self.scheduler.computed(chunk)
        if prompt_tokens >= _RATE_MIN_PROMPT_TOKENS:
            # Images encoded between steps count: the router drains a prompt at this rate.
            self._note_prefill_rate(prompt_tokens, time.perf_counter() - started + self._encoder_seconds)
            self._encoder_seconds = 0.0
        sampling = [chunk.sequence for chunk in chunks if chunk.samples]
        tokens = choose_tokens([sequence.payload.sampler for sequence in sampling], logits)
        for sequence, token in zip(sampling, tokens, strict=True):
            self._accept(sequence, token)

    def _note_prefill_rate(self, prompt_tokens: int, seconds: float) -> None:
        rate = prompt_tokens / max(seconds, 1e-6)
        previous = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = rate if previous <= 0 else previous + _RATE_SMOOTHING * (rate - previous)

    def _chunk_input(self, chunk: ScheduledChunk) -> ChunkInput:
        from workers.model_runner import ChunkInput

        sequence = chunk.sequence
        state: _RequestState = sequence.payload
        end = chunk.start + chunk.count
        if sequence.copy_from is not None:
            last_prompt_block = sequence.block_ids[(sequence.prompt_len - 1) // self.block_size]
            self.runner.copy_block(sequence.copy_from, last_prompt_block)
            sequence.copy_from = None
        image_rows: list[tuple[int, torch.Tensor]] = []
        for index, image in enumerate(state.placed):
            if image.end <= chunk.start or image.start >= end:
                continue  # outside the chunk (inside the reused prefix, say): not even looked up
            runs = image.placeholder_rows(chunk.start, end)
            if not runs:
                continue  # only a video's timestamp text is in this chunk
            embedding = self._image_embedding(state, index)
            # An image cut by the prefix or a chunk boundary gives only its rows inside (trap 5).
            for position, row, count in runs:
                image_rows.append((position - chunk.start, embedding[row : row + count]))
        return ChunkInput(
            tokens=sequence.tokens[chunk.start : end],
            start=chunk.start,
            block_ids=sequence.block_ids,
            prompt_len=sequence.prompt_len,
            mrope=state.mrope,
            rope_delta=state.rope_delta,
            image_rows=image_rows,
            sample=chunk.samples,
        )

    def _image_embedding(self, state: _RequestState, index: int) -> torch.Tensor:
        embedding = state.embeddings.get(index)
        if embedding is not None:
            return embedding
        request, image = state.request, state.placed[index]
        fingerprint = self.video_fingerprint if image.kind == "video" else self.processor_fingerprint
        key = EmbeddingKey(request.scope_key, image.source.identity, self.model_name, fingerprint)
        received = image.source.embedding
        if received is not None:
            if received.shape[0] == image.length:
                state.embeddings_received += 1
                state.embeddings[index] = received.to(self.runner.device)
                return state.embeddings[index]
            # Features laid out for another prompt layout: never a failed request, encode here.
            logger.warning(
                "image %s: the encode worker sent %d feature rows for %d placeholders; encoding locally",
                image.source.identity,
                received.shape[0],
                image.length,
            )
            state.embedding_fallbacks += 1
        if request.use_embedding_cache:
            embedding = self.embedding_cache.get(key)
            if embedding is not None:
                state.embedding_hits += 1
            else:
                state.embedding_misses += 1
        if embedding is None:
            if image.kind == "video":
                if image.frames is None:  # the prefix that covered it was evicted meanwhile
                    image.frames = self._load_frames(image.source)  # type: ignore[arg-type]
            elif image.image is None and image.pixel_values is None:
                # The prefix that covered it at submission was evicted before the request ran.
                image.image = self._load_declared(image.source, request.scope_key)
            if self.vision_unloaded_from is not None:
                self.load_vision()
            embedding = self.runner.encode_image(image)
            state.encoder_calls += 1
            if request.use_embedding_cache:
                self.embedding_cache.put(key, embedding)
        state.embeddings[index] = embedding
        return embedding

    def _accept(self, sequence: SequenceState, token: int) -> None:
        state: _RequestState = sequence.payload
        sequence.tokens.append(token)
        self.generated_tokens += 1
        if state.first_token_at is None:
            state.first_token_at = time.perf_counter()
            state.events.put(("first", state.first_token_at))
        if token in self._eos_ids and not state.request.ignore_eos:
            state.stream.finish()
            self._finish(sequence, "stop")
        elif state.stream.accept(token):
            self._finish(sequence, "stop")  # a stop string
        elif sequence.generated >= sequence.max_tokens:
            state.stream.finish()
            self._finish(sequence, "length")

    def _finish(self, sequence: SequenceState, finish_reason: str, *, release: bool = True) -> None:
        state: _RequestState = sequence.payload
        if release:
            self.scheduler.finish(sequence)
        if finish_reason == "stop" and sequence.cancelled:
            state.stream.finish()
        finished = time.perf_counter()
        first = state.first_token_at or finished
        state.events.put(
            (
                "done",
                GenerationResult(
                    text=state.stream.text,
                    finish_reason=finish_reason,
                    prompt_tokens=sequence.prompt_len,
                    completion_tokens=state.stream.completion_tokens,
                    cached_tokens=sequence.cached_tokens or 0,
                    ttft_ms=(first - state.submitted_at) * 1000,
                    prefill_ms=(first - state.submitted_at) * 1000,
                    total_ms=(finished - state.submitted_at) * 1000,
                    encoder_calls=state.encoder_calls,
                    embedding_cache_hits=state.embedding_hits,
                    embedding_cache_misses=state.embedding_misses,
                    block_hashes=sequence.sequence_hashes,
                    preemptions=sequence.preemptions,
                    embeddings_received=state.embeddings_received,
                    embedding_fallbacks=state.embedding_fallbacks,
                    logprobs=self._logprobs(state) if state.request.logprobs else None,
                ),
            )
        )

    def _send_piece(self, state: _RequestState, piece: str, tokens: int) -> None:
        """A piece of the answer's text to the caller, with the log probabilities of its tokens."""
        logprobs = None
        if state.request.logprobs:
            start = len(state.logprob_entries)
            logprobs = self._logprob_entries(state, start, start + tokens)
            state.logprob_entries.extend(logprobs)
        token_ids = state.stream.generated_ids[state.tokens_streamed : state.tokens_streamed + tokens]
        state.tokens_streamed += tokens
        state.events.put(("token", (piece, logprobs, token_ids)))

    def _logprobs(self, state: _RequestState) -> list[dict[str, Any]]:
        """The sampler's log probabilities in OpenAI's shape, one per token of the answer: those
        streamed with the pieces, then those of tokens no piece carried (a stop string's)."""
        streamed = state.logprob_entries
        return streamed + self._logprob_entries(state, len(streamed), state.stream.completion_tokens)

    def _logprob_entries(self, state: _RequestState, start: int, end: int) -> list[dict[str, Any]]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [
            {**entry(chosen.token, chosen.logprob), "top_logprobs": [entry(t, lp) for t, lp in chosen.top]}
            for chosen in state.sampler.logprobs[start:end]
        ]

    def _fail(self, sequence: SequenceState, exc: Exception) -> None:
        self.scheduler.finish(sequence)
        sequence.payload.events.put(("error", exc))

    # --- model facts ---------------------------------------------------------------------------------
    def _end_of_sequence_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id, self.model.config.text_config.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif source:
                ids.update(source)
        for token in ("<|im_end|>", "<|endoftext|>"):
            token_id = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id != self.tokenizer.unk_token_id:
                ids.add(token_id)
        return frozenset(ids)

    def _fingerprint_image_processor(self) -> str:
        settings = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        return xxhash.xxh3_64_hexdigest(settings.encode())
