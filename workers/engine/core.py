"""The native engine's core: its request API, and the one engine thread that owns the model.

Callers (the Celery task threads) submit requests and follow their events; the engine thread
admits them and runs steps while there is work (continuous batching). The jobs themselves live
beside this module: inputs (`inputs`), images and videos (`vision`), the step (`step`), text
and results (`outputs`), loading (`loading`).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from workers.embedding_cache import EmbeddingCache
from workers.engine.api import (
    FollowsSubmitted,
    GenerationRequest,
    OnTheNativeScheduler,
    RequestHandle,
)
from workers.engine.counters import EngineCounters
from workers.engine.inputs import ImageLoader, InputProcessor, RequestState
from workers.engine.loading import (
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_RUNNING,
    end_of_sequence_ids,
    image_processor_fingerprint,
    load_engine,
    video_fingerprint,
)
from workers.engine.outputs import OutputProcessor
from workers.engine.step import EngineStep
from workers.engine.vision import VisionStage
from workers.kv_cache import KvPool
from workers.prompt_layout import ImageInput, PromptLayout
from workers.scheduler import DEFAULT_JOIN_TOKENS, SHORTEST_FIRST, Scheduler, SequenceState
from workers.video_inputs import VideoPreprocessor

logger = logging.getLogger("workers.engine")

# `Engine.warm_up`'s prompt: plain text any tokenizer takes, long enough to be a prefill step
# (at least counters.RATE_MIN_PROMPT_TOKENS tokens) rather than a decode-sized one.
WARM_UP_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)

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


class Engine(OnTheNativeScheduler, FollowsSubmitted):
    """A loaded model with its processor, paged KV pool (the prefix cache) and embedding cache.
    Implements `workers.engine.api.InferenceEngine`."""

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
        self.processor_fingerprint = image_processor_fingerprint(self.image_processor)
        self.video_fingerprint = video_fingerprint(video)
        self.counters = EngineCounters()
        self.inputs = InputProcessor(
            layout=self.layout,
            runner=self.runner,
            kv_pool=kv_pool,
            embedding_cache=embedding_cache,
            load_image=load_image,
            model_name=model_name,
            video_fingerprint=self.video_fingerprint,
            vocab_size=model.get_input_embeddings().num_embeddings,
            video_token_id=getattr(model.config, "video_token_id", None),
        )
        self.outputs = OutputProcessor(
            tokenizer=self.tokenizer,
            scheduler=self.scheduler,
            eos_ids=end_of_sequence_ids(model, self.tokenizer),
            counters=self.counters,
        )
        self.vision = VisionStage(
            model=model,
            model_type=self.model_type,
            device=device,
            runner=self.runner,
            inputs=self.inputs,
            embedding_cache=embedding_cache,
            model_name=model_name,
            processor_fingerprint=self.processor_fingerprint,
            video_fingerprint=self.video_fingerprint,
            counters=self.counters,
        )
        self.step = EngineStep(
            scheduler=self.scheduler,
            runner=self.runner,
            vision=self.vision,
            outputs=self.outputs,
            counters=self.counters,
            block_size=self.block_size,
        )
        self._lock = threading.Lock()
        self._inbox: deque[SequenceState] = deque()
        # E/PD: requests awaiting an encode worker's features, in arrival order (`_admit_staged`).
        self._staged: list[SequenceState] = []
        self._wake = threading.Event()  # something for an idle engine thread that holds staged ones
        self._thread: threading.Thread | None = None
        # The index may still list blocks of this worker's previous life: say it holds nothing.
        kv_pool.clear()

    @classmethod
    def load(cls, model_dir: Path, **options: Any) -> Engine:
        """Loads a local checkpoint (no hub access) and announces an empty cache (`cleared`);
        the options are `workers.engine.loading.load_engine`'s."""
        return load_engine(cls, model_dir, **options)

    # --- the protocol (workers.engine.api.InferenceEngine) -------------------------------------------
    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Lays out the prompt and queues the request; its images load here, outside the model
        thread, and only those the cached prefix does not cover. Bad requests raise PromptError."""
        sequence = self.inputs.process(request, submitted_at=time.perf_counter())
        state: RequestState = sequence.payload
        self.outputs.attach_stream(state)
        with self._lock:
            self._inbox.append(sequence)
            self._wake.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
                _engine_threads.add(self._thread)
                self._thread.start()

        def cancel() -> None:
            # The request leaves the batch at the next step; its blocks go back to the pool.
            sequence.cancelled = True
            self._wake.set()

        def features_arrived() -> None:
            if state.features_gate is not None:
                state.features_gate.set()
            self._wake.set()

        return RequestHandle(request.request_id, state.events, cancel, features_arrived)

    def _queued_outside_the_scheduler(self) -> int:
        return len(self._inbox) + len(self._staged)

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
        self.counters.reset()
        return (time.perf_counter() - started) * 1000

    # --- the counters, as attributes of the engine ----------------------------------------------------
    @property
    def forward_passes(self) -> int:
        return self.counters.forward_passes

    @property
    def generated_tokens(self) -> int:
        return self.counters.generated_tokens

    @property
    def preemptions(self) -> int:
        return self.counters.preemptions

    @property
    def running_peak(self) -> int:
        return self.counters.running_peak

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.counters.prefill_tokens_per_s

    # --- native extras: prompts, the image loader, the vision tower (E/PD) ---------------------------
    def prompt_token_ids(self, prompt: str, images: Sequence[Image.Image]) -> list[int]:
        """The prompt's token ids with each image placeholder expanded, as the model sees them."""
        return self.layout.expand(prompt, [ImageInput(identity="0" * 32)] * len(images), images)[0]

    @property
    def _load_image(self) -> ImageLoader:
        return self.inputs.load_image

    @_load_image.setter
    def _load_image(self, load_image: ImageLoader) -> None:
        self.inputs.load_image = load_image

    def unload_vision(self, model_dir: Path) -> None:
        """Frees the vision tower and projector (`run_worker --role llm`), before serving."""
        self.vision.unload_tower(model_dir)

    def load_vision(self) -> None:
        """Reads the vision parts back from the checkpoint (an `llm` worker's first fallback)."""
        self.vision.load_tower()

    @property
    def vision_loaded(self) -> bool:
        return self.vision.unloaded_from is None

    @property
    def vision_unloaded_from(self) -> Path | None:
        return self.vision.unloaded_from

    @property
    def on_vision_loaded(self) -> Callable[[Any], None] | None:
        return self.vision.on_loaded

    @on_vision_loaded.setter
    def on_vision_loaded(self, callback: Callable[[Any], None] | None) -> None:
        self.vision.on_loaded = callback

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
                    if self.scheduler.policy == SHORTEST_FIRST and self.vision.encode_next_prompt(
                        self.scheduler, self.outputs.fail
                    ):
                        continue  # a request that came meanwhile may go before the one just encoded
                    self.step.run()
                except Exception as exc:  # a bug or a device failure: no caller may wait forever
                    logger.exception("engine step failed; failing the requests it held")
                    for sequence in [*self.scheduler.running, *self.scheduler.waiting]:
                        self.outputs.fail(sequence, exc)
            if not self.vision.encode_ahead(self._staged) and not busy:
                self._wake.wait(_STAGED_POLL_S)  # only requests awaiting features: nothing to run

    def _admit_staged(self) -> None:
        """E/PD: requests whose features arrived (or that were cancelled) join the scheduler, in
        the order they came."""
        admitted = [s for s in self._staged if s.cancelled or s.payload.features_gate.is_set()]
        for sequence in admitted:
            self._staged.remove(sequence)
            self.scheduler.add(sequence)
