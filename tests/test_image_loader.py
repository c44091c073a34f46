"""The worker image loader against a real local origin, the real Redis and a real Redis Cluster:
local hits, in-flight dedup, the shared cache across workers, fail-open, limits and scoping."""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
from PIL import Image

from routing.media.images import MediaPolicy, fetch_bytes
from routing.observe import telemetry
from routing.observe.cache_stats import CacheStats, read_all
from routing.prompt.session_scope import scope_hash
from tests.redis_cluster import running_redis_cluster
from workers.image_loader import ImageLoader, ImageLoadError, LoadedImage, cache_key
from workers.shared_image_cache import SharedImageCache, SharedImageCacheConfig

LIMIT = 256 * 1024
SESSION_HEADER = "x-dynamo-session-id"
SCOPE_KEY = b"test-scope-key"


# What a bound on a load's time allows beyond the timeouts that make it: room for a loaded
# machine's scheduling, still far below what an unbounded wait costs (redis-py's default retries
# of a refused connection take ~3.4 s; a socket's default timeout, 5 s).
SLACK_S = 1.0


def colour_for(path: str, session: str) -> tuple[int, int, int]:
    digest = hashlib.sha256(f"{path}|{session}".encode()).digest()
    return digest[0], digest[1], digest[2]


def png(colour: tuple[int, int, int], size: tuple[int, int] = (24, 16)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


class Origin:
    """A local image origin: counts hits per path, serves each session its own colour.

    `/slow/...` waits 0.4 s before answering, `/big/...` serves more than LIMIT bytes and
    `/bomb/...` a tiny PNG that declares 4000x4000 pixels.
    """

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self._lock = threading.Lock()
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with origin._lock:
                    origin.hits[self.path] += 1
                if self.path.startswith("/slow/"):
                    time.sleep(0.4)
                session = self.headers.get(SESSION_HEADER, "")
                if self.path.startswith("/big/"):
                    body = b"\0" * (LIMIT + 1)
                elif self.path.startswith("/bomb/"):
                    out = io.BytesIO()
                    Image.new("1", (4000, 4000)).save(out, format="PNG")
                    body = out.getvalue()
                else:
                    body = png(colour_for(self.path, session))
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{path}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# The platform's own guarded fetch, allowed to reach the local origin; it reads up to 4x the
# loader's limit so that the loader's own size check is what refuses an oversized image.
ORIGIN_POLICY = MediaPolicy(
    max_bytes=4 * LIMIT, connect_timeout=2, read_timeout=5, allowed_hosts=("127.0.0.1",)
)


def fetch_capped(url: str, headers: Mapping[str, str]) -> bytes:
    return fetch_bytes(url, ORIGIN_POLICY, headers=headers)


def identity_of(url: str) -> str:
    return hashlib.sha256(url.encode()).hexdigest()[:32]


@pytest.fixture
def origin() -> Iterator[Origin]:
    server = Origin()
    yield server
    server.close()


@pytest.fixture
def shared_prefix(key_namespace: str) -> str:
    return f"{key_namespace}dynamo:mm:image:"


def shared_cache(url: str, prefix: str, **overrides: object) -> SharedImageCache:
    settings: dict[str, object] = {"enabled": True, "url": url, "max_file_size_bytes": LIMIT, **overrides}
    return SharedImageCache(SharedImageCacheConfig(**settings), key_prefix=prefix)  # type: ignore[arg-type]


@pytest.fixture
def make_loader() -> Iterator[object]:
    loaders: list[ImageLoader] = []

    def build(shared: SharedImageCache | None, worker: str = "gpu0", **options: object) -> ImageLoader:
        settings: dict[str, object] = {"local_capacity": 8, "max_bytes": LIMIT, "stats": None, **options}
        loader = ImageLoader(fetch=fetch_capped, shared_cache=shared, worker=worker, **settings)  # type: ignore[arg-type]
        loaders.append(loader)
        return loader

    yield build
    for loader in loaders:
        loader.close()


def load(loader: ImageLoader, url: str, **options: object) -> LoadedImage:
    return loader.load(url, identity_of(url), **options)  # type: ignore[arg-type]


def shared_keys(client: redis.Redis, prefix: str) -> list[bytes]:
    return list(client.scan_iter(match=f"{prefix}*", count=1000))


# -- the cache order ------------------------------------------------------------------------


def test_second_worker_gets_the_image_from_the_shared_cache_and_origin_is_fetched_once(
    origin: Origin, make_loader: object, redis_url: str, shared_prefix: str, redis_client: redis.Redis
) -> None:
    # given two workers with their own local caches and one shared cache
    gpu0 = make_loader(shared_cache(redis_url, shared_prefix), "gpu0")  # type: ignore[operator]
    gpu1 = make_loader(shared_cache(redis_url, shared_prefix), "gpu1")  # type: ignore[operator]
    url = origin.url("/products/42.png?v=3")
    # when
    first = load(gpu0, url)
    second = load(gpu1, url)
    again = load(gpu0, url)
    # then
    assert (first.source, second.source, again.source) == ("origin", "shared", "local")
    assert origin.hits["/products/42.png?v=3"] == 1
    expected = colour_for("/products/42.png?v=3", "")
    for loaded in (first, second, again):
        assert loaded.image.mode == "RGB"
        assert loaded.image.getpixel((0, 0)) == expected
        assert loaded.size_bytes == len(png(expected))
    assert len(shared_keys(redis_client, shared_prefix)) == 1


def test_ten_concurrent_loads_of_one_url_fetch_the_origin_once(origin: Origin, make_loader: object) -> None:
    loader = make_loader(None)  # type: ignore[operator]
    url = origin.url("/slow/shared-reference.png")
    start = threading.Barrier(10)
    results: list[LoadedImage] = []

    def one_load() -> None:
        start.wait()
        results.append(load(loader, url))

    threads = [threading.Thread(target=one_load) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert origin.hits["/slow/shared-reference.png"] == 1
    assert len(results) == 10
    sources = Counter(result.source for result in results)
    assert sources["origin"] == 1
    assert sources["inflight"] + sources["local"] == 9
    assert len({id(result.image) for result in results}) == 1


def test_a_caller_that_times_out_does_not_cancel_the_fetch_for_others(
    origin: Origin, make_loader: object, redis_url: str, shared_prefix: str, redis_client: redis.Redis
) -> None:
    loader = make_loader(shared_cache(redis_url, shared_prefix))  # type: ignore[operator]
    url = origin.url("/slow/patient.png")
    patient: list[LoadedImage] = []
    # given the first caller started the fetch and gives up after 50 ms
    with pytest.raises(ImageLoadError) as gave_up:
        impatient_start = time.perf_counter()
        waiter = threading.Thread(target=lambda: patient.append(load(loader, url)))
        threading.Timer(0.01, waiter.start).start()
        load(loader, url, timeout=0.05)
    assert gave_up.value.status == 504
    assert time.perf_counter() - impatient_start < 0.05 + SLACK_S
    # then the fetch still completes for the caller who joined it, and fills the caches
    time.sleep(0.05)
    waiter.join(timeout=5)
    # "inflight" when it joined the impatient caller's fetch (the usual order); "origin" if
    # the scheduler let it start first, and then the impatient caller was the one who joined.
    assert len(patient) == 1 and patient[0].source in ("inflight", "origin")
    assert load(loader, url).source == "local"
    assert origin.hits["/slow/patient.png"] == 1
    assert len(shared_keys(redis_client, shared_prefix)) == 1


def test_the_local_cache_keeps_the_most_recently_used_images(origin: Origin, make_loader: object) -> None:
    loader = make_loader(None, local_capacity=2)  # type: ignore[operator]
    a, b, c = (origin.url(f"/lru/{name}.png") for name in "abc")
    load(loader, a)
    load(loader, b)
    assert load(loader, a).source == "local"  # a is now the most recent
    load(loader, c)  # evicts b
    assert load(loader, a).source == "local"
    assert load(loader, b).source == "origin"
    assert loader.local_size == 2


def test_load_counts_reach_the_cache_stats(
    origin: Origin, make_loader: object, redis_url: str, shared_prefix: str,
    redis_client: redis.Redis, key_namespace: str,
) -> None:  # fmt: skip
    stats = CacheStats(redis_client, key_namespace, "gpu0")
    shared = SharedImageCache(
        SharedImageCacheConfig(enabled=True, url=redis_url), stats=stats, key_prefix=shared_prefix
    )
    loader = make_loader(shared, stats=stats)  # type: ignore[operator]
    url = origin.url("/stats.png")
    load(loader, url)
    load(loader, url)
    stats.flush()
    counts = read_all(redis_client, key_namespace)["gpu0"]
    assert counts["local_image"]["misses"] == 1
    assert counts["local_image"]["hits"] == 1
    assert counts["shared_image"]["misses"] == 1
    stats.close()


def test_each_decode_is_timed_in_the_workers_metrics_and_a_local_hit_decodes_nothing(
    origin: Origin, make_loader: object, redis_client: redis.Redis, key_namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    recorder = telemetry.MetricsRecorder(redis_client, key_namespace, source="gpu0")
    monkeypatch.setattr(telemetry, "_process_recorder", recorder)  # what `run_worker` attaches
    loader = make_loader(None, worker="gpu0")  # type: ignore[operator]
    for path in ("/timed-1.png", "/timed-1.png", "/timed-2.png"):
        load(loader, origin.url(path))
    recorder.flush()
    decodes = telemetry.histogram_merged(
        telemetry.read_totals(redis_client, key_namespace), "image_decode_seconds", worker="gpu0"
    )
    assert sum(decodes) == 2


# -- a cache that is down -------------------------------------------------------------------


class SilentRedis:
    """Accepts connections and never answers."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]

    def close(self) -> None:
        self._listener.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def assert_loads_fail_open(
    loader: ImageLoader,
    origin: Origin,
    caplog: pytest.LogCaptureFixture,
    per_load_bound: float,
    count: int = 4,
) -> None:
    with caplog.at_level(logging.DEBUG, logger="workers.shared_image_cache"):
        for index in range(count):
            started = time.perf_counter()
            loaded = load(loader, origin.url(f"/down/{index}.png"))
            assert loaded.source == "origin"
            assert time.perf_counter() - started < per_load_bound
    records = [record for record in caplog.records if record.name == "workers.shared_image_cache"]
    assert sum(record.levelno == logging.WARNING for record in records) == 1
    assert sum(record.levelno == logging.DEBUG for record in records) == 2 * count  # one GET, one SET


def test_loads_succeed_from_the_origin_when_the_cache_stops_answering(
    origin: Origin, make_loader: object, caplog: pytest.LogCaptureFixture
) -> None:
    silent = SilentRedis()
    cache = shared_cache(f"redis://127.0.0.1:{silent.port}/0", "x:", io_timeout_secs=0.25)
    loader = make_loader(cache)  # type: ignore[operator]
    # one failed GET and one failed SET, each bounded by the IO timeout
    assert_loads_fail_open(loader, origin, caplog, per_load_bound=2 * 0.25 + SLACK_S, count=3)
    silent.close()


def test_loads_succeed_from_the_origin_when_the_cache_refuses_connections(
    origin: Origin, make_loader: object, caplog: pytest.LogCaptureFixture
) -> None:
    loader = make_loader(shared_cache(f"redis://127.0.0.1:{closed_port()}/0", "x:"))  # type: ignore[operator]
    assert_loads_fail_open(loader, origin, caplog, per_load_bound=SLACK_S)


def test_loads_succeed_from_the_origin_when_connecting_to_the_cache_times_out(
    origin: Origin, make_loader: object, caplog: pytest.LogCaptureFixture
) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    filler = socket.create_connection(listener.getsockname(), timeout=1)  # the backlog is now full
    loader = make_loader(shared_cache(f"redis://127.0.0.1:{listener.getsockname()[1]}/0", "x:"))  # type: ignore[operator]
    # default connect timeout 0.1 s: two bounded attempts per load
    assert_loads_fail_open(loader, origin, caplog, per_load_bound=2 * 0.1 + SLACK_S, count=3)
    filler.close()
    listener.close()


def test_loads_succeed_when_a_cluster_node_is_killed_mid_test(
    origin: Origin, make_loader: object, caplog: pytest.LogCaptureFixture
) -> None:
    with running_redis_cluster() as cluster:
        # given a warm shared cache spread over three nodes
        warm = make_loader(shared_cache(cluster.url, ""), "gpu0")  # type: ignore[operator]
        urls = [origin.url(f"/cluster/{index}.png") for index in range(12)]
        for url in urls:
            assert load(warm, url).source == "origin"
        holder = {url: cluster.node_for_key(warm._shared.key(identity_of(url))) for url in urls}  # type: ignore[union-attr]
        # the victim is a node other than the discovery URL's (node 0) that holds some images
        victim = Counter(node for node in holder.values() if node != 0).most_common(1)[0][0]
        assert set(holder.values()) - {victim}
        # when a node that is not the discovery URL dies
        cluster.kill(victim)
        cold = make_loader(shared_cache(cluster.url, ""), "gpu1")  # type: ignore[operator]
        with caplog.at_level(logging.DEBUG, logger="workers.shared_image_cache"):
            for url in urls:
                started = time.perf_counter()
                loaded = load(cold, url)
                elapsed = time.perf_counter() - started
                # then every load succeeds: from the survivors' cache, or from the origin
                expected = "origin" if holder[url] == victim else "shared"
                assert loaded.source == expected, url
                assert elapsed < 1.0 + SLACK_S
        warnings = [
            record for record in caplog.records
            if record.name == "workers.shared_image_cache" and record.levelno == logging.WARNING
        ]  # fmt: skip
        assert len(warnings) == 1
        lost = sum(node == victim for node in holder.values())
        assert all(origin.hits[f"/cluster/{index}.png"] >= 1 for index in range(12))
        assert sum(origin.hits[f"/cluster/{index}.png"] for index in range(12)) == 12 + lost


# -- what is refused, and what never reaches the shared cache -------------------------------


def test_an_image_over_the_size_limit_is_refused_and_never_stored(
    origin: Origin, make_loader: object, redis_url: str, shared_prefix: str, redis_client: redis.Redis
) -> None:
    loader = make_loader(shared_cache(redis_url, shared_prefix))  # type: ignore[operator]
    with pytest.raises(ImageLoadError) as refused:
        load(loader, origin.url("/big/poster.png"))
    assert refused.value.status == 413
    with pytest.raises(ImageLoadError):
        load(loader, origin.url("/big/poster.png"))
    assert origin.hits["/big/poster.png"] == 2  # nothing cached anywhere
    assert shared_keys(redis_client, shared_prefix) == []
    assert loader.local_size == 0


def test_a_decompression_bomb_is_refused_before_decoding(origin: Origin, make_loader: object) -> None:
    loader = make_loader(None, max_pixels=1_000_000)  # type: ignore[operator]
    with pytest.raises(ImageLoadError) as refused:
        load(loader, origin.url("/bomb/tiny-file-huge-image.png"))
    assert refused.value.code == "image_too_many_pixels"
    assert loader.local_size == 0


def test_a_data_url_is_decoded_locally_and_never_stored_in_the_shared_cache(
    make_loader: object, redis_url: str, shared_prefix: str, redis_client: redis.Redis
) -> None:
    loader = make_loader(shared_cache(redis_url, shared_prefix))  # type: ignore[operator]
    encoded = png((10, 20, 30))
    url = "data:image/png;base64," + base64.b64encode(encoded).decode()
    first = load(loader, url)
    second = load(loader, url)
    assert (first.source, second.source) == ("data", "local")
    assert first.image.getpixel((0, 0)) == (10, 20, 30)
    assert first.size_bytes == len(encoded)
    assert shared_keys(redis_client, shared_prefix) == []


def test_an_oversized_data_url_is_refused(make_loader: object) -> None:
    loader = make_loader(None)  # type: ignore[operator]
    url = "data:image/png;base64," + base64.b64encode(b"\0" * (LIMIT + 1)).decode()
    with pytest.raises(ImageLoadError) as refused:
        load(loader, url)
    assert refused.value.status == 413


def test_a_frontend_decoded_image_is_never_fetched_nor_stored_in_the_shared_cache(
    origin: Origin, make_loader: object, redis_url: str, shared_prefix: str, redis_client: redis.Redis
) -> None:
    loader = make_loader(shared_cache(redis_url, shared_prefix))  # type: ignore[operator]
    encoded = png((200, 100, 50))
    first = loader.load_bytes("pixel-identity-1", encoded)
    second = loader.load_bytes("pixel-identity-1", encoded)
    assert (first.source, second.source) == ("frontend", "local")
    assert first.image.getpixel((0, 0)) == (200, 100, 50)
    assert shared_keys(redis_client, shared_prefix) == []
    assert sum(origin.hits.values()) == 0


def test_undecodable_bytes_are_refused_and_not_shared(
    make_loader: object, redis_url: str, shared_prefix: str, redis_client: redis.Redis
) -> None:
    loader = make_loader(shared_cache(redis_url, shared_prefix))  # type: ignore[operator]
    with pytest.raises(ImageLoadError) as refused:
        loader.load_bytes("garbage", b"not an image at all")
    assert refused.value.code == "invalid_image"


# -- session scoping ------------------------------------------------------------------------


def test_with_scoping_the_same_url_returns_each_scopes_own_content(
    origin: Origin, make_loader: object, redis_url: str, shared_prefix: str, redis_client: redis.Redis
) -> None:
    gpu0 = make_loader(shared_cache(redis_url, shared_prefix), "gpu0", session_scoped=True)  # type: ignore[operator]
    gpu1 = make_loader(shared_cache(redis_url, shared_prefix), "gpu1", session_scoped=True)  # type: ignore[operator]
    url = origin.url("/me/avatar.png")

    def load_as(loader: ImageLoader, session: str) -> LoadedImage:
        return load(
            loader, url, scope_key=scope_hash(session, SCOPE_KEY), origin_headers={SESSION_HEADER: session}
        )

    alice, bob = load_as(gpu0, "alice"), load_as(gpu0, "bob")
    alice_again, bob_elsewhere = load_as(gpu0, "alice"), load_as(gpu1, "bob")
    assert alice.image.getpixel((0, 0)) == colour_for("/me/avatar.png", "alice")
    assert bob.image.getpixel((0, 0)) == colour_for("/me/avatar.png", "bob")
    assert alice.image.getpixel((0, 0)) != bob.image.getpixel((0, 0))
    assert (alice_again.source, alice_again.image.getpixel((0, 0))) == ("local", alice.image.getpixel((0, 0)))
    assert (bob_elsewhere.source, bob_elsewhere.image.getpixel((0, 0))) == (
        "shared",
        bob.image.getpixel((0, 0)),
    )
    assert origin.hits["/me/avatar.png"] == 2
    keys = shared_keys(redis_client, shared_prefix)
    assert len(keys) == 2
    assert not any(b"alice" in key or b"bob" in key for key in keys)


def test_with_scoping_a_request_without_scope_bypasses_every_cache(
    origin: Origin, make_loader: object, redis_url: str, shared_prefix: str,
    redis_client: redis.Redis, key_namespace: str,
) -> None:  # fmt: skip
    stats = CacheStats(redis_client, key_namespace, "gpu0")
    loader = make_loader(shared_cache(redis_url, shared_prefix), session_scoped=True, stats=stats)  # type: ignore[operator]
    url = origin.url("/slow/unscoped.png")
    results: list[LoadedImage] = []
    threads = [threading.Thread(target=lambda: results.append(load(loader, url))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    results.append(load(loader, url, scope_key=""))
    assert [result.source for result in results] == ["origin"] * 4
    assert origin.hits["/slow/unscoped.png"] == 4  # no in-flight sharing either
    assert shared_keys(redis_client, shared_prefix) == []
    assert loader.local_size == 0
    stats.flush()
    counts = read_all(redis_client, key_namespace)["gpu0"]
    assert counts["local_image"]["bypasses"] == 4
    assert counts["shared_image"]["bypasses"] == 4
    stats.close()


def test_without_scoping_the_loader_keys_on_the_partition_the_worker_gives_it(
    origin: Origin, make_loader: object
) -> None:
    # The worker passes no session scope when scoping is off (sessions share), but it does pass
    # a tenant's cache partition: one tenant never reuses (or times) another's images.
    loader = make_loader(None)  # type: ignore[operator]
    url = origin.url("/public/logo.png")
    load(loader, url)
    assert load(loader, url).source == "local"
    assert load(loader, url, scope_key="salt-00000000000000aa").source == "origin"
    assert load(loader, url, scope_key="salt-00000000000000aa").source == "local"


def test_cache_key_is_the_identity_prefixed_by_the_scope_hash() -> None:
    assert cache_key("abc", None) == "abc"
    assert cache_key("abc", "f" * 32) == f"{'f' * 32}:abc"
    assert cache_key("abc", "f" * 32) != cache_key("abc", "e" * 32)
