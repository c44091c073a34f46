"""The shared encoded-image download cache: HTTP(S) image bytes in Redis, shared by workers.

Plain Redis, Redis Cluster and Dragonfly (emulated or real cluster mode) all work. Every
operation is tried once and fails open: an unreachable cache costs a request at most one
bounded GET and one bounded SET, and the image comes from the origin.

Which client: a `redis+cluster://` / `rediss+cluster://` URL or a `?cluster=1` query selects
`redis.cluster.RedisCluster`; `?cluster=0` selects `redis.Redis`; otherwise the first
operation asks the server (`INFO cluster`) and switches to the cluster client when
`cluster_enabled:1`. The cluster client only uses the URL to discover the slot map, and
rediscovers through that same URL when a node stops answering (`dynamic_startup_nodes=False`:
the URL is expected to be a service address that outlives any one node).

Keys (owned here): `<prefix>{<sha256 hex>}:bytes`, default prefix `dynamo:mm:image:` as in
Dynamo; the braces make the digest the cluster hash tag.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from routing.state.redis_keys import redact_text, redact_url

if TYPE_CHECKING:
    from routing.observe.cache_stats import CacheStats

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "dynamo:mm:image:"
WARNING_INTERVAL_SECS = 60.0
MIB = 1024 * 1024

_SCHEMES = {"redis": False, "rediss": False, "redis+cluster": True, "rediss+cluster": True}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class SharedImageCacheConfigError(ValueError):
    """A DYN_MM_* setting is missing or malformed; the worker refuses to start."""


def _bool(environ: Mapping[str, str], name: str, default: bool) -> bool:
    raw = environ.get(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise SharedImageCacheConfigError(f"{name}={raw!r} is not a boolean (use 1 or 0)")


def _positive(environ: Mapping[str, str], name: str, default: float, *, integer: bool = False) -> float:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise SharedImageCacheConfigError(f"{name}={raw!r} is not {kind}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise SharedImageCacheConfigError(f"{name}={raw!r} must be a positive finite number")
    return value


@dataclass(frozen=True)
class SharedImageCacheConfig:
    """The seed's settings, with its names and defaults. `repr` never shows the password."""

    enabled: bool = False
    url: str | None = field(default=None, repr=False)
    ttl_secs: int = 3600
    connect_timeout_secs: float = 0.1
    io_timeout_secs: float = 2.0
    max_file_size_bytes: int = 64 * MIB
    session_scoped: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SharedImageCacheConfig:
        enabled = _bool(environ, "DYN_MM_SHARED_IMAGE_CACHE_ENABLED", False)
        url = (environ.get("DYN_MM_SHARED_IMAGE_CACHE_URL") or "").strip() or None
        if enabled and url is None:
            raise SharedImageCacheConfigError(
                "DYN_MM_SHARED_IMAGE_CACHE_URL is required when DYN_MM_SHARED_IMAGE_CACHE_ENABLED=1"
            )
        if enabled and url is not None:
            _check_url(url)
        return cls(
            enabled=enabled,
            url=url,
            ttl_secs=int(_positive(environ, "DYN_MM_SHARED_IMAGE_CACHE_TTL_SECS", 3600, integer=True)),
            connect_timeout_secs=_positive(environ, "DYN_MM_SHARED_IMAGE_CACHE_CONNECT_TIMEOUT_SECS", 0.1),
            io_timeout_secs=_positive(environ, "DYN_MM_SHARED_IMAGE_CACHE_IO_TIMEOUT_SECS", 2.0),
            max_file_size_bytes=int(_positive(environ, "DYN_MM_MAX_FILE_SIZE_MB", 64) * MIB),
            session_scoped=_bool(environ, "DYN_MM_IMAGE_CACHE_SESSION_SCOPED", False),
        )

    @property
    def redacted_url(self) -> str:
        return _shown_url(self.url)

    def __repr__(self) -> str:
        return (
            f"SharedImageCacheConfig(enabled={self.enabled}, url={self.redacted_url!r}, "
            f"ttl_secs={self.ttl_secs}, connect_timeout_secs={self.connect_timeout_secs}, "
            f"io_timeout_secs={self.io_timeout_secs}, max_file_size_bytes={self.max_file_size_bytes}, "
            f"session_scoped={self.session_scoped})"
        )

    __str__ = __repr__


def _shown_url(url: str | None) -> str:
    """A URL safe to log: its password masked, even when the URL is malformed."""
    try:
        return redact_url(url)
    except ValueError:
        # redact_url parses the port, which fails on a malformed one; mask textually instead.
        return redact_text(url or "")


def _check_url(url: str) -> None:
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise SharedImageCacheConfigError(
            f"DYN_MM_SHARED_IMAGE_CACHE_URL {_shown_url(url)!r} is not a valid URL"
        ) from None
    if parts.scheme not in _SCHEMES:
        raise SharedImageCacheConfigError(
            f"DYN_MM_SHARED_IMAGE_CACHE_URL must start with redis://, rediss:// (or redis+cluster://, "
            f"rediss+cluster://), not {parts.scheme!r}"
        )
    if not host:
        raise SharedImageCacheConfigError(f"DYN_MM_SHARED_IMAGE_CACHE_URL {_shown_url(url)!r} names no host")


def shared_cache_key(identity: str, scope_key: str | None = None, *, prefix: str = DEFAULT_KEY_PREFIX) -> str:
    """The Redis key of an image: the sha256 of its identity (and scope hash) as hash tag.

    A scoped key also names its scope hash (a keyed hash, no secret) in the clear, so a flush
    of one session scope can find its entries with SCAN.
    """
    if scope_key is None:
        return f"{prefix}{{{hashlib.sha256(identity.encode()).hexdigest()}}}:bytes"
    digest = hashlib.sha256(f"{scope_key}\x00{identity}".encode()).hexdigest()
    return f"{prefix}scope:{scope_key}:{{{digest}}}:bytes"


def _client_url_and_mode(url: str) -> tuple[str, bool | None]:
    """The URL redis-py should see, and True/False/None for cluster/plain/ask the server."""
    parts = urlsplit(url)
    cluster: bool | None = True if _SCHEMES[parts.scheme] else None
    query = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name == "cluster":
            cluster = value.strip().lower() in _TRUE
        else:
            query.append((name, value))
    scheme = parts.scheme.removesuffix("+cluster")
    return urlunsplit((scheme, parts.netloc, parts.path, urlencode(query), parts.fragment)), cluster


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class SharedImageCache:
    """`get` / `put` of encoded image bytes; never raises on a cache failure."""

    def __init__(
        self,
        config: SharedImageCacheConfig,
        *,
        stats: CacheStats | None = None,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not config.url:
            raise SharedImageCacheConfigError("the shared image cache needs DYN_MM_SHARED_IMAGE_CACHE_URL")
        _check_url(config.url)
        self.config = config
        self.key_prefix = key_prefix
        self._stats = stats
        self._clock = clock
        self._lock = threading.Lock()
        self._last_warning: float | None = None
        self._failures_since_warning = 0
        self.counters: dict[str, int] = {"hits": 0, "misses": 0, "errors": 0, "bytes": 0, "refused": 0}

        password = urlsplit(config.url).password
        # Both spellings, in case a client error ever quotes the decoded form.
        self._secrets = [s for s in {password, unquote(password or "")} if s]
        self._client_url, self._cluster_mode = _client_url_and_mode(config.url)
        self._client: redis.Redis | RedisCluster | None = None
        if self._cluster_mode is not True:
            # redis.Redis does no I/O until the first command, so this cannot block start-up.
            self._client = self._plain_client()
        parts = urlsplit(config.url)
        if not parts.scheme.startswith("rediss") and not _is_loopback(parts.hostname):
            logger.warning(
                "shared image cache URL %s is not TLS: use rediss:// unless the network between "
                "workers and the cache is already encrypted",
                config.redacted_url,
            )

    def __repr__(self) -> str:
        return f"SharedImageCache(url={self.config.redacted_url!r}, prefix={self.key_prefix!r})"

    def flush(self, scope_key: str | None = None, *, dry_run: bool = False) -> int:
        """Delete every cached image (or one scope's); returns how many keys were (or would be) removed.

        Unlike the request path this raises on Redis errors: an operator asked for it.
        """
        pattern = f"{self.key_prefix}*" if scope_key is None else f"{self.key_prefix}scope:{scope_key}:*"
        client = self._connected()
        removed = 0
        for key in client.scan_iter(match=pattern, count=1000):
            removed += 1 if dry_run else int(client.delete(key))
        return removed

    def key(self, identity: str, scope_key: str | None = None) -> str:
        return shared_cache_key(identity, scope_key, prefix=self.key_prefix)

    def get(self, identity: str, scope_key: str | None = None) -> bytes | None:
        """The cached bytes, or None on a miss or on any cache failure."""
        try:
            data = self._connected().get(self.key(identity, scope_key))
        except Exception as exc:  # fail open: the cache must never break an image load
            self._failed("GET", exc)
            return None
        if data is None or len(data) > self.config.max_file_size_bytes:
            # An oversized entry (written under a larger limit) is not served: it counts as a miss.
            self._count("misses")
            return None
        self._count("hits")
        self._count("bytes", len(data))
        return bytes(data)

    def put(self, identity: str, data: bytes, scope_key: str | None = None) -> None:
        """Store bytes with the TTL, waiting for the SET; oversized data is never stored."""
        if len(data) > self.config.max_file_size_bytes:
            self.counters["refused"] += 1
            return
        try:
            self._connected().set(self.key(identity, scope_key), data, ex=self.config.ttl_secs)
        except Exception as exc:  # fail open
            self._failed("SET", exc)

    def delete(self, identity: str, scope_key: str | None = None) -> bool:
        """Remove one entry (for `flush_caches`); False when absent or the cache is down."""
        try:
            return bool(self._connected().delete(self.key(identity, scope_key)))
        except Exception as exc:
            self._failed("DEL", exc)
            return False

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    # -- connection -------------------------------------------------------------------------

    def _client_options(self) -> dict[str, Any]:
        return {
            "socket_connect_timeout": self.config.connect_timeout_secs,
            "socket_timeout": self.config.io_timeout_secs,
            # redis-py 8 retries 3 times with backoff by default; the seed wants one try.
            "retry": Retry(NoBackoff(), 0),
        }

    def _plain_client(self) -> redis.Redis:
        return redis.Redis.from_url(self._client_url, **self._client_options())

    def _cluster_client(self) -> RedisCluster:
        parts = urlsplit(self._client_url)
        # A cluster has only database 0: a /<db> path in the URL is ignored, not an error.
        url = urlunsplit((parts.scheme, parts.netloc, "", parts.query, parts.fragment))
        return RedisCluster.from_url(
            url,
            require_full_coverage=False,
            dynamic_startup_nodes=False,
            **self._client_options(),
        )

    def _connected(self) -> redis.Redis | RedisCluster:
        client = self._client
        if self._cluster_mode is False and client is not None:
            return client
        if self._cluster_mode is True:
            if client is None:
                # Building the cluster client reads the slot map; done outside the lock so
                # a dead cache delays each caller by one bounded attempt, not by a queue.
                fresh = self._cluster_client()
                with self._lock:
                    if self._client is None:
                        self._client = fresh
                        return fresh
                fresh.close()
                return self._client
            return client
        # Mode not known yet: ask the server once, then keep the answer.
        assert client is not None
        info = client.info("cluster")
        is_cluster = bool(int(info.get("cluster_enabled", 0)))
        with self._lock:
            if self._cluster_mode is None:
                self._cluster_mode = is_cluster
                if is_cluster:
                    self._client = None
        if is_cluster:
            client.close()
        return self._connected()

    # -- accounting -------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n
        if self._stats is not None:
            self._stats.incr("shared_image", name, n)

    def _redact(self, text: str) -> str:
        text = redact_text(text)
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _failed(self, operation: str, exc: Exception) -> None:
        self._count("errors")
        reason = self._redact(f"{type(exc).__name__}: {exc}")
        logger.debug("shared image cache %s failed: %s", operation, reason)
        now = self._clock()
        with self._lock:
            due = self._last_warning is None or now - self._last_warning >= WARNING_INTERVAL_SECS
            if due:
                self._last_warning = now
                suppressed, self._failures_since_warning = self._failures_since_warning, 0
            else:
                self._failures_since_warning += 1
        if due:
            logger.warning(
                "shared image cache at %s is failing (%s, %s); images load from the origin. "
                "%d more failures since the previous warning; next warning in a minute at most",
                self.config.redacted_url,
                operation,
                reason,
                suppressed,
            )
