"""The shared encoded-image cache: settings, keys, TTL, one bounded try per operation, fail-open,
rate-limited warnings, no password in any log line, plain Redis and a real Redis Cluster."""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from routing.observe.cache_stats import FIELDS, CacheStats, read_all
from tests.redis_cluster import RedisClusterNodes, redis_cluster  # noqa: F401 - fixture
from workers.shared_image_cache import (
    SharedImageCache,
    SharedImageCacheConfig,
    SharedImageCacheConfigError,
    shared_cache_key,
)

LOGGER = "workers.shared_image_cache"
PASSWORD = "s3cr3t-Pa55word"


# -- dead caches: each one a different way for Redis to be unreachable ----------------------


class SilentServer:
    """Accepts connections and never answers: every read hits the IO timeout."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.05)
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2)
        for conn in self._held:
            conn.close()
        self._listener.close()


class BlackholedServer:
    """A listener whose backlog is full and never drained: new connects time out."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self.port = self._listener.getsockname()[1]
        self._filler = socket.create_connection(("127.0.0.1", self.port), timeout=1)

    def close(self) -> None:
        self._filler.close()
        self._listener.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    server = SilentServer()
    yield server
    server.close()


@pytest.fixture
def blackholed_server() -> Iterator[BlackholedServer]:
    server = BlackholedServer()
    yield server
    server.close()


def config_for(url: str, **overrides: object) -> SharedImageCacheConfig:
    settings: dict[str, object] = {"enabled": True, "url": url, **overrides}
    return SharedImageCacheConfig(**settings)  # type: ignore[arg-type]


@pytest.fixture
def cache(redis_url: str, key_namespace: str, redis_client: redis.Redis) -> Iterator[SharedImageCache]:
    shared = SharedImageCache(config_for(redis_url), key_prefix=f"{key_namespace}dynamo:mm:image:")
    yield shared
    shared.close()


# -- settings -------------------------------------------------------------------------------


def test_settings_default_to_the_seed_values() -> None:
    config = SharedImageCacheConfig.from_env({})
    assert config.enabled is False
    assert config.url is None
    assert config.ttl_secs == 3600
    assert config.connect_timeout_secs == 0.1
    assert config.io_timeout_secs == 2.0
    assert config.max_file_size_bytes == 64 * 1024 * 1024
    assert config.session_scoped is False


def test_settings_are_read_under_the_seed_names() -> None:
    config = SharedImageCacheConfig.from_env(
        {
            "DYN_MM_SHARED_IMAGE_CACHE_ENABLED": "1",
            "DYN_MM_SHARED_IMAGE_CACHE_URL": "rediss://cache.internal:6380/0",
            "DYN_MM_SHARED_IMAGE_CACHE_TTL_SECS": "60",
            "DYN_MM_SHARED_IMAGE_CACHE_CONNECT_TIMEOUT_SECS": "0.25",
            "DYN_MM_SHARED_IMAGE_CACHE_IO_TIMEOUT_SECS": "1.5",
            "DYN_MM_MAX_FILE_SIZE_MB": "8",
            "DYN_MM_IMAGE_CACHE_SESSION_SCOPED": "1",
        }
    )
    assert (config.enabled, config.url, config.ttl_secs) == (True, "rediss://cache.internal:6380/0", 60)
    assert (config.connect_timeout_secs, config.io_timeout_secs) == (0.25, 1.5)
    assert config.max_file_size_bytes == 8 * 1024 * 1024
    assert config.session_scoped is True


def test_enabling_the_cache_without_a_url_fails_at_start_up_naming_the_setting() -> None:
    with pytest.raises(SharedImageCacheConfigError, match="DYN_MM_SHARED_IMAGE_CACHE_URL is required"):
        SharedImageCacheConfig.from_env({"DYN_MM_SHARED_IMAGE_CACHE_ENABLED": "1"})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("DYN_MM_SHARED_IMAGE_CACHE_ENABLED", "maybe"),
        ("DYN_MM_SHARED_IMAGE_CACHE_TTL_SECS", "0"),
        ("DYN_MM_SHARED_IMAGE_CACHE_TTL_SECS", "1.5"),
        ("DYN_MM_SHARED_IMAGE_CACHE_CONNECT_TIMEOUT_SECS", "-0.1"),
        ("DYN_MM_SHARED_IMAGE_CACHE_IO_TIMEOUT_SECS", "soon"),
        ("DYN_MM_SHARED_IMAGE_CACHE_IO_TIMEOUT_SECS", "nan"),
        ("DYN_MM_MAX_FILE_SIZE_MB", "0"),
        ("DYN_MM_IMAGE_CACHE_SESSION_SCOPED", "2"),
    ],
)
def test_an_invalid_setting_fails_at_start_up_naming_it(name: str, value: str) -> None:
    with pytest.raises(SharedImageCacheConfigError, match=name):
        SharedImageCacheConfig.from_env({name: value})


def test_a_url_that_is_not_redis_is_refused_without_showing_its_password() -> None:
    with pytest.raises(SharedImageCacheConfigError) as refused:
        SharedImageCacheConfig.from_env(
            {
                "DYN_MM_SHARED_IMAGE_CACHE_ENABLED": "1",
                "DYN_MM_SHARED_IMAGE_CACHE_URL": f"http://user:{PASSWORD}@cache:bad/0",
            }
        )
    assert PASSWORD not in str(refused.value)


def test_the_config_never_shows_the_password() -> None:
    config = config_for(f"redis://default:{PASSWORD}@127.0.0.1:6379/0")
    assert PASSWORD not in repr(config)
    assert PASSWORD not in str(config)
    assert PASSWORD not in config.redacted_url
    cache = SharedImageCache(config)
    assert PASSWORD not in repr(cache)


# -- keys and storage -----------------------------------------------------------------------


def test_keys_follow_dynamo_with_the_digest_as_cluster_hash_tag() -> None:
    identity = "9f86d081884c7d659a2feaa0c55ad015"
    digest = hashlib.sha256(identity.encode()).hexdigest()
    assert shared_cache_key(identity) == f"dynamo:mm:image:{{{digest}}}:bytes"
    scoped = shared_cache_key(identity, "a" * 32)
    assert scoped != shared_cache_key(identity)
    assert scoped != shared_cache_key(identity, "b" * 32)
    assert identity not in scoped


def test_stored_bytes_come_back_and_expire_after_the_ttl(
    cache: SharedImageCache, redis_client: redis.Redis
) -> None:
    assert cache.get("img-1") is None
    cache.put("img-1", b"\x89PNG fake bytes")
    assert cache.get("img-1") == b"\x89PNG fake bytes"
    assert 3590 < redis_client.ttl(cache.key("img-1")) <= 3600
    assert cache.counters["hits"] == 1
    assert cache.counters["misses"] == 1


def test_scoped_entries_are_invisible_to_other_scopes(cache: SharedImageCache) -> None:
    cache.put("img-1", b"alice's", scope_key="a" * 32)
    assert cache.get("img-1", scope_key="a" * 32) == b"alice's"
    assert cache.get("img-1", scope_key="b" * 32) is None
    assert cache.get("img-1") is None


def test_bytes_over_the_size_limit_are_never_stored(
    redis_url: str, key_namespace: str, redis_client: redis.Redis
) -> None:
    small = SharedImageCache(
        config_for(redis_url, max_file_size_bytes=100), key_prefix=f"{key_namespace}dynamo:mm:image:"
    )
    small.put("big", b"x" * 101)
    small.put("fits", b"x" * 100)
    assert redis_client.exists(small.key("big")) == 0
    assert small.get("fits") == b"x" * 100
    small.close()


def test_hits_misses_and_errors_reach_the_cache_stats(
    redis_url: str, key_namespace: str, redis_client: redis.Redis
) -> None:
    stats = CacheStats(redis_client, key_namespace, "gpu0")
    shared = SharedImageCache(
        config_for(redis_url), stats=stats, key_prefix=f"{key_namespace}dynamo:mm:image:"
    )
    dead = SharedImageCache(config_for(f"redis://127.0.0.1:{closed_port()}/0"), stats=stats)
    shared.get("img")
    shared.put("img", b"12345")
    shared.get("img")
    dead.get("img")
    stats.flush()
    counts = read_all(redis_client, key_namespace)["gpu0"]["shared_image"]
    assert counts == {**dict.fromkeys(FIELDS, 0), "hits": 1, "misses": 1, "errors": 1, "bytes": 5}
    stats.close()


# -- failing open, within the timeouts ------------------------------------------------------


def timed(operation: object) -> float:
    started = time.perf_counter()
    operation()  # type: ignore[operator]
    return time.perf_counter() - started


def test_a_refused_connection_fails_open_at_once(caplog: pytest.LogCaptureFixture) -> None:
    dead = SharedImageCache(config_for(f"redis://127.0.0.1:{closed_port()}/0"))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert timed(lambda: dead.get("img")) < 0.1
        assert timed(lambda: dead.put("img", b"data")) < 0.1
    assert dead.get("img") is None
    assert dead.counters["errors"] == 3


def test_a_connect_that_never_completes_fails_within_the_connect_timeout(
    blackholed_server: BlackholedServer,
) -> None:
    # The seed's default connect timeout, 0.1 s.
    dead = SharedImageCache(config_for(f"redis://127.0.0.1:{blackholed_server.port}/0"))
    for operation in (lambda: dead.get("img"), lambda: dead.put("img", b"data")):
        elapsed = timed(operation)
        assert 0.09 <= elapsed < 0.6, elapsed
    assert dead.counters["errors"] == 2


def test_a_server_that_stops_answering_fails_within_the_io_timeout_tried_once(
    silent_server: SilentServer,
) -> None:
    # given a small IO timeout, so the test is fast but the bound is visible
    dead = SharedImageCache(config_for(f"redis://127.0.0.1:{silent_server.port}/0", io_timeout_secs=0.3))
    # when / then: each operation waits for one timeout, not for redis-py's default retries
    for operation in (lambda: dead.get("img"), lambda: dead.put("img", b"data")):
        elapsed = timed(operation)
        assert 0.28 <= elapsed < 0.6, elapsed
    assert silent_server.accepted == 2
    assert dead.counters["errors"] == 2


def test_many_failures_log_one_warning_and_one_debug_line_each(caplog: pytest.LogCaptureFixture) -> None:
    dead = SharedImageCache(config_for(f"redis://127.0.0.1:{closed_port()}/0"))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for index in range(25):
            dead.get(f"img-{index}")
            dead.put(f"img-{index}", b"data")
    ours = [record for record in caplog.records if record.name == LOGGER]
    assert [record.levelno for record in ours].count(logging.WARNING) == 1
    assert [record.levelno for record in ours].count(logging.DEBUG) == 50
    assert ours[0].levelno == logging.DEBUG and ours[1].levelno == logging.WARNING


def test_the_warning_comes_again_after_a_minute_with_a_fake_clock(caplog: pytest.LogCaptureFixture) -> None:
    now = [1000.0]
    dead = SharedImageCache(config_for(f"redis://127.0.0.1:{closed_port()}/0"), clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        dead.get("a")
        now[0] += 59
        dead.get("b")
        now[0] += 2
        dead.get("c")
        dead.get("d")
    warnings = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(warnings) == 2
    assert "1 more failures since the previous warning" in warnings[1]


# -- secrets --------------------------------------------------------------------------------


def with_password(url: str) -> str:
    parts = urlsplit(url)
    # A user the test Redis does not know: its default user has no password and accepts any.
    return urlunsplit((parts.scheme, f"image-cache:{PASSWORD}@{parts.netloc}", parts.path, "", ""))


def test_no_password_in_any_log_line_for_a_dead_port_or_a_wrong_password(
    redis_url: str,
    key_namespace: str,
    redis_client: redis.Redis,  # removes whatever a mistakenly accepted password let through
    silent_server: SilentServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    urls = [
        with_password(f"redis://127.0.0.1:{closed_port()}/0"),
        with_password(f"redis://127.0.0.1:{silent_server.port}/0"),
        with_password(redis_url),  # the real Redis refuses this password
        f"redis://:{PASSWORD}@10.0.0.7:6379/0",  # not loopback: the TLS warning names the URL
    ]
    raised: list[str] = []
    with caplog.at_level(logging.DEBUG):  # every logger, redis-py's own included
        for url in urls:
            cache = SharedImageCache(
                config_for(url, io_timeout_secs=0.2, connect_timeout_secs=0.05), key_prefix=key_namespace
            )
            if "10.0.0.7" not in url:
                assert cache.get("img") is None
                cache.put("img", b"data")
            raised.append(repr(cache))
            try:
                redis.Redis.from_url(
                    url, socket_connect_timeout=0.05, socket_timeout=0.2, retry=Retry(NoBackoff(), 0)
                ).ping()
            except redis.RedisError as exc:
                raised.append(str(exc))
            cache.close()
    logged = "\n".join(record.getMessage() for record in caplog.records) + caplog.text
    assert sum(record.levelno == logging.WARNING for record in caplog.records) == 4
    assert "failing" in logged and "rediss://" in logged
    assert PASSWORD not in logged
    assert not any(PASSWORD in text for text in raised)


def test_a_plain_redis_url_to_another_host_warns_to_use_tls(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        SharedImageCache(config_for("redis://cache.internal:6379/0"))
        SharedImageCache(config_for("rediss://cache.internal:6379/0"))
        SharedImageCache(config_for("redis://127.0.0.1:6379/0"))
        SharedImageCache(config_for("redis://localhost:6379/0"))
    messages = [record.getMessage() for record in caplog.records if record.name == LOGGER]
    assert len(messages) == 1
    assert "redis://cache.internal:6379/0" in messages[0]
    assert "rediss://" in messages[0]


# -- Redis Cluster --------------------------------------------------------------------------


def test_a_cluster_is_recognised_from_a_plain_url_and_spreads_images_over_its_nodes(
    redis_cluster: RedisClusterNodes,  # noqa: F811
) -> None:
    shared = SharedImageCache(config_for(redis_cluster.url))
    for index in range(12):
        shared.put(f"img-{index}", f"bytes {index}".encode())
    assert all(shared.get(f"img-{index}") == f"bytes {index}".encode() for index in range(12))
    holders = {redis_cluster.node_for_key(shared.key(f"img-{index}")) for index in range(12)}
    assert len(holders) > 1
    assert shared.counters["errors"] == 0
    shared.close()


@pytest.mark.parametrize(
    "spelling", ["redis+cluster://127.0.0.1:{port}", "redis://127.0.0.1:{port}/0?cluster=1"]
)
def test_a_cluster_can_be_named_in_the_url(
    redis_cluster: RedisClusterNodes,  # noqa: F811
    spelling: str,
) -> None:
    shared = SharedImageCache(config_for(spelling.format(port=redis_cluster.ports[1])))
    shared.put("named", b"via hint")
    assert shared.get("named") == b"via hint"
    assert shared.counters["errors"] == 0
    shared.close()


def test_a_plain_redis_named_as_plain_is_not_probed(
    redis_url: str, key_namespace: str, redis_client: redis.Redis
) -> None:
    shared = SharedImageCache(config_for(f"{redis_url}?cluster=0"), key_prefix=key_namespace)
    shared.put("plain", b"ok")
    assert shared.get("plain") == b"ok"
    shared.close()
