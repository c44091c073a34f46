"""The worker process's state (its engine, name and Redis connections) and how it serves one task.

`run_worker` builds the runtime once, before Celery starts consuming, so the model is loaded
once per process and never forked; the Celery task hands each payload to `serve`.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from PIL import Image

from routing.contract.responses import ResponseWriter
from routing.contract.tasks import (
    DONE,
    ContractError,
    DoneEvent,
    ErrorEvent,
    FlushCachesTask,
    GenerateTask,
    ImageRef,
    StartedEvent,
    TokenEvent,
    VideoRef,
)
from routing.fleet.registry import Heartbeat
from routing.media.images import MediaError, MediaPolicy, fetch_bytes
from routing.media.store import MediaRef, MediaStore, MediaStoreError
from routing.observe import telemetry
from routing.observe.cache_stats import CacheStats
from routing.prompt.hashing import partition_salt
from workers.image_loader import ImageLoader, ImageLoadError
from workers.shared_image_cache import SharedImageCache, SharedImageCacheConfig

if TYPE_CHECKING:
    from workers.engine.api import InferenceEngine

logger = logging.getLogger("workers.runtime")

# How often a running request checks whether the frontend asked it to stop.
_CANCEL_CHECK_INTERVAL_S = 0.25


class NoRuntime(RuntimeError):
    """A task arrived in a process that `run_worker` did not set up."""


@dataclass
class WorkerRuntime:
    name: str
    engine: InferenceEngine  # the native engine or a hosted one (workers.engine.api)
    client: redis.Redis
    namespace: str
    session_scoped: bool = False
    stats: CacheStats | None = None
    image_loader: ImageLoader | None = None
    instance: str = ""  # this process's instance id (routing.fleet.registry.new_instance_id)
    media: MediaStore | None = None  # the side store the frontend put image bytes in
    features: Any = None  # workers.disaggregation.FeatureReceiver: E/PD features from encode workers
    # Its model's fingerprint (routing.prompt.model_card): the KV partition its block hashes fold
    # in, as the frontend's do ("": none, for an engine run without a card).
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        if self.media is None:
            from django.conf import settings

            from routing.media.store import media_store_from_settings

            self.media = media_store_from_settings(self.client, self.namespace, settings)

        self._in_engine = 0
        self._gauge_lock = threading.Lock()

    def flush(self, payload: dict[str, Any] | FlushCachesTask) -> None:
        """Drop this worker's caches (or one session scope's entries) and report what went.

        The KV cache is content-based, never partitioned by scope: a scoped flush leaves it alone.
        """
        raw_id = payload.flush_id if isinstance(payload, FlushCachesTask) else payload.get("flush_id")
        writer = ResponseWriter(self.client, self.namespace, str(raw_id))
        try:
            task = (
                payload
                if isinstance(payload, FlushCachesTask)
                else FlushCachesTask.from_payload(payload, worker=self.name)
            )
        except ContractError as exc:
            logger.warning("flush %s refused: %s", raw_id, exc)
            writer.emit(ErrorEvent(status=exc.status, code=exc.code, message=str(exc)))
            return
        scope_key, dry_run = task.scope_key, task.dry_run
        report: dict[str, Any] = {"worker": self.name, "dry_run": dry_run}
        try:
            if task.kv and scope_key is None:
                blocks = len(self.engine.kv_block_hashes())
                report["kv_blocks"] = blocks if dry_run else self.engine.clear_kv_cache()
            # An engine that keeps no embedding cache of the platform's (vLLM keeps its own).
            cache = getattr(self.engine, "embedding_cache", None)
            if task.embeddings and cache is None:
                report["embeddings"] = "off"
            elif task.embeddings:
                if dry_run:
                    report["embeddings"] = cache.count(scope_key)
                else:
                    report["embeddings"] = (
                        cache.clear() if scope_key is None else cache.discard_scope(scope_key)
                    )
            if task.images and self.image_loader is not None:
                loader = self.image_loader
                report["decoded_images"] = (
                    loader.local_count(scope_key) if dry_run else loader.clear_local(scope_key)
                )
            if task.shared_images:
                flushed = (
                    None
                    if self.image_loader is None
                    else self.image_loader.flush_shared(scope_key, dry_run=dry_run)
                )
                report["shared_images"] = "off" if flushed is None else flushed
            self.report_engine_gauges()  # the embedding cache's size, at once
        except Exception as exc:
            logger.exception("flush on worker %s failed", self.name)
            writer.emit(ErrorEvent(status=500, code="flush_failed", message=f"{type(exc).__name__}: {exc}"))
            return
        logger.info("caches flushed on worker %s: %s", self.name, report)
        writer.send(DONE, **report)

    def cache_partition(self, scope_key: str | None, cache_salt: int | None) -> str | None:
        """The key that partitions this request's image and embedding caches.

        With session scoping on, the scope (the frontend binds it to the tenant; none: the
        caches are bypassed); otherwise the caller's cache partition, so one tenant's cached
        images and embeddings are neither reused nor timed by another (None: the shared pool).
        """
        if self.session_scoped:
            return scope_key
        return None if cache_salt is None else f"salt-{cache_salt:016x}"

    def serve(self, payload: dict[str, Any] | GenerateTask) -> None:
        from workers.engine.api import EngineFailure, GenerationRequest
        from workers.prompt_layout import ImageInput, VideoInput

        raw_id = payload.request_id if isinstance(payload, GenerateTask) else payload.get("request_id")
        writer = ResponseWriter(self.client, self.namespace, str(raw_id))
        try:
            task = (
                payload
                if isinstance(payload, GenerateTask)
                else GenerateTask.from_payload(payload, worker=self.name)
            )
        except ContractError as exc:
            # A frontend of another contract version (a rolling upgrade gone wrong) or a
            # malformed payload: say so on the stream rather than guess at the fields.
            logger.warning("request %s refused: %s", raw_id, exc)
            writer.emit(ErrorEvent(status=exc.status, code=exc.code, message=str(exc)))
            return
        request_id = task.request_id
        writer.follow(task.follow_id)
        if writer.cancelled():
            logger.info("request %s was cancelled before it started", request_id)
            self._drop_abandoned(task, writer)
            return
        writer.emit(StartedEvent(worker=self.name, instance=self.instance))
        labels = {"worker": self.name}
        if task.dispatched_at is not None:
            telemetry.observe("queue_seconds", max(0.0, time.time() - task.dispatched_at), labels=labels)
        on_piece = _timing_tokens(
            lambda text, logprobs, token_ids: writer.emit(
                TokenEvent(text=text, logprobs=logprobs, token_ids=token_ids)
            ),
            labels,
        )
        self._engine_entered(+1)
        try:
            cache_salt = _cache_salt(task.cache_salt)
            partition = self.cache_partition(task.scope_key, cache_salt)
            request = GenerationRequest(
                request_id=request_id,
                prompt=task.prompt,
                images=_image_inputs(ImageInput, task.images, self.media),
                max_tokens=task.max_tokens,
                temperature=task.temperature,
                top_p=task.top_p,
                seed=task.seed,
                stop=list(task.stop),
                scope_key=partition,
                cache_salt=partition_salt(self.model_fingerprint, cache_salt),
                presence_penalty=task.presence_penalty,
                frequency_penalty=task.frequency_penalty,
                logit_bias=task.token_bias,
                logprobs=task.logprobs,
                top_logprobs=task.top_logprobs,
                # With scoping on, a request without a scope shares no cache with anyone.
                use_embedding_cache=not (self.session_scoped and not task.scope_key),
                processed=_processed_inputs(task.processed, self.media),
                videos=_video_inputs(VideoInput, task.videos, self.media),
                expected_block_hashes=task.block_hashes,
                continued_token_ids=list(task.continued_token_ids),
                prompt_tokens=task.prompt_tokens,
                image_ends=task.image_ends,
                priority=task.priority or 0,
            )
            receipts: list[Any] = []
            await_features = None
            if task.encoder and task.encoded_images and self.features is not None:
                expected = [request.images[i] for i in task.encoded_images if 0 <= i < len(request.images)]
                for image in expected:
                    image.features_expected = True

                def await_features() -> None:
                    # Outside the model: other requests run, and the engine encodes the images
                    # this worker keeps, while this thread waits for the encode worker's.
                    receipts.append(self.features.receive(task, request.images))

            result = self.engine.generate(
                request,
                on_piece=on_piece,
                should_stop=_throttled(writer.cancelled, _CANCEL_CHECK_INTERVAL_S),
                await_features=await_features,
            )
            receipt = receipts[0] if receipts else None
            if self._drop_abandoned(task, writer):
                return
            if writer.cancel_seen:
                logger.info(
                    "request %s stopped after %d tokens: its frontend cancelled it "
                    "(the client went away, or it timed out)",
                    request_id,
                    result.completion_tokens,
                )
        except Exception as exc:
            status = getattr(exc, "status", None)
            if isinstance(exc, MediaError | ImageLoadError) and isinstance(status, int) and status >= 500:
                # The origin failed or timed out when the worker fetched the image: still a
                # problem with the request's image, answered as the frontend answers it (a 4xx).
                status = 400
            if isinstance(exc, MediaStoreError):
                # A reference whose bytes are gone: say so plainly, it is no fault of the engine.
                writer.emit(ErrorEvent(status=exc.status, code=exc.code, message=exc.message))
                logger.warning("request %s: %s", request_id, exc.message)
            elif isinstance(exc, EngineFailure):
                # An engine's own named failure (vLLM laid the prompt out differently from the
                # router, say): its message says what went wrong, and it is no client's fault.
                writer.emit(ErrorEvent(status=exc.status, code=exc.code, message=str(exc)))
                logger.error("request %s failed on worker %s: %s", request_id, self.name, exc)
            elif isinstance(status, int) and 400 <= status < 500:
                # The request itself was bad (an image the origin refused, say): the client's error.
                writer.emit(
                    ErrorEvent(
                        status=status,
                        code=getattr(exc, "code", "invalid_request"),
                        message=str(exc),
                        param=getattr(exc, "param", None),
                        # which of the request's images, so the frontend can name its message part
                        image_index=getattr(exc, "image_index", None),
                    )
                )
                logger.info("request %s refused: %s", request_id, exc)
            else:
                logger.exception("request %s failed on worker %s", request_id, self.name)
                message = f"The worker failed: {type(exc).__name__}"
                writer.emit(ErrorEvent(status=502, code="worker_error", message=message))
            return
        finally:
            self._engine_entered(-1)
        self._count(result)
        telemetry.observe("engine_ttft_seconds", result.ttft_ms / 1000, labels=labels)
        writer.emit(
            DoneEvent(
                text=result.text,
                finish_reason=result.finish_reason,
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                cached_tokens=result.cached_tokens,
                ttft_ms=result.ttft_ms,
                prefill_ms=result.prefill_ms,
                total_ms=result.total_ms,
                encoder_calls=result.encoder_calls,
                embedding_cache_hits=result.embedding_cache_hits,
                embedding_cache_misses=result.embedding_cache_misses,
                worker=self.name,
                embeddings_received=result.embeddings_received,
                embedding_fallbacks=result.embedding_fallbacks
                + (sum(receipt.fallbacks.values()) if receipt is not None else 0),
                logprobs=result.logprobs,
            )
        )

    def report_engine_gauges(self) -> None:
        """Report the engine's gauges now (at start, before any request changes them)."""
        self._engine_entered(0)

    def _engine_entered(self, step: int) -> None:
        """The engine gauges, from the engine's own report: requests in its batch, waiting, and
        KV pool blocks held by running requests and free (free or evictable)."""
        with self._gauge_lock:
            self._in_engine += step
        labels = {"worker": self.name}
        report = self.engine.load_report()
        telemetry.set_gauge("engine_running_requests", report.running, labels=labels)
        telemetry.set_gauge("engine_waiting_requests", report.waiting, labels=labels)
        telemetry.set_gauge("engine_kv_blocks_used", report.kv_blocks_used, labels=labels)
        telemetry.set_gauge("engine_kv_blocks_free", report.kv_blocks_free, labels=labels)
        cache = getattr(self.engine, "embedding_cache", None)
        if cache is not None:  # what the dashboard's E/PD table shows for this worker's embeddings
            telemetry.set_gauge("embedding_cache_entries", len(cache), labels=labels)

    def serve_encode(self, payload: dict[str, Any]) -> None:
        if self.features is not None:
            self.features.refuse_encode(payload)

    def _drop_abandoned(self, task: GenerateTask, writer: ResponseWriter) -> bool:
        """A request whose frontend died: nobody reads its answer, and nobody will free its load."""
        if not writer.abandoned or not task.follow_id:
            return False
        from django.conf import settings

        from routing.kv.load import LoadTracker

        load = LoadTracker(self.client, self.namespace, entry_ttl_s=settings.ROUTER_LOAD_ENTRY_TTL_SECS)
        freed = load.free(self.name, task.follow_id)
        logger.warning(
            "request %s dropped: its frontend went away (liveness mark expired)%s",
            task.request_id,
            "; its load is freed" if freed else "",
        )
        return True

    def _count(self, result: Any) -> None:
        if self.stats is None:
            return
        self.stats.incr("kv", "hits" if result.cached_tokens else "misses")
        self.stats.incr("kv", "cached_tokens", result.cached_tokens)
        self.stats.incr("kv", "prompt_tokens", result.prompt_tokens)
        self.stats.incr("embedding", "hits", result.embedding_cache_hits)
        self.stats.incr("embedding", "misses", result.embedding_cache_misses)


class EngineImageLoader(ImageLoader):
    """The worker's image loader, in the shape the engine calls it."""

    @property
    def shared_cache_description(self) -> str:
        """What the admin shows of the shared cache: its URL without the password, or "off"."""
        return "off" if self._shared is None else self._shared.config.redacted_url

    def load_for_engine(self, image: Any, scope_key: str | None) -> Image.Image:
        """The decoded image; a refusal names the image as the frontend's would ("image 0: ...")."""
        try:
            if image.data is not None:
                return self.load_bytes(image.identity, image.data, scope_key=scope_key).image
            if image.url is None:
                raise ImageLoadError(
                    400, f"image {image.identity} has neither bytes nor a URL", "invalid_image"
                )
            return self.load(image.url, image.identity, scope_key=scope_key).image
        except (MediaError, ImageLoadError) as exc:
            if image.index is None:
                raise
            raise exc.for_image(image.index) from None


def build_image_loader(worker: str, stats: CacheStats | None, model_path: Any = None) -> EngineImageLoader:
    """The loader with the deployment's caches: local LRU, in-flight dedup, shared cache, origin.

    With the model's directory, images larger than its processor keeps are decoded reduced."""
    from django.conf import settings

    config = SharedImageCacheConfig.from_env(os.environ)
    policy = MediaPolicy(
        max_bytes=config.max_file_size_bytes,
        connect_timeout=settings.MEDIA_CONNECT_TIMEOUT_SECS,
        read_timeout=settings.MEDIA_READ_TIMEOUT_SECS,
        deadline=settings.MEDIA_FETCH_DEADLINE_SECS,
        allowed_hosts=tuple(settings.MEDIA_ALLOWED_HOSTS),
        max_pixels=settings.MEDIA_MAX_PIXELS,
    )
    shared = (
        SharedImageCache(config, stats=stats, key_prefix=settings.SHARED_IMAGE_CACHE_KEY_PREFIX)
        if config.enabled
        else None
    )
    return EngineImageLoader(
        fetch=lambda url, headers: fetch_bytes(url, policy, headers=headers, expect_image=True),
        shared_cache=shared,
        local_capacity=settings.IMAGE_LOCAL_CACHE_ENTRIES,
        session_scoped=config.session_scoped,
        max_bytes=config.max_file_size_bytes,
        max_pixels=settings.MEDIA_MAX_PIXELS,
        stats=stats,
        worker=worker,
        target_size=processor_target_size(model_path) if model_path is not None else None,
    )


def processor_target_size(model_path: Any):
    """(width, height) -> the (width, height) the model's processor resizes an image to, for the
    families whose processor resizes every image to a size computed from its own (Qwen-VL); None
    for others (LLaVA-NeXT's token count depends on the pixels it is given)."""
    from routing.prompt.layouts import layout_for_model_dir

    layout = layout_for_model_dir(model_path)
    resized_size = getattr(layout, "resized_size", None)
    if resized_size is None:
        return None

    def target(width: int, height: int) -> tuple[int, int]:
        resized_height, resized_width = resized_size(width, height)
        return resized_width, resized_height

    return target


def _image_inputs(image_input_class, images: Sequence[ImageRef], media: MediaStore) -> list:
    """ImageInputs from the task's images; bytes the frontend holds are read from the side store,
    all in one round trip, once."""
    refs = [MediaRef(image.media_ref, image.media_bytes) for image in images if image.media_ref]
    blobs = iter(media.get_many(refs))
    return [
        _image_input(image_input_class, image, index, next(blobs) if image.media_ref else None)
        for index, image in enumerate(images)
    ]


def _video_inputs(video_input_class, videos: Sequence[VideoRef], media: MediaStore) -> list:
    """VideoInputs from the task's videos: their frames are read from the side store only when the
    engine needs them (a video its cached prefix covers is never read)."""

    def reader(video: VideoRef):
        if not video.media_ref:
            return None
        ref = MediaRef(video.media_ref, video.media_bytes)
        return lambda: media.get(ref)

    return [
        video_input_class(
            identity=video.identity,
            fps=video.fps,
            total_frames=video.total_frames,
            indices=tuple(video.indices),
            width=video.width,
            height=video.height,
            grid_thw=tuple(video.grid_thw),
            frame_shape=tuple(video.frame_shape),
            load_frames=reader(video),
        )
        for video in videos
    ]


def _image_input(image_input_class, image: ImageRef, index: int, stored: bytes | None = None):
    """An ImageInput from the task's image (the task's images are the request's, in order):
    bytes from the side store, or base64 in the task."""
    if stored is None and image.data_b64:
        stored = base64.b64decode(image.data_b64)
    return image_input_class(
        identity=image.identity,
        url=image.url,
        index=index,
        data=stored,
        width=image.width,
        height=image.height,
    )


def _cache_salt(raw: Any) -> int | None:
    """The task's cache salt (16 hex digits) as the u64 the block hashes fold in."""
    if raw is None:
        return None
    from workers.prompt_layout import PromptError

    try:
        salt = int(str(raw), 16)
    except ValueError:
        salt = -1
    if not 0 <= salt < 1 << 64:
        raise PromptError("the task's cache_salt is not a hex u64")
    return salt


def _processed_inputs(processed: dict[str, Any] | None, media: MediaStore | None) -> dict[str, Any] | None:
    """The frontend processor's inputs as tensors (the processor path), or None (preprocess here).
    Their tensors come from the media side store (MediaMissing if gone, answered as such)."""
    if processed is None:
        return None
    from routing.prompt.processor_view import decode_processed
    from workers.prompt_layout import PromptError

    def load(payload: Mapping[str, Any]) -> bytes:
        if media is None:
            raise ValueError("this worker has no media side store")
        return media.get(MediaRef.from_payload(payload))

    try:
        return decode_processed(processed, load)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        # A payload that does not decode is this request's fault, not the worker's.
        raise PromptError(f"the processed inputs do not decode: {exc}") from exc


def _timing_tokens(send, labels: dict[str, str]):
    """`send`, observing the time between consecutive tokens of one request."""
    last: list[float] = []

    def on_piece(text: str, logprobs: list[dict[str, Any]] | None, token_ids: list[int]) -> None:
        now = time.monotonic()
        if last:
            telemetry.observe("inter_token_seconds", now - last[0], labels=labels)
            last[0] = now
        else:
            last.append(now)
        send(text, logprobs, token_ids)

    return on_piece


def _throttled(check, interval_s: float):
    """`check`, called at most once per interval; in between, its last answer."""
    state = {"at": 0.0, "answer": False}
    lock = threading.Lock()

    def throttled() -> bool:
        now = time.monotonic()
        with lock:
            if now - state["at"] >= interval_s:
                state["at"] = now
                state["answer"] = bool(check())
            return state["answer"]

    return throttled


def heartbeat_with_load(heartbeat: Heartbeat, engine: InferenceEngine) -> Heartbeat:
    """The heartbeat with the engine's state now (what the router's busy check and drain read)."""
    load = engine.load_report()
    return dataclasses.replace(
        heartbeat,
        running=load.running,
        waiting=load.waiting,
        max_running=engine.max_running,
        kv_blocks_used=load.kv_blocks_used,
        kv_blocks_free=load.kv_blocks_free,
        running_peak=load.running_peak,
        forward_passes=load.forward_passes,
        generated_tokens=load.generated_tokens,
        prefill_tokens_per_s=round(load.prefill_tokens_per_s, 1),
        schedule_policy=engine.schedule_policy,
    )


# A WorkerRuntime, or an encode worker's workers.disaggregation.EncodeRuntime (same task methods);
# a process of many simulated workers installs one per queue (`run_worker --engine sim --count N`).
_runtime: Any = None
_runtimes_by_queue: dict[str, Any] = {}


def install_runtime(runtime: Any, queue: str | None = None) -> None:
    """The runtime that serves this process's tasks, or with `queue`, those of that queue."""
    global _runtime
    if queue is None:
        _runtime = runtime
    else:
        _runtimes_by_queue[queue] = runtime


def current_runtime(queue: str | None = None) -> Any:
    """The runtime for a task that came from `queue` (its delivery's routing key)."""
    runtime = _runtimes_by_queue.get(queue, _runtime) if queue is not None else _runtime
    if runtime is None:
        raise NoRuntime(f"this process was not started by `manage.py run_worker` (queue {queue!r})")
    return runtime
