"""Encoder disaggregation (E/PD) on the workers: the encode worker's runtime, which turns images
into features in the side store, and the LLM worker's receipt of them.

The LLM worker waits for its features outside the model (other requests keep running), at most
the task's `encode_wait_s`, and watches the encode worker's heartbeat meanwhile. Whatever does not
arrive intact (the encoder failed, died or is late; the blob expired or fails its checksum) is
encoded locally: logged, counted by cause, never a failed request.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from routing.contract.responses import ResponseWriter
from routing.contract.tasks import ContractError, EncodeTask, ErrorEvent, GenerateTask
from routing.fleet.encoders import EncoderPool, cache_partition, cache_tag
from routing.fleet.registry import WorkerRegistry
from routing.media.store import MediaRef, MediaStore, MediaStoreError
from workers.embedding_cache import EmbeddingCache, EmbeddingKey
from workers.embedding_transfer import CorruptEmbedding, EmbeddingLabel, pack_embedding, unpack_embedding
from workers.image_loader import SOURCE_SIZE

logger = logging.getLogger("workers.disaggregation")

# The longest single wait for the next signal: between waits the encoder's heartbeat is checked.
_SIGNAL_POLL_S = 0.5


class TowerCounter:
    """A forward hook on a vision tower: every run is counted (`tower_forwards`), so an operator
    (and the tests) can see that an LLM worker fed by encode workers never encoded."""

    def __init__(self, pool: EncoderPool, worker: str) -> None:
        self._pool = pool
        self._worker = worker
        self.calls = 0

    def attach(self, tower: Any) -> None:
        tower.register_forward_hook(self._hook)

    def _hook(self, *_: Any) -> None:
        self.calls += 1
        try:
            self._pool.count(self._worker, {"tower_forwards": 1})
        except redis.RedisError:
            logger.debug("could not count a vision tower forward on %s", self._worker, exc_info=True)


# --- the encode worker ------------------------------------------------------------------------------
@dataclass
class EncodeRuntime:
    """An encode worker's process state: the vision-only encoder, its embedding cache (listed in
    Redis for the frontend's affinity), the image loader and the side store."""

    name: str
    encoder: Any  # workers.vision_encoder.VisionEncoder
    model_name: str
    client: redis.Redis
    namespace: str
    pool: EncoderPool
    store: MediaStore  # the media side store: the task's image bytes come from it, features go to it
    embedding_cache_bytes: int
    image_loader: Any  # workers.runtime.EngineImageLoader
    session_scoped: bool = False
    instance: str = ""
    stats: Any = None  # routing.observe.cache_stats.CacheStats, for the image loader's counters
    # One task's forwards at a time: threads would only contend for the cores.
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.embedding_cache = EmbeddingCache(self.embedding_cache_bytes, on_evict=self.on_evicted)

    def serve_encode(self, payload: dict[str, Any]) -> None:
        raw_id = str(payload.get("request_id", "")) if isinstance(payload, dict) else ""
        try:
            task = EncodeTask.from_payload(payload, worker=self.name)
        except ContractError as exc:
            logger.warning("encode task for request %s refused: %s", raw_id, exc)
            if raw_id:
                self.pool.signal_done(raw_id, {"index": -1, "ok": False, "error": str(exc)})
            return
        # With scoping on, a request without a scope shares no cache with anyone (as on the LLM worker).
        use_cache = not (self.session_scoped and not task.scope_key)
        try:
            partition = cache_partition(self.session_scoped, task.scope_key, task.cache_salt)
        except ValueError:
            partition, use_cache = None, False  # a malformed salt shares nothing
        # Every image the cache lacks is loaded first (fetching overlaps another task's encoding),
        # then the task's images are encoded in one hold of the tower: tasks finish in the order
        # they took it, rather than all late with their images interleaved.
        self.pool.started(self.name, len(task.images))  # taken: loading, waiting for the tower, encoding
        loaded: dict[int, Any] = {}
        for image, index in zip(task.images, task.indices, strict=True):
            key = self._key(partition, image.identity)
            if not (use_cache and key in self.embedding_cache):
                try:
                    loaded[index] = self._load(image, partition if use_cache else None)
                except Exception as exc:  # reported with the image's result below
                    loaded[index] = exc
        with self._lock:
            self._encode_task(task, partition, use_cache, loaded)

    def _key(self, partition: str | None, identity: str) -> EmbeddingKey:
        return EmbeddingKey(partition, identity, self.model_name, self.encoder.processor_fingerprint)

    def _encode_task(
        self, task: EncodeTask, partition: str | None, use_cache: bool, loaded: dict[int, Any]
    ) -> None:
        for image, index in zip(task.images, task.indices, strict=True):
            member = f"{task.request_id}:{index}"
            try:
                ref, counts = self._encode_one(task, image, partition, use_cache, loaded.get(index))
                self.pool.count(self.name, counts)
                self.pool.signal_done(task.request_id, {"index": index, "ok": True, "ref": ref})
            except Exception as exc:
                logger.warning(
                    "encode worker %s could not encode image %d of request %s: %s",
                    self.name,
                    index,
                    task.request_id,
                    exc,
                    exc_info=not isinstance(exc, CorruptEmbedding | ValueError),
                )
                self.pool.signal_done(
                    task.request_id, {"index": index, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
                )
            finally:
                self.pool.finished(self.name, member)

    def _encode_one(
        self, task: EncodeTask, image: Any, partition: str | None, use_cache: bool, loaded: Any
    ) -> tuple[dict[str, Any], dict[str, int]]:
        identity = image.identity
        key = self._key(partition, identity)
        counts: dict[str, int] = {"images": 1}
        embedding = self.embedding_cache.get(key) if use_cache else None
        if embedding is not None:
            counts["cache_hits"] = 1
        else:
            counts["cache_misses"] = 1
            if isinstance(loaded, Exception):
                raise loaded
            if loaded is None:  # evicted since the look before loading
                loaded = self._load(image, partition if use_cache else None)
            started = time.perf_counter()
            embedding = self.encoder.encode(loaded).embedding
            counts["encode_us"] = int((time.perf_counter() - started) * 1e6)
            if use_cache and self.embedding_cache.put(key, embedding):
                self.pool.cached(self.name, cache_tag(partition, identity))
        blob = pack_embedding(
            embedding, EmbeddingLabel(identity, self.model_name, self.encoder.processor_fingerprint)
        )
        started = time.perf_counter()
        ref = self.store.put(features_owner(task.request_id), blob)
        counts["put_us"] = int((time.perf_counter() - started) * 1e6)
        counts["put_bytes"] = len(blob)
        return ref.to_payload(), counts

    def _load(self, image: Any, scope_key: str | None) -> Any:
        from workers.engine import ImageInput

        data = None
        if image.media_ref:  # bytes the frontend holds, in the side store
            data = self.store.get(MediaRef(image.media_ref, image.media_bytes))
        elif image.data_b64:
            data = base64.b64decode(image.data_b64)
        source = ImageInput(
            identity=image.identity, url=image.url, data=data, width=image.width, height=image.height
        )
        loaded = self.image_loader.load_for_engine(source, scope_key)
        # The loader may decode a large image reduced; its original size is what was declared.
        width, height = loaded.info.get(SOURCE_SIZE, loaded.size)
        if image.width and image.height and (width, height) != (image.width, image.height):
            # The LLM worker laid its prompt out for the declared size: other rows would not fit.
            declared = f"{image.width}x{image.height}"
            raise ValueError(f"image {image.identity} is {width}x{height}, declared {declared} when routed")
        return loaded

    def on_evicted(self, key: EmbeddingKey) -> None:
        try:
            self.pool.evicted(self.name, cache_tag(key.scope_key, key.identity))
        except redis.RedisError:
            logger.warning("encode worker %s could not unlist an evicted embedding", self.name)

    def serve(self, payload: dict[str, Any]) -> None:
        """A generate task that reached an encode worker (a misrouted send): refused on its stream."""
        request_id = str(payload.get("request_id", "")) if isinstance(payload, dict) else ""
        ResponseWriter(self.client, self.namespace, request_id).emit(
            ErrorEvent(status=503, code="wrong_worker_role", message=f"{self.name} is an encode worker")
        )

    def flush(self, payload: dict[str, Any]) -> None:
        """`flush_caches` on an encode worker: its embedding cache (unlisted for the router as it
        goes) and its image caches; it holds no KV cache."""
        from routing.contract.tasks import DONE, FlushCachesTask

        raw_id = str(payload.get("flush_id", "")) if isinstance(payload, dict) else ""
        writer = ResponseWriter(self.client, self.namespace, raw_id)
        try:
            task = FlushCachesTask.from_payload(payload, worker=self.name)
        except ContractError as exc:
            writer.emit(ErrorEvent(status=exc.status, code=exc.code, message=str(exc)))
            return
        scope_key, dry_run = task.scope_key, task.dry_run
        report: dict[str, Any] = {"worker": self.name, "dry_run": dry_run}
        try:
            if task.embeddings:
                cache = self.embedding_cache
                if dry_run:
                    report["embeddings"] = cache.count(scope_key)
                else:
                    report["embeddings"] = (
                        cache.clear() if scope_key is None else cache.discard_scope(scope_key)
                    )
                    # The router's list follows: rebuilt from what is left.
                    self.pool.forget_cached(self.name)
                    for key in cache.keys():  # noqa: SIM118 (a method, not a dict)
                        self.pool.cached(self.name, cache_tag(key.scope_key, key.identity))
            if task.images:
                loader = self.image_loader
                report["decoded_images"] = (
                    loader.local_count(scope_key) if dry_run else loader.clear_local(scope_key)
                )
            if task.shared_images:
                flushed = self.image_loader.flush_shared(scope_key, dry_run=dry_run)
                report["shared_images"] = "off" if flushed is None else flushed
        except Exception as exc:
            logger.exception("flush on encode worker %s failed", self.name)
            writer.emit(ErrorEvent(status=500, code="flush_failed", message=f"{type(exc).__name__}: {exc}"))
            return
        logger.info("caches flushed on encode worker %s: %s", self.name, report)
        writer.send(DONE, **report)


# --- the LLM worker ------------------------------------------------------------------------------
@dataclass
class Receipt:
    received: int = 0
    received_bytes: int = 0
    get_us: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        return {
            "received": self.received,
            "received_bytes": self.received_bytes,
            "get_us": self.get_us,
            **{f"fallback_{cause}": n for cause, n in self.fallbacks.items()},
        }

    def fall_back(self, cause: str, n: int = 1) -> None:
        self.fallbacks[cause] = self.fallbacks.get(cause, 0) + n


def receive_features(
    task: GenerateTask,
    images: Sequence[Any],
    *,
    label: Callable[[str], EmbeddingLabel],
    pool: EncoderPool,
    store: MediaStore,
    registry: WorkerRegistry,
    worker: str,
    clock: Callable[[], float] = time.monotonic,
) -> Receipt:
    """Sets `embedding` on each image of `task.encoded_images` whose features arrive intact."""
    receipt = Receipt()
    waiting = {i for i in task.encoded_images if 0 <= i < len(images)}
    refs: list[MediaRef] = []
    deadline = clock() + max(task.encode_wait_s, 0.0)
    encoder = task.encoder or ""
    try:
        while waiting:
            left = deadline - clock()
            if left <= 0:
                _log_fallback(task, waiting, f"no features within {task.encode_wait_s:g} s")
                receipt.fall_back("timeout", len(waiting))
                break
            signal = pool.wait_done(task.request_id, min(left, _SIGNAL_POLL_S))
            if signal is None:
                if not registry.alive([encoder]):
                    _log_fallback(task, waiting, f"encode worker {encoder} went away")
                    receipt.fall_back("encoder_gone", len(waiting))
                    break
                continue
            index = int(signal.get("index", -1))
            if index == -1:  # the encoder refused the whole task
                _log_fallback(task, waiting, f"encode worker refused the task: {signal.get('error')}")
                receipt.fall_back("missing", len(waiting))
                break
            if index not in waiting:
                continue
            waiting.discard(index)
            if not signal.get("ok"):
                _log_fallback(task, [index], f"the encode worker failed: {signal.get('error')}")
                receipt.fall_back("missing")
                continue
            started = time.perf_counter()
            try:
                ref = MediaRef.from_payload(signal.get("ref") or {})
                refs.append(ref)
                blob = store.get(ref)
            except (MediaStoreError, KeyError, TypeError, ValueError) as exc:
                _log_fallback(task, [index], f"its features are not in the side store: {exc}")
                receipt.fall_back("missing")
                continue
            try:
                embedding = unpack_embedding(blob, label(images[index].identity))
            except CorruptEmbedding as exc:
                _log_fallback(task, [index], f"its features are corrupt: {exc}")
                receipt.fall_back("corrupt")
                continue
            receipt.get_us += int((time.perf_counter() - started) * 1e6)
            receipt.received += 1
            receipt.received_bytes += len(blob)
            images[index].embedding = embedding
    except redis.RedisError as exc:
        _log_fallback(task, waiting, f"Redis failed: {exc}")
        receipt.fall_back("missing", len(waiting))
    finally:
        try:
            if refs:
                store.release(features_owner(task.request_id), refs)
            pool.forget_request(task.request_id)
        except redis.RedisError:
            pass  # both expire on their own
    try:
        pool.count(worker, receipt.counts())
    except redis.RedisError:
        logger.debug("could not count received features on %s", worker, exc_info=True)
    return receipt


@dataclass
class FeatureReceiver:
    """An LLM (or `both`) worker's side of E/PD, as `WorkerRuntime` holds it."""

    worker: str
    pool: EncoderPool
    store: MediaStore
    registry: WorkerRegistry
    model_name: str
    processor_fingerprint: str

    def receive(self, task: GenerateTask, images: Sequence[Any]) -> Receipt:
        return receive_features(
            task,
            images,
            label=lambda identity: EmbeddingLabel(identity, self.model_name, self.processor_fingerprint),
            pool=self.pool,
            store=self.store,
            registry=self.registry,
            worker=self.worker,
        )

    def refuse_encode(self, payload: dict[str, Any]) -> None:
        """An encode task that reached a generating worker: the LLM worker falls back at once."""
        request_id = str(payload.get("request_id", "")) if isinstance(payload, dict) else ""
        logger.warning(
            "%s is not an encode worker: encode task for request %s refused", self.worker, request_id
        )
        if request_id:
            self.pool.signal_done(
                request_id, {"index": -1, "ok": False, "error": f"{self.worker} does not encode"}
            )


def features_owner(request_id: str) -> str:
    """The side store owner of a request's features: apart from the frontend's image bytes, so
    releasing one never frees the other."""
    return f"{request_id}:features"


def _log_fallback(task: GenerateTask, indices: Any, why: str) -> None:
    logger.warning(
        "request %s: encoding image(s) %s locally (fallback): %s",
        task.request_id,
        ", ".join(str(i) for i in sorted(indices)),
        why,
    )
