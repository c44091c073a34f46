"""Fixtures shared by the whole suite.

Tests talk to the real Redis (TEST_REDIS_URL, default database 13 on the local server) and
each test works inside a key namespace of its own, removing only the keys it wrote.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import redis

TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/13")


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


@pytest.fixture
def platform_processes(tmp_path, demo_model_dir, redis_url: str, key_namespace: str):
    """A factory for the real platform (workers, server); everything it started is stopped after."""
    from tests.platform_harness import PlatformProcesses

    started: list[PlatformProcesses] = []

    def start(**env: str) -> PlatformProcesses:
        processes = PlatformProcesses(tmp_path, demo_model_dir, redis_url, key_namespace, env)
        started.append(processes)
        return processes

    yield start
    for processes in started:
        processes.close()


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
    from routing.fleet.worker_rows import kept_rows

    kept_rows().clear()
    yield
    kept_rows().clear()


@pytest.fixture(autouse=True)
def _no_image_sizes_kept_from_another_test():
    """A size one test read by URL is not another's to use (an origin may reuse a path): the
    frontend's collaborators, and what they keep, are built afresh for each test."""
    from inference_platform.serving.frontend import frontend

    yield
    frontend().reset()


@pytest.fixture(scope="session")
def observed_platform(tmp_path_factory: pytest.TempPathFactory, demo_model_dir):
    """The real platform the observability tests share (tests/observed_platform.py)."""
    from tests.image_server import ImageServer
    from tests.observed_platform import start_observed_platform
    from tests.platform_harness import PlatformProcesses

    namespace = f"test:{uuid.uuid4().hex[:12]}:"
    with ImageServer() as origin:
        processes = PlatformProcesses(
            tmp_path_factory.mktemp("observed"),
            demo_model_dir,
            TEST_REDIS_URL,
            namespace,
            {"MEDIA_ALLOWED_HOSTS": "127.0.0.1"},
        )
        try:
            yield start_observed_platform(processes, origin)
        finally:
            processes.close()


@pytest.fixture(scope="session")
def shared_platform(tmp_path_factory: pytest.TempPathFactory, demo_model_dir):
    """One real platform (a worker, a server) for the whole session, for tests that only send it
    requests and leave it as they found it (the fuzzer, the body limit): each test that needs a
    platform of its own settings, or kills a process, starts its own with `platform_processes`.
    """
    from tests.platform_harness import PlatformProcesses

    platform = PlatformProcesses(
        tmp_path_factory.mktemp("shared-platform"),
        demo_model_dir,
        TEST_REDIS_URL,
        f"test:{uuid.uuid4().hex[:12]}:",
        {"MEDIA_ALLOWED_HOSTS": "127.0.0.1", "API_MAX_BODY_MB": "4"},
    )
    try:
        platform.start_worker("shared")
        platform.wait_for_workers("shared")
        platform.start_server()
        yield platform
    finally:
        platform.close()
