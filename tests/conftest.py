"""Fixtures shared by the whole suite, and the test tiers.

Tests talk to the real Redis (TEST_REDIS_URL, default database 13 on the local server) and
each test works inside a key namespace of its own, removing only the keys it wrote.

A test's tier markers follow from the fixtures it uses (`pytest_collection_modifyitems`), so
none can forget one: `make check` runs everything but `integration` and `browser`.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import redis

from tests import platform_harness as harness
from tests import process_groups

TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")

# The marker each fixture brings, to every test whose fixture closure holds it (module-scoped
# fixtures of a test file included). Every fixture that starts the platform's processes
# requests `platform_harness`; a process started without it fails (tests/platform_harness.py).
MARKERS_BY_FIXTURE = {
    "platform_harness": "integration",
    "demo_model_dir": "model",
    "qwen3_demo_dir": "model",
    "llava_demo_dir": "model",
    "chromium": "browser",
}


def pytest_configure(config: pytest.Config) -> None:
    # One file for the whole run, parallel test processes included (they inherit the variable).
    if not os.environ.get(harness.WORKER_STARTS_FILE):
        handle, path = tempfile.mkstemp(prefix="worker-starts-")
        os.close(handle)
        os.environ[harness.WORKER_STARTS_FILE] = path
        config.stash[_starts_file_key] = path
    process_groups.configure(config)


_starts_file_key = pytest.StashKey[str]()


def pytest_unconfigure(config: pytest.Config) -> None:
    path = config.stash.get(_starts_file_key, None)
    if path:
        os.environ.pop(harness.WORKER_STARTS_FILE, None)
        os.unlink(path)
    process_groups.unconfigure(config)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        for fixture, marker in MARKERS_BY_FIXTURE.items():
            if fixture in fixtures and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
    process_groups.record(items)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's, absent under `-p no:xdist`
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadgroup` keeps each group of `tests/process_groups.py` in one test process."""
    if config.getvalue("dist") == "loadgroup":
        return process_groups.ProcessGroupScheduling(config, log)
    return None


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures start anything
def pytest_runtest_setup(item: pytest.Item) -> None:
    marked = item.get_closest_marker("integration") is not None
    harness.guard_starts = True
    harness.starts_allowed_for = item.nodeid if marked else None


@pytest.hookimpl(trylast=True)  # after the durations: next to the run's last lines
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput"):  # a parallel test process: the controller reports
        return
    model, simulated = harness.worker_starts("model"), harness.worker_starts("sim")
    terminalreporter.write_line(
        f"worker processes started: {model + simulated} ({model} with the model, {simulated} simulated); "
        f"frontends started: {harness.frontend_starts()}"
    )
    by_module = harness.worker_starts_by_module()
    if by_module:
        terminalreporter.write_line(
            "worker processes by test module: " + ", ".join(f"{m} {n}" for m, n in by_module.items())
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Remove what in-process code wrote under the session's prefix (see tests/settings.py)."""
    prefix = os.environ.get("REDIS_KEY_PREFIX", "")
    if not prefix.startswith("test:"):
        return
    # The process's metrics recorder flushes in the background: stopped first, it writes
    # nothing after the keys are gone.
    from routing.observe import telemetry

    telemetry.process_recorder().close()
    try:
        client = redis.Redis.from_url(TEST_REDIS_URL)
        for key in client.scan_iter(match=f"{prefix}*", count=1000):
            client.delete(key)
        client.close()
    except redis.RedisError:
        pass


@pytest.fixture
def redis_url() -> str:
    return TEST_REDIS_URL


@pytest.fixture
def key_namespace() -> str:
    """A key prefix no other test (or deployment) uses."""
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def redis_client(redis_url: str, key_namespace: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.ping()
    yield client
    for key in client.scan_iter(match=f"{key_namespace}*", count=1000):
        client.delete(key)
    client.close()


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """The demo checkpoint, built once per test session from its fixed seed (no download)."""
    from workers.demo_model import build_demo_model

    path = tmp_path_factory.mktemp("models") / "demo"
    build_demo_model(path)
    return path


@pytest.fixture
def served_demo_model(settings, demo_model_dir) -> str:
    """The frontend serves the demo checkpoint (in this process); returns its model name. API test
    modules use it for every test (`pytest.mark.usefixtures`); some add settings of their own."""
    settings.MODEL_PATH = demo_model_dir
    settings.MODEL_NAME = ""
    return demo_model_dir.name


@pytest.fixture(scope="session")
def qwen3_demo_dir(tmp_path_factory: pytest.TempPathFactory):
    """The Qwen3-VL demo checkpoint (`build_demo_model --family qwen3_vl`), built once per session."""
    from workers.demo_model import build_demo_qwen3_vl

    path = tmp_path_factory.mktemp("models") / "demo-qwen3-vl"
    build_demo_qwen3_vl(path)
    return path


@pytest.fixture(scope="session")
def llava_demo_dir(tmp_path_factory: pytest.TempPathFactory):
    """The LLaVA-1.5 ("llava") or LLaVA-NeXT ("llava_next") demo checkpoint, each built once per
    session, when first asked for (several test files use them)."""
    from workers.demo_model import build_demo_llava

    names = {"llava": "llava-1.5-tiny", "llava_next": "llava-next-tiny"}
    built: dict[str, Path] = {}

    def directory(family: str) -> Path:
        if family not in built:
            path = tmp_path_factory.mktemp("models") / names[family]
            build_demo_llava(path, next=family == "llava_next")
            built[family] = path
        return built[family]

    return directory


@pytest.fixture(scope="session")
def shared_parts(demo_model_dir):
    """The demo model and its processor, loaded once: each test builds engines around them."""
    from workers.engine import Engine

    engine = Engine.load(demo_model_dir)
    return engine.model, engine.processor


@pytest.fixture
def demo_engine(shared_parts):
    """Builds engines around the shared demo model: each with fresh, empty caches."""
    from workers.embedding_cache import EmbeddingCache
    from workers.engine import Engine, load_image_directly
    from workers.kv_cache import KvPool

    model, processor = shared_parts

    def build(*, capacity: int = 512, events=None, load_image=load_image_directly, **options):
        return Engine(
            model=model,
            processor=processor,
            model_name="demo",
            device="cpu",
            kv_pool=KvPool(capacity_blocks=capacity, block_size=16, worker="w", publish_events=events),
            embedding_cache=EmbeddingCache(64 << 20),
            load_image=load_image,
            **options,
        )

    return build


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """Headless Chromium and its driver: the browser and the driver's paths. Requesting it marks a
    test `browser`; `make test` installs them where missing (scripts/ensure_chromium.sh)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not (browser and driver):
        pytest.fail(
            "the browser test needs Debian's chromium and chromium-driver: run scripts/ensure_chromium.sh"
        )
    return browser, driver


@pytest.fixture(scope="session")
def platform_harness() -> type[harness.PlatformProcesses]:
    """What starts the platform's processes (tests/platform_harness.py). Every fixture that starts
    them requests this one, which marks the tests that use it `integration`."""
    return harness.PlatformProcesses


@pytest.fixture
def platform_processes(platform_harness, tmp_path, demo_model_dir, redis_url: str, key_namespace: str):
    """A factory for a platform of the test's own (workers, server), for a test that kills or
    re-roles a worker, or needs worker settings of its own; everything it started is stopped
    after. A test that only sends requests uses one of the session's pools, which start no worker
    for it: `pooled_platform` (the model), `pooled_sim_platform` (simulated), `held_platform` (a
    simulated worker to freeze), `lone_frontend` (one model worker alone); one that needs no
    frontend settings of its own starts no frontend either (`pooled_frontend`,
    `pooled_sim_frontend`)."""
    started: list[harness.PlatformProcesses] = []

    def start(**env: str) -> harness.PlatformProcesses:
        processes = platform_harness(tmp_path, demo_model_dir, redis_url, key_namespace, env)
        started.append(processes)
        return processes

    yield start
    for processes in started:
        processes.close()


POOL_WORKERS = ("pool_a", "pool_b")  # \w+ names: the routing log is read by regex
POOL_TENANTS = 48  # made at once when the pool starts; a test past them makes its own


class WorkerPool:
    """Worker processes started once per session, shared by the end-to-end tests that leave them
    as they found them: each test gets frontends of its own (or the pool's running one) and a
    tenant of its own, whose cache salt keeps what other tests cached out of its requests' overlap."""

    def __init__(
        self,
        processes: harness.PlatformProcesses,
        tenant_keys: list[str],
        names: tuple[str, ...] = POOL_WORKERS,
    ) -> None:
        self.processes = processes
        self.names = names  # the pool's workers, as they register
        self._tenant_keys = tenant_keys
        self._tenants_used = 0
        self._frontend: harness.PlatformProcesses | None = None

    def fresh_tenant_key(self) -> str:
        """An operator key of a tenant no earlier test used (it may call /v1/route and /metrics)."""
        self._tenants_used += 1
        if self._tenant_keys:
            return self._tenant_keys.pop()
        (key,) = self.processes.make_keys({"tenant": f"pool-tenant-{self._tenants_used}", "staff": True})
        return key

    def join(self, tmp_path: Path, **env: str) -> harness.PlatformProcesses:
        """Frontends of a test's own (not started yet) in front of the pool, with a fresh tenant."""
        return harness.PlatformProcesses.joining(self.processes, tmp_path, self.fresh_tenant_key(), env)

    def running_frontend(self) -> harness.PlatformProcesses:
        """The pool's own frontend (default settings), started when a test first asks for it and
        kept until the pool stops, as a tenant no earlier test used sees it (`as_tenant`)."""
        if self._frontend is None:
            self._frontend = self.join(Path(tempfile.mkdtemp(dir=self.processes.tmp, prefix="frontend-")))
            self._frontend.start_server()
        return self._frontend.as_tenant(self.fresh_tenant_key())

    def stop_frontend(self) -> None:
        if self._frontend is not None:
            self._frontend.close()


def _start_pool(
    platform_harness,
    directory: Path,
    model_dir: Path,
    env: dict[str, str],
    start,
    tenants: int,
    namespace: str = "",
) -> Iterator[WorkerPool]:
    """A platform of its own (`env` for all its processes, in `namespace` or a fresh one), its
    workers started by `start(processes)` (which returns their names), and `tenants` operator
    keys made while they load."""
    namespace = namespace or f"test:{uuid.uuid4().hex[:12]}:"
    processes = platform_harness(directory, model_dir, TEST_REDIS_URL, namespace, env)
    try:
        names = tuple(start(processes))
        keys = processes.make_keys(
            *({"tenant": f"pool-tenant-{i}", "staff": True} for i in range(tenants, 0, -1))
        )
        processes.wait_for_workers(*names)
        pool = WorkerPool(processes, keys, names)
        try:
            yield pool
        finally:
            pool.stop_frontend()
    finally:
        processes.close()


def _model_workers(processes: harness.PlatformProcesses) -> tuple[str, ...]:
    for name in POOL_WORKERS:
        processes.start_worker(name)
    return POOL_WORKERS


@pytest.fixture(scope="session")
def worker_pool(
    platform_harness, tmp_path_factory: pytest.TempPathFactory, demo_model_dir
) -> Iterator[WorkerPool]:
    """Two workers with the demo model (POOL_WORKERS), for the tests that need its answers."""
    yield from _start_pool(
        platform_harness,
        tmp_path_factory.mktemp("worker-pool"),
        demo_model_dir,
        {"MEDIA_ALLOWED_HOSTS": "127.0.0.1"},
        _model_workers,
        POOL_TENANTS,
    )


def _frontends_of(pool: WorkerPool, tmp_path: Path) -> Iterator:
    """A factory of frontends of a test's own before `pool` (`**frontend_settings`, a tenant of
    its own each; `start_server()` starts them), and stops them after the test."""
    joined: list[harness.PlatformProcesses] = []

    def join(**env: str) -> harness.PlatformProcesses:
        joined.append(pool.join(tmp_path, **env))
        return joined[-1]

    yield join
    for platform in joined:
        platform.close()


@pytest.fixture
def pooled_platform(worker_pool: WorkerPool, tmp_path):
    """A factory for the session's worker pool (POOL_WORKERS) behind frontends of the test's own:
    `pooled_platform(**frontend_settings)`, then `start_server()`. It answers as a platform of
    the test's own would, with a tenant of its own; the frontends are stopped after."""
    yield from _frontends_of(worker_pool, tmp_path)


SIM_POOL_SIZE = 3


@pytest.fixture(scope="session")
def sim_pool(
    platform_harness, tmp_path_factory: pytest.TempPathFactory, demo_model_dir
) -> Iterator[WorkerPool]:
    """Simulated workers (workers.sim_engine) in one process, started once per session, for the
    end-to-end tests of routing, caching and load that need no real answers and kill nothing:
    SIM_POOL_SIZE idle workers behind frontends of each test's own, a tenant of its own each."""
    yield from _start_pool(
        platform_harness,
        tmp_path_factory.mktemp("sim-pool"),
        demo_model_dir,
        {"MEDIA_ALLOWED_HOSTS": "127.0.0.1"},
        lambda processes: processes.start_sim_workers("simpool", SIM_POOL_SIZE),
        8,
    )


@pytest.fixture
def pooled_sim_platform(sim_pool: WorkerPool, tmp_path):
    """`pooled_platform`'s counterpart for the session's simulated workers (`sim_pool.names`)."""
    yield from _frontends_of(sim_pool, tmp_path)


HELD_WORKER = "solo"
# The held worker's pool size (as bench/workload.py gives a simulated worker a native worker's
# KV_CAPACITY_BLOCKS) and clock speed: tests/test_sim_fleet.py reads both.
HELD_KV_BLOCKS, HELD_SPEEDUP = 64, 50


@pytest.fixture(scope="session")
def held_worker_pool(
    platform_harness, tmp_path_factory: pytest.TempPathFactory, demo_model_dir
) -> Iterator[WorkerPool]:
    """One simulated worker (HELD_WORKER), alone in a platform: a test freezes it with SIGSTOP to
    hold it busy, and thaws it before it ends (`held_platform`), for the tests of what waits for a
    busy fleet (its heartbeat outlives the freeze: 60 s). Its pool has a size of its own and its
    clock runs HELD_SPEEDUP times faster than real time, for the tests of a simulated worker's
    pool and clock (tests/test_sim_fleet.py), through its running frontend: neither setting
    changes what a frozen worker holds up, and sharing it saves a worker process."""
    yield from _start_pool(
        platform_harness,
        tmp_path_factory.mktemp("held-worker"),
        demo_model_dir,
        {"WORKER_HEARTBEAT_TTL_SECS": "60", "MEDIA_ALLOWED_HOSTS": "127.0.0.1"},
        lambda processes: processes.start_sim_workers(
            HELD_WORKER, 1, "--sim-kv-blocks", str(HELD_KV_BLOCKS), "--sim-speedup", str(HELD_SPEEDUP)
        ),
        8,
    )


@pytest.fixture
def held_platform(held_worker_pool: WorkerPool, tmp_path):
    """A factory for the session's held worker behind frontends of the test's own (`**frontend
    settings`); after the test, the worker is thawed and the frontends stopped."""
    frontends = _frontends_of(held_worker_pool, tmp_path)
    yield next(frontends)
    held_worker_pool.processes.workers[HELD_WORKER].send_signal(signal.SIGCONT)  # if a test failed frozen
    next(frontends, None)


LONE_WORKER = "keeper"


@pytest.fixture(scope="session")
def lone_worker_pool(
    platform_harness, tmp_path_factory: pytest.TempPathFactory, demo_model_dir
) -> Iterator[WorkerPool]:
    """One worker with the demo model (LONE_WORKER), alone in a platform, for the tests that read
    that worker's own counters and caches (its batches; what `flush_caches` finds in it): origins
    on 127.0.0.1 allowed, the shared image cache on (in the test Redis, under the platform's
    namespace: `lone_worker_pool.processes.env["SHARED_IMAGE_CACHE_KEY_PREFIX"]`)."""
    namespace = f"test:{uuid.uuid4().hex[:12]}:"
    yield from _start_pool(
        platform_harness,
        tmp_path_factory.mktemp("lone-worker"),
        demo_model_dir,
        {
            "MEDIA_ALLOWED_HOSTS": "127.0.0.1",
            "DYN_MM_SHARED_IMAGE_CACHE_ENABLED": "1",
            "DYN_MM_SHARED_IMAGE_CACHE_URL": TEST_REDIS_URL,
            "SHARED_IMAGE_CACHE_KEY_PREFIX": f"{namespace}img:",
        },
        lambda processes: (processes.start_worker(LONE_WORKER), [LONE_WORKER])[1],
        4,
        namespace,
    )


class PrivateRedisPlatform(NamedTuple):
    server: harness.PrivateRedis  # the platform's only Redis, which its tests kill, restart, freeze
    platform: harness.PlatformProcesses
    workers: tuple[str, ...]


@pytest.fixture(scope="session")
def private_redis_platform(
    platform_harness, tmp_path_factory: pytest.TempPathFactory, demo_model_dir
) -> Iterator[PrivateRedisPlatform]:
    """A platform on a redis-server of its own, shared by the tests that kill, restart or freeze
    its Redis (each leaves it serving again): two simulated workers in one process, a frontend,
    every Redis wait bounded by 2 s (REDIS_TIMEOUT_SECS)."""
    server = harness.PrivateRedis(tmp_path_factory.mktemp("private-redis"))
    try:
        platform = platform_harness(
            tmp_path_factory.mktemp("private-redis-platform"),
            demo_model_dir,
            server.url,
            f"test:{uuid.uuid4().hex[:12]}:",
            {"REDIS_TIMEOUT_SECS": "2", "MEDIA_ALLOWED_HOSTS": "127.0.0.1"},
        )
        try:
            names = tuple(platform.start_sim_workers("sturdy", 2))
            platform.wait_for_workers(*names)
            platform.start_server()
            yield PrivateRedisPlatform(server, platform, names)
        finally:
            platform.close()
    finally:
        server.stop()


@pytest.fixture
def make_api_key():
    """Makes an API key (and its tenant, if new) in the test database; returns the plaintext.

    Authentication stays on in the tests: in-process API tests send one of these.
    """
    from tenants.keys import create_api_key
    from tenants.models import Tenant

    def make(tenant: str = "tenant-a", *, staff: bool = False, **tenant_fields) -> str:
        owner, _ = Tenant.objects.get_or_create(name=tenant, defaults=tenant_fields)
        return create_api_key(owner, f"test key of {tenant}", staff=staff)[1]

    return make


@pytest.fixture
def api_headers(make_api_key) -> dict[str, str]:
    """An operator key's Authorization header (it may also call /v1/route and /metrics)."""
    return {"Authorization": f"Bearer {make_api_key('operators', staff=True)}"}


@pytest.fixture(autouse=True)
def _fresh_live_policy():
    """Each test sees the policy its own settings make (processes cache it for a second)."""
    from routing.policy import forget_cached_policy

    forget_cached_policy()
    yield
    forget_cached_policy()


@pytest.fixture(autouse=True)
def _no_keys_verified_by_another_test():
    """A key one test verified is not another's: the database under it is emptied between tests
    by truncation, which tells nobody."""
    from tenants.keys import verified_keys

    yield
    verified_keys().clear()


@pytest.fixture(autouse=True)
def _no_worker_rows_kept_from_another_test():
    """Worker rows one test read are not another's: the database under them is emptied between
    tests, which tells nobody (and the session's generation in Redis does not move)."""
    from inference_platform.serving.dispatch import forget_fleet_read
    from routing.fleet.worker_rows import kept_rows

    kept_rows().clear()
    forget_fleet_read()  # nor the fleet reads made from them (a refresh starts from the last read)
    yield
    kept_rows().clear()
    forget_fleet_read()


@pytest.fixture(autouse=True)
def _no_image_sizes_kept_from_another_test():
    """A size one test read by URL is not another's to use (an origin may reuse a path): the
    frontend's collaborators, and what they keep, are built afresh for each test."""
    from inference_platform.serving.frontend import frontend

    yield
    frontend().reset()


@pytest.fixture(scope="session")
def observed_platform(platform_harness, tmp_path_factory: pytest.TempPathFactory, demo_model_dir):
    """The real platform the observability tests share (tests/observed_platform.py): workers of its
    own, since those tests compare what the dashboard shows with all that the workers served."""
    from tests.image_server import ImageServer
    from tests.observed_platform import start_observed_platform

    namespace = f"test:{uuid.uuid4().hex[:12]}:"
    with ImageServer() as origin:
        processes = platform_harness(
            tmp_path_factory.mktemp("observed"),
            demo_model_dir,
            TEST_REDIS_URL,
            namespace,
            # the dashboard asks every 0.5 s: a browser test waits a poll for each change it checks
            {"MEDIA_ALLOWED_HOSTS": "127.0.0.1", "DASHBOARD_POLL_INTERVAL_SECS": "0.5"},
        )
        try:
            yield start_observed_platform(processes, origin)
        finally:
            processes.close()


@pytest.fixture(scope="session")
def shared_platform(worker_pool: WorkerPool, tmp_path_factory: pytest.TempPathFactory):
    """The worker pool behind one frontend for the whole session, for tests that only send it
    requests and change nothing (the fuzzer, the body limit); a test that needs frontend settings
    of its own uses `pooled_platform`, and one that kills a process `platform_processes`."""
    platform = harness.PlatformProcesses.joining(
        worker_pool.processes,
        tmp_path_factory.mktemp("shared-frontend"),
        worker_pool.fresh_tenant_key(),
        {"API_MAX_BODY_MB": "4"},
    )
    try:
        platform.start_server()
        yield platform
    finally:
        platform.close()


@pytest.fixture
def pooled_frontend(shared_platform, worker_pool: WorkerPool) -> harness.PlatformProcesses:
    """`shared_platform`'s frontend as a tenant of the test's own sees it (its cache salt keeps
    other tests' prompts out of its overlap): for an end-to-end test of the pool that needs no
    frontend settings of its own and leaves nothing a later test's frontend would read (a routing
    policy, a disabled worker). Starting a frontend costs about 2 s of CPU; this one is running."""
    return shared_platform.as_tenant(worker_pool.fresh_tenant_key())


@pytest.fixture
def pooled_sim_frontend(sim_pool: WorkerPool) -> harness.PlatformProcesses:
    """`pooled_frontend`'s counterpart for the session's simulated workers: their running
    frontend (default settings), as a tenant of the test's own sees it."""
    return sim_pool.running_frontend()


@pytest.fixture
def lone_frontend(lone_worker_pool: WorkerPool) -> harness.PlatformProcesses:
    """`pooled_frontend`'s counterpart for the session's lone worker: its running frontend
    (default settings), as a tenant of the test's own sees it."""
    return lone_worker_pool.running_frontend()


class _CountedLines:
    """The loop's real connections (`frontend().redis_lines()`), noting each round trip made on
    them in `round_trips` (shared by every such wrapper of a test: one log, in order); each
    command still goes to Redis."""

    def __init__(self, lines, round_trips: list[tuple[str, ...]]) -> None:
        self._lines, self.round_trips = lines, round_trips

    async def execute(self, *args):
        self.round_trips.append((args[0],))
        return await self._lines.execute(*args)

    async def execute_many(self, *commands):
        self.round_trips.append(tuple(command[0] for command in commands))
        return await self._lines.execute_many(*commands)

    async def replies(self, *commands):
        self.round_trips.append(tuple(command[0] for command in commands))
        return await self._lines.replies(*commands)


@pytest.fixture
def counted_lines(monkeypatch) -> Iterator[list[tuple[str, ...]]]:
    """The round trips made on every `redis_lines()` the frontend hands out while the test runs,
    in the order they were made: each one's command names (a pipeline's, together)."""
    from inference_platform.serving.frontend import frontend

    round_trips: list[tuple[str, ...]] = []
    hand_out = frontend().redis_lines

    def counted(url: str | None = None):
        return _CountedLines(hand_out(url), round_trips)

    monkeypatch.setattr(frontend(), "redis_lines", counted)
    yield round_trips
