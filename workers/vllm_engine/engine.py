"""vLLM's `AsyncLLM` (v1) hosted in the worker process, behind `workers.engine.api.InferenceEngine`.

vLLM's engine core runs as vLLM's own child process; this process keeps its client: one asyncio
loop on a thread of its own, to which the Celery task threads hand requests
(`run_coroutine_threadsafe`). Each request's outputs come back to its caller's thread as the
native engine's events (`FIRST`, `TOKEN`, `DONE`, `ERROR`), so `workers.runtime` serves both
engines alike. Imported only in the vLLM virtualenv (`make vllm`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from routing.contract.kv_events import KvEvent
from workers.engine.api import (
    DONE,
    ERROR,
    FIRST,
    TOKEN,
    EngineDead,
    EngineLoad,
    FollowsSubmitted,
    GenerationRequest,
    GenerationResult,
    RequestHandle,
)
from workers.engine.counters import RATE_MIN_PROMPT_TOKENS, EngineCounters
from workers.kv_cache import PublishEvents
from workers.prompt_layout import ImageInput, PromptError, VideoInput, stored_frames, video_run
from workers.vllm_engine.kv_events import KvEventTranslator
from workers.vllm_engine.prompt import (
    EnginePrompt,
    EngineVideo,
    PromptLayoutMismatch,
    check_block_hashes,
    engine_prompt,
    expanded_block_hashes,
)

logger = logging.getLogger("workers.vllm_engine")


# The families whose prompt layout this adapter has been checked against vLLM's (the demo
# checkpoints of `build_demo_model`); another family is refused at start rather than served with
# overlaps nobody checked.
SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
WARM_UP_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 8)
_START_TIMEOUT_S = 600.0  # vLLM's start on a busy 2-core machine took 77 s; a GPU's, minutes


@dataclass
class _Flight:
    """What the adapter keeps with a request while vLLM runs it."""

    request: GenerationRequest
    prompt: EnginePrompt
    events: queue.SimpleQueue
    submitted_at: float
    first_token_at: float | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_token_ids: list[int] | None = None  # vLLM's, expanded (from its first output)
    block_hashes: list[int] = field(default_factory=list)  # the routing hashes of those
    num_cached_tokens: int = 0


class _SchedulerStatsLogger:
    """Keeps vLLM's latest scheduler stats for the heartbeat (a vLLM stat logger), and the prefill
    rate measured as the native engine measures it: prompt tokens computed per second of step
    time, over steps that computed at least RATE_MIN_PROMPT_TOKENS of them (vLLM's per-step
    `iteration_details`). vLLM makes an instance itself: the engine gives each its own subclass."""

    latest: Any = None
    counters: EngineCounters

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.vllm_config = vllm_config

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ):
        if scheduler_stats is None:
            return
        type(self).latest = scheduler_stats
        step = scheduler_stats.iteration_details
        if step is not None and not step.is_dummy and step.num_ctx_tokens >= RATE_MIN_PROMPT_TOKENS:
            self.counters.note_prefill_rate(step.num_ctx_tokens, step.elapsed_ms / 1000)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


class VllmEngine(FollowsSubmitted):
    """A vLLM engine serving the worker's tasks. Implements `InferenceEngine`."""

    schedule_policy = "fcfs"  # vLLM's default scheduler: the router models its queue as it is

    def __init__(
        self,
        model_dir: Path,
        *,
        block_size: int,
        kv_cache_bytes: int,
        max_running: int,
        load_image: Callable[[ImageInput, str | None], Image.Image],
        model_name: str | None = None,
        engine_args: dict[str, Any] | None = None,
        max_model_len: int = 8192,
        publish_events: PublishEvents | None = None,
        worker_name: str = "local",
    ) -> None:
        import json

        self.model_dir = Path(model_dir)
        self.model_name = model_name or self.model_dir.name
        self.block_size = block_size
        self._max_running = max_running
        self._load_image = load_image
        config = json.loads((self.model_dir / "config.json").read_text())
        self.model_type: str = config.get("model_type", "")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"--engine vllm serves {', '.join(SUPPORTED_MODEL_TYPES)}; {self.model_dir} is "
                f"{self.model_type!r}, whose prompt layout was not checked against vLLM's"
            )
        self.image_token_id: int = int(config["image_token_id"])
        from workers.video_inputs import VideoPreprocessor

        # The family's video layout (the router's, read from the checkpoint): vLLM expands a
        # video's placeholder itself, and each request checks it did so as the router did.
        self._video = VideoPreprocessor.for_model_dir(self.model_dir)
        self.video_token_id: int | None = config.get("video_token_id") if self._video else None
        self._args = {
            "model": str(self.model_dir),
            "tokenizer": str(self.model_dir),
            "served_model_name": self.model_name,
            "enforce_eager": True,  # no graph capture: start in seconds, the same on every device
            "block_size": block_size,
            "kv_cache_memory_bytes": kv_cache_bytes,
            "enable_prefix_caching": True,
            "max_num_seqs": max_running,
            "max_model_len": max_model_len,
            "dtype": "float32" if not _has_accelerator() else "auto",
            "limit_mm_per_prompt": {"image": 8, "video": 2 if self.video_token_id is not None else 0},
            # The frontend sampled each video's frames: vLLM's processor must not sample again.
            # Set for the engine, not per request: request kwargs would enter vLLM's media hash,
            # and its KV events would then name media by a key that is not the uuid given.
            "mm_processor_kwargs": {"do_sample_frames": False},
            "disable_log_stats": False,  # the heartbeat's load comes from the scheduler stats
            "enable_logging_iteration_details": True,  # each step's prompt tokens and time
            **(engine_args or {}),
        }
        # vLLM's KV events, translated into the router's and published to the index. vLLM binds
        # an ipc endpoint of this process's own; the subscriber connects before vLLM starts.
        self._publish = publish_events
        self._translator: KvEventTranslator | None = None
        self._subscriber: KvEventSubscriber | None = None
        if publish_events is not None:
            self._translator = KvEventTranslator(worker_name, block_size)
            endpoint = f"ipc://{tempfile.gettempdir()}/vllm-kv-{worker_name}-{os.getpid()}.sock"
            self._args["kv_events_config"] = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": endpoint,
            }
            self._subscriber = KvEventSubscriber(endpoint, self._translator, publish_events)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._llm: Any = None
        self._tokenizer: Any = None
        self._in_flight: dict[str, _Flight] = {}
        self._lock = threading.Lock()
        self._generated_tokens = 0
        self._running_peak = 0
        self.kv_capacity_blocks = 0
        # Once vLLM's engine core has died: every request fails with it (EngineDead), and the
        # worker's `on_dead` (its going away) is called once, from the thread that found out.
        self.dead: EngineDead | None = None
        self.on_dead: Callable[[EngineDead], None] | None = None

    # --- start and stop --------------------------------------------------------------------------------
    def start(self) -> VllmEngine:
        """Starts the loop thread and vLLM in it (vLLM's engine core starts as a child process)."""
        if self._subscriber is not None:
            self._publish([KvEvent("cleared", self._translator.worker)])  # vLLM starts empty
            self._subscriber.start()
        self._thread.start()
        self._call(self._start(), timeout=_START_TIMEOUT_S)
        cache = self._llm.vllm_config.cache_config
        if cache.block_size != self.block_size:
            raise ValueError(
                f"vLLM runs with blocks of {cache.block_size} tokens but KV_BLOCK_SIZE is "
                f"{self.block_size}: the router's block hashes would never match vLLM's cache"
            )
        self.kv_capacity_blocks = int(cache.num_gpu_blocks or 0)
        return self

    async def _start(self) -> None:
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = type(
            "SchedulerStatsLogger", (_SchedulerStatsLogger, StatLoggerBase), {"counters": EngineCounters()}
        )
        # vLLM's own stat logger prints each step's details at INFO once they are on (they are,
        # for the prefill rate): those lines are dropped, its periodic summary is kept.
        logging.getLogger("vllm.v1.metrics.loggers").addFilter(_without_step_lines)
        self._stats_logger = stats
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._args), stat_loggers=[stats])
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)

    def close(self, timeout: float = 30.0) -> None:
        """Stops vLLM (its engine core process too) and the loop thread."""
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if self._subscriber is not None:
            self._subscriber.stop()

    # --- the protocol ------------------------------------------------------------------------------------
    @property
    def max_running(self) -> int:
        return self._max_running

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Builds the prompt in the caller's thread (tokens, decoded images, uuids) and hands the
        request to the loop. Bad requests raise PromptError here, as the native engine's do."""
        submitted_at = time.perf_counter()
        if isinstance(request.max_tokens, bool) or not isinstance(request.max_tokens, int):
            raise PromptError("max_tokens must be an integer")
        if request.max_tokens < 1:
            raise PromptError("max_tokens must be >= 1")
        if request.processed is not None:
            raise PromptError("this worker runs vLLM, which preprocesses images itself")
        if self.dead is not None:
            raise EngineDead(str(self.dead))
        token_ids = self._tokenizer.encode(request.prompt, add_special_tokens=False)
        images = [self._load_image(image, request.scope_key) for image in request.images]
        videos = [self._engine_video(video) for video in request.videos]
        prompt = engine_prompt(
            token_ids,
            self.image_token_id,
            images,
            [image.identity for image in request.images],
            request.cache_salt,
            continued=request.continued_token_ids,
            videos=videos,
            video_token_id=self.video_token_id,
        )
        if self._translator is not None:
            self._translator.remember_media(prompt.media_uuids, prompt.media_routing_hashes)
        flight = _Flight(
            request=request, prompt=prompt, events=queue.SimpleQueue(), submitted_at=submitted_at
        )
        with self._lock:
            if request.request_id in self._in_flight:
                raise PromptError(f"request {request.request_id} is already running here")
            self._in_flight[request.request_id] = flight
        running = asyncio.run_coroutine_threadsafe(self._run(flight), self._loop)

        def cancel() -> None:
            # Cancels the request's task in the loop: vLLM's `generate` aborts the request in
            # its engine core on the way out, and `_run` reports what was generated so far.
            running.cancel()

        return RequestHandle(request.request_id, flight.events, cancel)

    def _engine_video(self, video: VideoInput) -> EngineVideo:
        """A task's video as vLLM takes it: its sampled frames from the side store, and the token
        run the router expanded its placeholder into (refused where this worker's layout of the
        model disagrees with the task's grid)."""
        import numpy as np

        if self._video is None or self.video_token_id is None:
            raise PromptError(f"this model ({self.model_type}) takes no video")
        frames = stored_frames(video)
        count, height, width, channels = video.frame_shape
        if channels != 3:
            raise PromptError(f"video {video.identity}: its frames have {channels} channels, not 3")
        expansion = video_run(self._video, self._tokenizer, video, self.video_token_id)
        return EngineVideo(
            frames=np.frombuffer(frames, dtype=np.uint8).reshape(count, height, width, channels),
            fps=video.fps,
            total_frames=video.total_frames,
            indices=tuple(video.indices),
            identity=video.identity,
            expansion=tuple(expansion),
        )

    def load_report(self) -> EngineLoad:
        llm = self._llm
        if llm is not None and llm.errored and self.dead is None:
            # The engine core died with no request running to tell (the heartbeat asks).
            self._died(llm.dead_error)
        stats = self._stats_logger.latest if llm is not None else None
        with self._lock:
            in_flight = len(self._in_flight)
        running = stats.num_running_reqs if stats is not None else min(in_flight, self._max_running)
        waiting = stats.num_waiting_reqs if stats is not None else max(0, in_flight - running)
        # vLLM reports the share of blocks in use, not counts; its cached-but-free blocks count as
        # free, as the native engine counts evictable blocks.
        used = round((stats.kv_cache_usage if stats is not None else 0.0) * self.kv_capacity_blocks)
        self._running_peak = max(self._running_peak, running)
        return EngineLoad(
            running=running,
            running_peak=self._running_peak,
            waiting=waiting,
            kv_blocks_used=used,
            kv_blocks_free=self.kv_capacity_blocks - used,
            kv_blocks_cached=0,  # not reported by vLLM's stats; its KV events will say
            forward_passes=0,
            generated_tokens=self._generated_tokens,
            preemptions=0,
            prefill_tokens_per_s=self._stats_logger.counters.prefill_tokens_per_s if llm is not None else 0.0,
        )

    def kv_block_hashes(self) -> set[int]:
        """The router hashes of the blocks vLLM holds, as its KV events said (the mirror); none
        without events (approximate mode: the router credits what it routed here)."""
        return self._translator.held() if self._translator is not None else set()

    def clear_kv_cache(self) -> int:
        """vLLM's `reset_prefix_cache` (its `AllBlocksCleared` event tells the index); the blocks
        the mirror held."""
        held = len(self.kv_block_hashes())
        done = self._call(self._llm.reset_prefix_cache(), timeout=60)
        if not done:
            logger.warning("vLLM did not reset its prefix cache (requests were running)")
            return 0
        return held

    def warm_up(self) -> float:
        """One short text prompt, then an empty prefix cache: no user request pays the first
        forward pass, and nothing cached is left that the router was not told about."""
        started = time.perf_counter()
        self.generate(
            GenerationRequest(
                request_id="warm-up", prompt=WARM_UP_PROMPT, images=[], max_tokens=2, ignore_eos=True
            )
        )
        self._call(self._llm.reset_prefix_cache(), timeout=60)
        self._generated_tokens = 0
        self._stats_logger.counters.reset()  # the warm-up's first step is no measure
        return (time.perf_counter() - started) * 1000

    # --- the loop's side ---------------------------------------------------------------------------------
    async def _run(self, flight: _Flight) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        request = flight.request
        try:
            async for output in self._llm.generate(
                flight.prompt.as_tokens_prompt(), self._sampling_params(request), request.request_id
            ):
                if flight.prompt_token_ids is None and output.prompt_token_ids is not None:
                    self._check_layout(flight, output.prompt_token_ids)
                self._accept(flight, output)
                if output.finished:
                    flight.events.put((DONE, self._result(flight, output)))
                    return
            # The stream ended without a finished output: vLLM aborted it.
            logger.debug(
                "request %s ended unfinished: vLLM aborted it after %d tokens",
                request.request_id,
                flight.completion_tokens,
            )
            flight.events.put((DONE, self._result(flight, None)))
        except asyncio.CancelledError:
            # A cancel (`RequestHandle.cancel`): vLLM has aborted it; the caller gets what came.
            logger.debug(
                "request %s cancelled: vLLM aborted it after %d tokens",
                request.request_id,
                flight.completion_tokens,
            )
            flight.events.put((DONE, self._result(flight, None)))
        except VLLMClientError as exc:
            # vLLM refused the request itself (too long for its context, say): the client's error.
            flight.events.put((ERROR, PromptError(str(exc))))
        except EngineDeadError as exc:
            # vLLM's engine core died under it: the worker goes away, and the frontend moves the
            # request on (after tokens, another worker continues it).
            flight.events.put((ERROR, self._died(exc)))
        except Exception as exc:
            if not isinstance(exc, PromptLayoutMismatch):
                logger.warning("vLLM failed request %s: %s", request.request_id, exc)
            await self._llm.abort(request.request_id)
            flight.events.put((ERROR, exc))
        finally:
            with self._lock:
                self._in_flight.pop(request.request_id, None)

    def _died(self, cause: BaseException) -> EngineDead:
        """Records the engine's death and returns the error each request fails with. The first to
        find out calls the worker's `on_dead` before failing its own request, so the worker has
        left the fleet before that request is moved on (the others are sent to a worker they
        have not tried, whenever they fail)."""
        with self._lock:
            first = self.dead is None
            if first:
                self.dead = EngineDead(
                    f"vLLM's engine core died ({type(cause).__name__}); this worker is going away"
                )
        if first:
            logger.error("vLLM's engine core died: %s", cause)
            if self.on_dead is not None:
                try:
                    self.on_dead(self.dead)
                except Exception:
                    logger.exception("the worker's leaving after vLLM's engine core died failed")
        return EngineDead(str(self.dead))

    def _check_layout(self, flight: _Flight, expanded: Sequence[int]) -> None:
        """vLLM's expanded prompt, hashed as the router hashed its token view, against the task's
        block hashes: before the first piece goes out, so a mismatch is never a silent answer. A
        continued answer's tokens follow the prompt; the router hashed the prompt alone."""
        request = flight.request
        flight.prompt_token_ids = list(expanded)
        flight.block_hashes = actual = expanded_block_hashes(
            flight.prompt_token_ids,
            self.image_token_id,
            flight.prompt.routing_hashes,
            self.block_size,
            request.cache_salt,
            videos=flight.prompt.videos,
            video_token_id=self.video_token_id,
        )
        if request.continued_token_ids:
            # Full blocks chain from the start, and the continued tokens hold no media: the
            # prompt's own blocks are the first of them.
            prompt_tokens = len(expanded) - len(request.continued_token_ids)
            actual = actual[: prompt_tokens // self.block_size]
        check_block_hashes(
            request.expected_block_hashes or (),
            actual,
            model_type=self.model_type,
            block_size=self.block_size,
        )
        if request.expected_block_hashes:
            logger.debug(
                "request %s: vLLM's layout agrees with the router's on %d blocks",
                request.request_id,
                len(actual),
            )

    def _accept(self, flight: _Flight, output: Any) -> None:
        completion = output.outputs[0]
        new_tokens = len(completion.token_ids)
        if new_tokens and flight.first_token_at is None:
            flight.first_token_at = time.perf_counter()
            flight.events.put((FIRST, flight.first_token_at))
        flight.completion_tokens += new_tokens
        self._generated_tokens += new_tokens
        flight.num_cached_tokens = output.num_cached_tokens or flight.num_cached_tokens
        logprobs = None
        if flight.request.logprobs and completion.logprobs:
            logprobs = [
                _openai_logprob(token, entry, flight.request.top_logprobs)
                for token, entry in zip(completion.token_ids, completion.logprobs, strict=False)
            ]
            flight.logprobs.extend(logprobs)
        if completion.text:
            flight.text.append(completion.text)
            flight.events.put((TOKEN, (completion.text, logprobs, list(completion.token_ids))))

    def _result(self, flight: _Flight, output: Any) -> GenerationResult:
        finished = time.perf_counter()
        first = flight.first_token_at or finished
        reason = output.outputs[0].finish_reason if output is not None else None
        prompt_ids = flight.prompt_token_ids or flight.prompt.token_ids
        return GenerationResult(
            text="".join(flight.text),
            # vLLM's "abort" is a cancel, which the native engine reports as "stop" too.
            finish_reason="length" if reason == "length" else "stop",
            prompt_tokens=len(prompt_ids),
            completion_tokens=flight.completion_tokens,
            cached_tokens=flight.num_cached_tokens,
            ttft_ms=(first - flight.submitted_at) * 1000,
            prefill_ms=(first - flight.submitted_at) * 1000,
            total_ms=(finished - flight.submitted_at) * 1000,
            encoder_calls=0,
            embedding_cache_hits=0,
            embedding_cache_misses=0,
            block_hashes=list(flight.block_hashes),
            logprobs=flight.logprobs if flight.request.logprobs else None,
        )

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=list(request.stop) or None,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            logit_bias=dict(request.logit_bias) or None,
            logprobs=request.top_logprobs if request.logprobs else None,
            ignore_eos=request.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )

    def _call(self, coroutine: Any, *, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)


class KvEventSubscriber:
    """Reads vLLM's ZMQ KV event stream on a thread of its own and publishes it, translated.

    vLLM numbers its batches: a gap (a batch lost, say at a slow subscriber's high-water mark)
    means the mirror missed something, so the worker re-announces what its mirror holds
    (`cleared` then `stored`); later events correct what the gap hid."""

    def __init__(self, endpoint: str, translator: KvEventTranslator, publish: PublishEvents) -> None:
        self.endpoint = endpoint
        self._translator = translator
        self._publish = publish
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._decoder: Any = None  # vLLM's batch decoder, made by `start`
        self.gaps = 0

    def start(self) -> None:
        # Imported here, in the starting thread, not in the thread started: the engine's loop
        # thread imports vLLM (torch, setuptools) next, and setuptools' distutils shim, which
        # swaps `sys.modules["distutils"]` and its finder in and out, is not thread-safe (a worker
        # died at start with "No module named 'distutils.compat'" when both threads imported).
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch  # (it imports zmq too)

        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import zmq  # loaded already (start)

        decoder = self._decoder
        context = zmq.Context.instance()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.connect(self.endpoint)
        last: int | None = None
        try:
            while not self._stop.is_set():
                if not socket.poll(200):
                    continue
                _topic, seq_bytes, payload = socket.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                events = self._translator.translate(decoder.decode(payload).events)
                if last is not None and seq != last + 1:
                    self.gaps += 1
                    logger.warning("vLLM KV events %d..%d lost: re-announcing the mirror", last + 1, seq - 1)
                    held = tuple(self._translator.held())
                    worker = self._translator.worker
                    events = [
                        KvEvent("cleared", worker),
                        *([KvEvent("stored", worker, held)] if held else []),
                    ]
                last = seq
                if events:
                    try:
                        self._publish(events)
                    except Exception:  # a Redis hiccup: the epoch check re-announces if data went
                        logger.warning("publishing vLLM's KV events failed", exc_info=True)
        finally:
            socket.close(linger=0)


def _openai_logprob(token: int, entry: dict[int, Any], top: int) -> dict[str, Any]:
    """One token's vLLM logprobs (token id -> Logprob) in OpenAI's shape."""

    def shaped(token_id: int, logprob: Any) -> dict[str, Any]:
        text = logprob.decoded_token or ""
        return {"token": text, "logprob": float(logprob.logprob), "bytes": list(text.encode("utf-8"))}

    chosen = shaped(token, entry[token]) if token in entry else {"token": "", "logprob": 0.0, "bytes": []}
    ranked = sorted(entry.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return {**chosen, "top_logprobs": [shaped(t, lp) for t, lp in ranked[:top]]}


def _without_step_lines(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("%sIteration(")


def _has_accelerator() -> bool:
    import torch

    return bool(torch.cuda.is_available()) and os.environ.get("VLLM_TARGET_DEVICE", "") != "cpu"
