"""The worker's image loader: local decoded-image LRU, in-flight dedup, shared cache, origin.

Thread-safe (the worker runs Celery with a thread pool). Every cache here is keyed by
`cache_key(identity, scope_key)`, which the engine's embedding cache mirrors.

Sources reported in `LoadedImage.source`: "local" (decoded-image cache), "inflight" (joined a
fetch another caller started), "shared" (Redis encoded-image cache), "origin" (fetched),
"data" (decoded from a data URL) and "frontend" (bytes the frontend already fetched).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote_to_bytes, urlsplit

from PIL import Image

from routing.observe import telemetry

if TYPE_CHECKING:
    from routing.observe.cache_stats import CacheStats
    from workers.shared_image_cache import SharedImageCache

logger = logging.getLogger(__name__)

OriginFetch = Callable[[str, Mapping[str, str]], bytes]
# (width, height) of an image -> (width, height) the model's processor resizes it to.
TargetSize = Callable[[int, int], tuple[int, int]]
# The size an image had before it was decoded reduced, in `Image.info` (what token counts use).
SOURCE_SIZE = "source_size"

# Pillow's own bomb threshold; a loader can be given a lower one.
DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


class ImageLoadError(Exception):
    """An image cannot be loaded; `status` is the HTTP status the API should answer with."""

    def __init__(self, status: int, message: str, code: str, *, image_index: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.image_index = image_index

    def for_image(self, index: int | None) -> ImageLoadError:
        """The same error naming the image (its 0-based place among the request's images), as
        the frontend's MediaError.for_image does: a refusal reads alike whichever side fetched."""
        if index is None or self.image_index is not None:
            return self
        return ImageLoadError(self.status, f"image {index}: {self.message}", self.code, image_index=index)


@dataclass(frozen=True)
class LoadedImage:
    """A decoded RGB image (shared between callers: treat as read-only) and where it came from."""

    image: Image.Image
    size_bytes: int
    source: str


def cache_key(identity: str, scope_key: str | None) -> str:
    """The key of an image in every worker cache: the identity, prefixed by the scope hash."""
    return identity if scope_key is None else f"{scope_key}:{identity}"


def _is_http(url: str) -> bool:
    return urlsplit(url).scheme.lower() in ("http", "https")


class _DecodedLru:
    """Least-recently-used decoded images, bounded by entry count."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[Image.Image, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[Image.Image, int] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, image: Image.Image, size_bytes: int) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._entries[key] = (image, size_bytes)
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def clear(self, scope_key: str | None = None) -> int:
        with self._lock:
            if scope_key is None:
                removed = len(self._entries)
                self._entries.clear()
                return removed
            doomed = [key for key in self._entries if key.startswith(f"{scope_key}:")]
            for key in doomed:
                del self._entries[key]
            return len(doomed)

    def count(self, scope_key: str | None = None) -> int:
        with self._lock:
            if scope_key is None:
                return len(self._entries)
            return sum(1 for key in self._entries if key.startswith(f"{scope_key}:"))

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)


class ImageLoader:
    """Loads images for one worker; see the module docstring for the order of the caches."""

    def __init__(
        self,
        *,
        fetch: OriginFetch,
        shared_cache: SharedImageCache | None,
        local_capacity: int = 8,
        session_scoped: bool = False,
        max_bytes: int,
        stats: CacheStats | None,
        worker: str,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        fetch_threads: int = 8,
        target_size: TargetSize | None = None,
    ) -> None:
        self._fetch = fetch
        self._shared = shared_cache
        self._local = _DecodedLru(local_capacity)
        self.session_scoped = session_scoped
        self.max_bytes = max_bytes
        self.max_pixels = max_pixels
        # With it, an image larger than the processor keeps is decoded reduced and resized to
        # exactly what the processor would resize it to, so no worker holds a full-size copy.
        self.target_size = target_size
        self._stats = stats
        self.worker = worker
        self._inflight: dict[str, Future[tuple[Image.Image, int, str]]] = {}
        self._inflight_lock = threading.Lock()
        # Fetches run here, not in the caller's thread, so a caller that stops waiting leaves
        # the fetch running for everyone else who joined it.
        self._fetchers = ThreadPoolExecutor(max_workers=fetch_threads, thread_name_prefix=f"img-{worker}")

    def close(self) -> None:
        self._fetchers.shutdown(wait=True)

    def clear_local(self, scope_key: str | None = None) -> int:
        """Drop decoded images (all, or one scope's); returns how many went."""
        return self._local.clear(scope_key)

    def flush_shared(self, scope_key: str | None = None, *, dry_run: bool = False) -> int | None:
        """Empty the shared image cache (or one scope's entries); None when this loader has none."""
        if self._shared is None:
            return None
        return self._shared.flush(scope_key, dry_run=dry_run)

    def local_count(self, scope_key: str | None = None) -> int:
        """Decoded images held locally (all, or one scope's)."""
        return self._local.count(scope_key)

    @property
    def local_size(self) -> int:
        return len(self._local)

    def load(
        self,
        url: str,
        identity: str,
        *,
        scope_key: str | None = None,
        origin_headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> LoadedImage:
        headers = dict(origin_headers or {})
        if url.startswith("data:"):
            return self._load_data_url(url, identity, scope_key)
        if not _is_http(url):
            raise ImageLoadError(400, "image URL must be http(s) or a data URL", "invalid_image_url")
        if self._bypasses(scope_key, shared=True):
            # Unshared, but still off the caller's thread so its timeout holds here too.
            image, size_bytes, _ = self._wait(
                self._fetchers.submit(self._fetch_unshared, url, headers), timeout
            )
            return LoadedImage(image, size_bytes, "origin")
        scope = scope_key
        key = cache_key(identity, scope)
        cached = self._local_lookup(key)
        if cached is not None:
            return cached

        with self._inflight_lock:
            future = self._inflight.get(key)
            joined = future is not None
            if future is None:
                # A fill may have finished since the lookup above (it leaves the in-flight map
                # only after filling the local cache): look again rather than fetch twice.
                entry = self._local.get(key)
                if entry is not None:
                    return LoadedImage(entry[0], entry[1], "local")
                future = self._fetchers.submit(self._fill, key, url, identity, scope, headers)
                self._inflight[key] = future
        image, size_bytes, source = self._wait(future, timeout)
        return LoadedImage(image, size_bytes, "inflight" if joined else source)

    def load_bytes(
        self,
        identity: str,
        data: bytes,
        *,
        scope_key: str | None = None,
        source: str = "frontend",
    ) -> LoadedImage:
        """An image the frontend already fetched: decoded here, never fetched, never shared."""
        self._check_size(data)
        if self._bypasses(scope_key):
            return LoadedImage(self._decode(data), len(data), source)
        key = cache_key(identity, scope_key)
        cached = self._local_lookup(key)
        if cached is not None:
            return cached
        image = self._decode(data)
        self._local.put(key, image, len(data))
        return LoadedImage(image, len(data), source)

    # -- steps ------------------------------------------------------------------------------

    def _bypasses(self, scope_key: str | None, *, shared: bool = False) -> bool:
        """With scoping on, a request without a scope shares nothing with anyone."""
        if not self.session_scoped or scope_key:
            return False
        self._count("local_image", "bypasses")
        if shared and self._shared is not None:
            self._count("shared_image", "bypasses")
        return True

    def _local_lookup(self, key: str) -> LoadedImage | None:
        entry = self._local.get(key)
        if entry is None:
            self._count("local_image", "misses")
            return None
        self._count("local_image", "hits")
        self._count("local_image", "bytes", entry[1])
        return LoadedImage(entry[0], entry[1], "local")

    def _fill(
        self, key: str, url: str, identity: str, scope: str | None, headers: Mapping[str, str]
    ) -> tuple[Image.Image, int, str]:
        try:
            source = "shared"
            started = time.perf_counter()
            data = self._shared.get(identity, scope) if self._shared is not None else None
            if data is not None:
                self._observe_fetch("shared", started)
            else:
                source = "origin"
                data = self._fetch_origin(url, headers)
            image = self._decode(data)
            if source == "origin" and self._shared is not None:
                # Only bytes that decoded are shared, so a broken origin response is not
                # replayed to every worker for an hour.
                self._shared.put(identity, data, scope)
            self._local.put(key, image, len(data))
            return image, len(data), source
        finally:
            with self._inflight_lock:
                self._inflight.pop(key, None)

    @staticmethod
    def _wait(
        future: Future[tuple[Image.Image, int, str]], timeout: float | None
    ) -> tuple[Image.Image, int, str]:
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            # Only this caller gives up: the fetch goes on for whoever else joined it.
            raise ImageLoadError(
                504, f"image load timed out after {timeout:g}s", "image_load_timeout"
            ) from None

    def _fetch_unshared(self, url: str, headers: Mapping[str, str]) -> tuple[Image.Image, int, str]:
        data = self._fetch_origin(url, headers)
        return self._decode(data), len(data), "origin"

    def _fetch_origin(self, url: str, headers: Mapping[str, str]) -> bytes:
        started = time.perf_counter()
        data = self._fetch(url, headers)
        self._observe_fetch("origin", started)
        self._check_size(data)
        return data

    def _observe_fetch(self, source: str, started: float) -> None:
        telemetry.observe(
            "image_fetch_seconds",
            time.perf_counter() - started,
            labels={"worker": self.worker, "source": source},
        )

    def _load_data_url(self, url: str, identity: str, scope_key: str | None) -> LoadedImage:
        if self._bypasses(scope_key):
            data = self._data_url_bytes(url)
            return LoadedImage(self._decode(data), len(data), "data")
        key = cache_key(identity, scope_key)
        cached = self._local_lookup(key)
        if cached is not None:
            return cached
        data = self._data_url_bytes(url)
        image = self._decode(data)
        self._local.put(key, image, len(data))
        return LoadedImage(image, len(data), "data")

    def _data_url_bytes(self, url: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep:
            raise ImageLoadError(400, "data URL has no ',' before its payload", "invalid_image_url")
        # base64 inflates by 4/3: refuse before decoding a payload that cannot fit.
        if len(payload) > self.max_bytes * 4 // 3 + 4:
            self._refuse_size()
        try:
            if header.endswith(";base64"):
                data = base64.b64decode(payload, validate=True)
            else:
                data = unquote_to_bytes(payload)
        except (binascii.Error, ValueError):
            raise ImageLoadError(400, "data URL payload is not valid base64", "invalid_image_url") from None
        self._check_size(data)
        return data

    def _check_size(self, data: bytes) -> None:
        if len(data) > self.max_bytes:
            self._refuse_size()

    def _refuse_size(self) -> None:
        limit_mib = self.max_bytes / (1024 * 1024)
        raise ImageLoadError(413, f"image is larger than {limit_mib:g} MiB", "image_too_large")

    def _decode(self, data: bytes) -> Image.Image:
        started = time.perf_counter()
        try:
            return self._decode_checked(data)
        finally:
            telemetry.observe(
                "image_decode_seconds", time.perf_counter() - started, labels={"worker": self.worker}
            )

    def _decode_checked(self, data: bytes) -> Image.Image:
        try:
            opened = Image.open(io.BytesIO(data))
            width, height = opened.size
            # Checked from the header, before any pixel is decompressed.
            if width * height > self.max_pixels:
                raise ImageLoadError(
                    400,
                    f"image has {width}x{height} pixels, more than the {self.max_pixels} allowed",
                    "image_too_many_pixels",
                )
            target = self._target(width, height)
            if target is None:
                return opened.convert("RGB")
            # JPEG decodes at 1/2, 1/4 or 1/8 scale straight from the DCT (never below the
            # target); other formats decode whole, then shrink, and only the small copy is kept.
            opened.draft("RGB", target)
            decoded = opened if opened.mode == "RGB" else opened.convert("RGB")
            # The resize the processor would make, from the original's size, so the image the
            # engine gets has the grid the token count (of the original size) promised.
            reduced = decoded.resize(target, Image.Resampling.BICUBIC)
            reduced.info[SOURCE_SIZE] = (width, height)
            return reduced
        except ImageLoadError:
            raise
        except Image.DecompressionBombError:
            raise ImageLoadError(400, "image exceeds the pixel limit", "image_too_many_pixels") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise ImageLoadError(
                400, f"image cannot be decoded: {type(exc).__name__}", "invalid_image"
            ) from None

    def _target(self, width: int, height: int) -> tuple[int, int] | None:
        """The processor's size for this image when it is smaller than the image, else None."""
        if self.target_size is None:
            return None
        try:
            target = self.target_size(width, height)
        except ValueError:  # a size the layout refuses: the engine says why, with the full image
            return None
        if target[0] * target[1] >= width * height:
            return None
        return target

    def _count(self, cache: str, field: str, n: int = 1) -> None:
        if self._stats is not None:
            self._stats.incr(cache, field, n)
