"""The frontend process's collaborators, built in one place: the KV router, the worker registry,
the media side store, the tenant limiter and usage, the encoder pool, the kept image sizes, the
served models and the live policy reader.

Each is built once per configuration it reads (the settings it is made from are its key), so a
deployment builds each once, while a test that changes a setting (a Redis key prefix, a cap) gets
one made from it. `reset()` forgets them all, and what they keep between requests (image sizes,
the live policy, the worker rows), for tests that must not see another test's state.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from django.conf import settings

from inference_platform.serving.model_pool import ModelPool
from routing.admission.queue import AdmissionQueue
from routing.deployment import known_statistics_namespace, statistics_namespace
from routing.fleet.encoders import EncoderPool
from routing.fleet.registry import WorkerRegistry
from routing.fleet.worker_rows import kept_rows
from routing.kv.affinity import SessionAffinity
from routing.kv.index import KvIndex
from routing.kv.load import LoadTracker
from routing.kv.replica import IndexReplica
from routing.kv.router import KvRouter
from routing.media.images import SIZES_FLUSHED_KEY, DecodedDataUrls, ImageSizes
from routing.media.store import MediaStore, media_store_from_settings
from routing.policy import LivePolicy, acurrent_policy, current_policy, forget_cached_policy
from routing.state.redis_direct import AsyncDirectCommands
from routing.state.redis_keys import async_client, sync_client
from tenants.limits import TenantLimiter
from tenants.usage import TenantUsage

T = TypeVar("T")

# A look that only saves work: a frozen Redis costs a request this much more, once a second.
_SIZES_FLUSH_TIMEOUT_S = 0.25


class Frontend:
    """This process's collaborators, each built on first use from the settings it reads."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, Hashable], Any] = {}
        self._lock = threading.Lock()
        # This process among the frontends, as the admission queue knows it (host, pid, and a
        # nonce: a pid reused after a restart is another frontend).
        self.frontend_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        # Each event loop's direct connections to Redis (redis_lines), by the URL they go to.
        self._lines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, AsyncDirectCommands]] = (
            weakref.WeakKeyDictionary()
        )

    def _get(self, name: str, key: Hashable, build: Callable[[], T]) -> T:
        with self._lock:
            found = self._built.get((name, key))
            if found is None:
                found = self._built[(name, key)] = build()
            return found

    def reset(self) -> None:
        """Forget every collaborator and what they keep between requests (tests)."""
        with self._lock:
            routers = [built for (name, _key), built in self._built.items() if name == "router"]
            self._built.clear()
            self._lines.clear()
        for router in routers:  # their replicas' threads stop
            if router.replica is not None:
                router.replica.close()
        forget_cached_policy()
        kept_rows().clear()  # and with them the fleet read made under them (serving.dispatch)

    def redis_lines(self, url: str | None = None) -> AsyncDirectCommands:
        """The running event loop's own connections to Redis (`url`, default the platform's
        REDIS_URL), for what a request awaits on it in one round trip (the router's decision,
        the lease's moves, the liveness mark, the queue's look, the task's send): no thread to
        hand it to and back, ~135 us of CPU less a call than a sync client's command in a thread
        here. Connections belong to the loop they were made on."""
        loop = asyncio.get_running_loop()
        url = url or settings.REDIS_URL
        with self._lock:
            by_url = self._lines.get(loop)
            if by_url is None:
                by_url = self._lines[loop] = {}
            found = by_url.get(url)
            if found is None:
                found = by_url[url] = AsyncDirectCommands(async_client(url).connection_pool)
            return found

    def router(self) -> KvRouter:
        """The KV router over the shared index, load and affinity in Redis."""
        key = (
            settings.REDIS_URL,
            settings.REDIS_KEY_PREFIX,
            settings.ROUTER_LOAD_ENTRY_TTL_SECS,
            settings.ROUTER_AFFINITY_TTL_SECS,
            settings.ROUTER_APPROXIMATE_TTL_SECS,
            settings.ROUTER_PREDICTED_TTL_SECS,
            settings.ROUTER_INDEX_REPLICA,
        )

        def build() -> KvRouter:
            client, namespace = sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX
            index = KvIndex(client, namespace)
            return KvRouter(
                client,
                namespace,
                index=index,
                load=LoadTracker(client, namespace, entry_ttl_s=settings.ROUTER_LOAD_ENTRY_TTL_SECS),
                affinity=SessionAffinity(client, namespace, ttl_s=settings.ROUTER_AFFINITY_TTL_SECS),
                approximate_ttl_s=settings.ROUTER_APPROXIMATE_TTL_SECS,
                predicted_ttl_s=settings.ROUTER_PREDICTED_TTL_SECS,
                # Started by the first decision over a large fleet (KvRouter.candidates_above).
                replica=IndexReplica(client, namespace, index=index)
                if settings.ROUTER_INDEX_REPLICA
                else None,
            )

        return self._get("router", key, build)

    def admission_queue(self) -> AdmissionQueue:
        """The admission queue every frontend shares (routing.admission), as this process's."""
        key = (settings.REDIS_URL, settings.REDIS_KEY_PREFIX, settings.ROUTER_QUEUE_FRONTEND_TTL_SECS)
        return self._get(
            "admission_queue",
            key,
            lambda: AdmissionQueue(
                sync_client(settings.REDIS_URL),
                settings.REDIS_KEY_PREFIX,
                self.frontend_id,
                frontend_ttl_s=settings.ROUTER_QUEUE_FRONTEND_TTL_SECS,
            ),
        )

    def registry(self) -> WorkerRegistry:
        key = (settings.REDIS_URL, settings.REDIS_KEY_PREFIX)
        return self._get(
            "registry",
            key,
            lambda: WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX),
        )

    def media_store(self) -> MediaStore:
        key = (
            settings.REDIS_URL,
            settings.REDIS_KEY_PREFIX,
            settings.MEDIA_STORE_MAX_REQUEST_BYTES,
            settings.MEDIA_STORE_MAX_TOTAL_BYTES,
            settings.MEDIA_STORE_TTL_SECS,
        )
        return self._get(
            "media_store",
            key,
            lambda: media_store_from_settings(
                sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX, settings
            ),
        )

    def limiter(self) -> TenantLimiter:
        slot_ttl_s = settings.REQUEST_FIRST_TOKEN_TIMEOUT_SECS + settings.TENANT_SLOT_TTL_SECS
        key = (settings.REDIS_URL, settings.REDIS_KEY_PREFIX, slot_ttl_s)
        return self._get(
            "limiter",
            key,
            lambda: TenantLimiter(
                sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX, slot_ttl_s=slot_ttl_s
            ),
        )

    def usage(self) -> TenantUsage:
        """The tenants' usage, kept under this deployment's statistics namespace. Synchronous
        (the deployment id may need a database read the first time): call it in a thread."""
        return self._usage_under(statistics_namespace())

    async def ausage(self) -> TenantUsage:
        """`usage()` from an event loop: at once once the deployment id is known, else in a
        thread (the first read of it is the database's)."""
        namespace = known_statistics_namespace()
        if namespace is None:
            return await asyncio.to_thread(self.usage)
        return self._usage_under(namespace)

    def _usage_under(self, namespace: str) -> TenantUsage:
        key = (settings.REDIS_URL, namespace)
        return self._get("usage", key, lambda: TenantUsage(sync_client(settings.REDIS_URL), namespace))

    def encoder_pool(self) -> EncoderPool:
        """The encode workers' pool; its counters under this deployment's statistics namespace.
        Synchronous (the deployment id may need a database read the first time): call it in a
        thread."""
        namespace = statistics_namespace()
        key = (settings.REDIS_URL, settings.REDIS_KEY_PREFIX, settings.EPD_ENCODE_WAIT_SECS, namespace)
        return self._get(
            "encoder_pool",
            key,
            lambda: EncoderPool(
                sync_client(settings.REDIS_URL),
                settings.REDIS_KEY_PREFIX,
                pending_ttl_s=settings.EPD_ENCODE_WAIT_SECS,
                statistics_namespace=namespace,
            ),
        )

    def image_sizes(self) -> ImageSizes | None:
        """The image sizes kept by URL (MEDIA_SIZE_CACHE_SECS); None when that is 0."""
        if settings.MEDIA_SIZE_CACHE_SECS <= 0:
            return None
        key = (settings.MEDIA_SIZE_CACHE_SECS, settings.MEDIA_SIZE_CACHE_ENTRIES)
        return self._get(
            "image_sizes",
            key,
            lambda: ImageSizes(
                settings.MEDIA_SIZE_CACHE_SECS,
                settings.MEDIA_SIZE_CACHE_ENTRIES,
                flush_token=_sizes_flush_token,
            ),
        )

    def decoded_data_urls(self) -> DecodedDataUrls | None:
        """The pictures decoded from data URLs lately (MEDIA_DATA_URL_CACHE_MB); None when 0."""
        max_bytes = int(settings.MEDIA_DATA_URL_CACHE_MB * 1024 * 1024)
        if max_bytes < 1:
            return None
        return self._get("decoded_data_urls", max_bytes, lambda: DecodedDataUrls(max_bytes))

    def models(self) -> ModelPool:
        """The models requests may name, and the routing views loaded of them."""
        key = (settings.REDIS_URL, settings.REDIS_KEY_PREFIX, settings.MODEL_PATH, settings.MODEL_NAME)
        return self._get("models", key, ModelPool)

    def policy(self) -> LivePolicy:
        """The live routing policy (the admin's row, else the environment), reread each second."""
        return current_policy()

    async def apolicy(self) -> LivePolicy:
        """`policy` from async code: read in a thread when it is due again."""
        return await acurrent_policy()


def _sizes_flush_token() -> bytes | None:
    """The token `flush_caches` sets when it flushes images (None: never, or Redis failed)."""
    import redis

    try:
        client = sync_client(settings.REDIS_URL, timeout_s=_SIZES_FLUSH_TIMEOUT_S)
        return client.get(f"{settings.REDIS_KEY_PREFIX}{SIZES_FLUSHED_KEY}")
    except redis.RedisError:
        return None


_frontend = Frontend()


def frontend() -> Frontend:
    """This process's collaborators (one per process)."""
    return _frontend
