"""The operators' live dashboard: the snapshot it reads from Redis, and its staff-only admin pages."""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import time
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from django.test import Client

from inference_platform.admin_dashboard import big_numbers
from routing.contract.kv_events import KvEvent
from routing.deployment import deployment_id, statistics_namespace
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.kv.load import LoadTracker
from routing.models import Worker
from routing.observe.cache_stats import CacheStats
from routing.observe.dashboard import DashboardReader, hit_rate
from routing.observe.telemetry import MetricsRecorder

PASSWORD_IN_URL = "pw-never-shown-7f3c"


@dataclass
class Row:
    """A worker row as the reader sees it, for the tests that need no database."""

    name: str
    enabled: bool = True
    draining: bool = False
    device: str = ""
    model_name: str = ""


# What `populate` writes, per worker: the numbers every view must show back.
EXPECTED: dict[str, dict[str, Any]] = {
    "gpu0": {
        "state": "serving",
        "model": "demo",
        "device": "cuda:0",
        "active_requests": 2,
        "active_prefill_tokens": 100,
        "active_decode_blocks": 10,
        "cached_blocks": 5,
        "capacity_blocks": 1000,
        "kv_hit_rate": 0.75,
        "embedding_hit_rate": 0.5,
    },
    "gpu1": {
        "state": "draining",
        "model": "demo",
        "device": "cuda:1",
        "active_requests": 0,
        "active_prefill_tokens": 0,
        "active_decode_blocks": 0,
        "cached_blocks": 2,
        "capacity_blocks": 500,
        "kv_hit_rate": 0.0,
        "embedding_hit_rate": None,
    },
    "gpu2": {  # a row whose process is gone
        "state": "down",
        "model": "old-model",
        "device": "cuda:2",
        "active_requests": 0,
        "active_prefill_tokens": 0,
        "active_decode_blocks": 0,
        "cached_blocks": 0,
        "capacity_blocks": 0,
        "kv_hit_rate": None,
        "embedding_hit_rate": None,
    },
    "gpu3": {  # a process that beats and counts but that no operator registered
        "state": "unregistered",
        "model": "demo",
        "device": "cpu",
        "active_requests": 0,
        "active_prefill_tokens": 0,
        "active_decode_blocks": 0,
        "cached_blocks": 0,
        "capacity_blocks": 64,
        "kv_hit_rate": None,
        "embedding_hit_rate": None,
    },
}
ROWS = [
    Row("gpu0", device="cuda:0", model_name="demo"),
    Row("gpu1", draining=True, device="cuda:1", model_name="demo"),
    Row("gpu2", enabled=False, device="cuda:2", model_name="old-model"),
]


def populate(client: redis.Redis, namespace: str, *, now: float, statistics: str | None = None) -> None:
    """Write what running workers and frontends would, through the classes they use: live state
    under `namespace`, counters under `statistics` (the deployment's; `namespace` if not given)."""
    counted = namespace if statistics is None else statistics
    registry = WorkerRegistry(client, namespace)
    for name, device, capacity in (("gpu0", "cuda:0", 1000), ("gpu1", "cuda:1", 500), ("gpu3", "cpu", 64)):
        beat = Heartbeat(name, "demo", block_size=16, device=device, kv_capacity_blocks=capacity)
        if name == "gpu0":  # its engine's state, as a batching worker reports it
            beat = dataclasses.replace(
                beat, running=3, waiting=1, max_running=16, kv_blocks_used=40, kv_blocks_free=960
            )
        registry.beat(beat, ttl_s=60)

    index = KvIndex(client, namespace)
    KvEventPublisher(client, namespace, index=index).publish(
        [
            KvEvent("stored", "gpu0", block_hashes=(11, 12, 13, 14, 15)),
            KvEvent("stored", "gpu1", block_hashes=(21, 22, 23)),
            KvEvent("removed", "gpu1", block_hashes=(23,)),
        ]
    )

    load = LoadTracker(client, namespace)
    load.add("gpu0", "r1", prefill_tokens=100, blocks=7)
    load.add("gpu0", "r2", prefill_tokens=50, blocks=3)
    load.prefill_done("gpu0", "r2")
    load.add("gpu1", "r3", prefill_tokens=10, blocks=1)
    load.free("gpu1", "r3")

    # Two minutes ago gpu0 hit half its prompt tokens; this minute three quarters of them.
    earlier = CacheStats(client, counted, "gpu0", clock=lambda: now - 120)
    earlier.incr("kv", "cached_tokens", 10)
    earlier.incr("kv", "prompt_tokens", 20)
    earlier.close()
    gpu0 = CacheStats(client, counted, "gpu0", clock=lambda: now)
    gpu0.incr("kv", "cached_tokens", 20)
    gpu0.incr("kv", "prompt_tokens", 20)
    gpu0.incr("kv", "hits", 3)
    gpu0.incr("kv", "misses", 1)
    gpu0.incr("embedding", "hits", 2)
    gpu0.incr("embedding", "misses", 2)
    gpu0.incr("shared_image", "hits", 1)
    gpu0.incr("shared_image", "bytes", 2048)
    gpu0.incr("shared_image", "errors", 1)
    gpu0.close()
    gpu1 = CacheStats(client, counted, "gpu1", clock=lambda: now)
    gpu1.incr("kv", "prompt_tokens", 10)
    gpu1.incr("local_image", "bypasses", 4)
    gpu1.close()
    gpu3 = CacheStats(client, counted, "gpu3", clock=lambda: now)
    gpu3.incr("shared_image", "bypasses", 1)
    gpu3.close()


def create_rows() -> None:
    for row in ROWS:
        Worker.objects.create(
            name=row.name,
            enabled=row.enabled,
            draining=row.draining,
            device=row.device,
            model_name=row.model_name,
        )


def away_from_a_minute_boundary() -> float:
    """Now, at least 3 s before the next minute, so the views read the minutes the test wrote."""
    seconds_left = 60 - time.time() % 60
    if seconds_left < 3:
        time.sleep(seconds_left + 0.05)
    return time.time()


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_up_deployment(settings, client: redis.Redis, url: str, namespace: str) -> float:
    """The platform's settings pointed at the test namespace, with workers' state written into it."""
    settings.REDIS_URL = url
    settings.REDIS_KEY_PREFIX = namespace
    now = away_from_a_minute_boundary()
    populate(client, namespace, now=now, statistics=statistics_namespace())
    create_rows()
    return now


@pytest.fixture
def deployment(settings, redis_client: redis.Redis, redis_url: str, key_namespace: str) -> float:
    return set_up_deployment(settings, redis_client, redis_url, key_namespace)


@pytest.fixture
def staff_client(django_user_model) -> Client:
    user = django_user_model.objects.create_user("operator", is_staff=True)
    client = Client()
    client.force_login(user)
    return client


def check_worker_entry(entry: dict[str, Any], expected: dict[str, Any]) -> None:
    for key in ("state", "model", "device", "active_requests", "active_prefill_tokens"):
        assert entry[key] == expected[key], key
    for key in ("active_decode_blocks", "cached_blocks", "capacity_blocks"):
        assert entry[key] == expected[key], key
    assert entry["caches"]["kv"]["hit_rate"] == expected["kv_hit_rate"]
    assert entry["caches"]["embedding"]["hit_rate"] == expected["embedding_hit_rate"]


# The snapshot itself (no database: rows are plain objects)


def test_snapshot_shows_every_worker_with_what_it_wrote(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given
    now = time.time()
    populate(redis_client, key_namespace, now=now)
    # when
    snapshot = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=5, now=now)
    # then
    assert [w["name"] for w in snapshot["workers"]] == ["gpu0", "gpu1", "gpu2", "gpu3"]
    for entry in snapshot["workers"]:
        check_worker_entry(entry, EXPECTED[entry["name"]])
    gpu0 = snapshot["workers"][0]
    assert gpu0["live"] and gpu0["enabled"] and not gpu0["draining"] and gpu0["registered"]
    assert gpu0["cache_fill"] == 5 / 1000
    assert gpu0["caches"]["kv"]["cached_tokens"] == 30 and gpu0["caches"]["kv"]["prompt_tokens"] == 40
    assert gpu0["caches"]["shared_image"]["bytes"] == 2048
    assert gpu0["caches"]["shared_image"]["errors"] == 1
    assert not snapshot["workers"][2]["live"]
    assert not snapshot["workers"][3]["registered"] and not snapshot["workers"][3]["enabled"]


def test_snapshot_totals_add_up_the_workers(redis_client: redis.Redis, key_namespace: str) -> None:
    now = time.time()
    populate(redis_client, key_namespace, now=now)
    caches = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=0, now=now)["caches"]
    # 30 of gpu0's 40 prompt tokens and none of gpu1's 10 came from the prefix cache.
    assert caches["kv"]["cached_tokens"] == 30 and caches["kv"]["prompt_tokens"] == 50
    assert caches["kv"]["hit_rate"] == 30 / 50
    assert caches["embedding"]["hit_rate"] == 0.5
    assert caches["local_image"]["bypasses"] == 4
    assert caches["local_image"]["hit_rate"] is None  # bypasses are not lookups
    assert caches["shared_image"]["hit_rate"] == 1.0


def test_series_has_one_point_a_minute_and_gaps_where_nothing_was_looked_up(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    now = time.time()
    populate(redis_client, key_namespace, now=now)
    snapshot = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=4, now=now)
    assert snapshot["series_start"] == (int(now // 60) - 3) * 60
    gpu0, gpu1 = snapshot["workers"][0], snapshot["workers"][1]
    assert gpu0["series"]["kv"] == [None, 0.5, None, 1.0]
    assert gpu1["series"]["kv"] == [None, None, None, 0.0]
    # All workers this minute: 20 cached of 30 prompt tokens.
    assert snapshot["series"]["kv"] == [None, 0.5, None, 20 / 30]
    assert snapshot["series"]["embedding"] == [None, None, None, 0.5]


def test_snapshot_of_a_fresh_deployment_is_empty_not_an_error(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    snapshot = DashboardReader(redis_client, key_namespace).snapshot([], minutes=3)
    assert snapshot["workers"] == []
    assert snapshot["caches"]["kv"]["hit_rate"] is None
    assert snapshot["series"]["kv"] == [None, None, None]


def test_snapshot_without_minutes_reads_no_series(redis_client: redis.Redis, key_namespace: str) -> None:
    populate(redis_client, key_namespace, now=time.time())
    snapshot = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=0)
    assert snapshot["series_start"] is None
    assert all(rates == [] for rates in snapshot["workers"][0]["series"].values())


def test_snapshot_refuses_more_minutes_than_redis_keeps(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    with pytest.raises(ValueError, match="minutes"):
        DashboardReader(redis_client, key_namespace).snapshot([], minutes=24 * 60 + 1)


def test_kv_hit_rate_is_cached_over_prompt_tokens_and_the_others_hits_over_lookups() -> None:
    counts = {"hits": 1, "misses": 3, "bypasses": 9, "cached_tokens": 48, "prompt_tokens": 64}
    assert hit_rate("kv", counts) == 0.75
    assert hit_rate("embedding", counts) == 0.25
    assert hit_rate("local_image", {**counts, "hits": 0, "misses": 0}) is None


def test_load_left_by_a_dead_frontend_leaves_the_dashboard_when_it_expires(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    LoadTracker(redis_client, key_namespace, entry_ttl_s=0.05).add("gpu0", "lost", 100, 4)
    time.sleep(0.1)
    snapshot = DashboardReader(redis_client, key_namespace).snapshot([Row("gpu0")], minutes=0)
    assert snapshot["workers"][0]["active_requests"] == 0


# The admin pages


@pytest.mark.django_db
def test_dashboard_page_sends_anonymous_visitors_to_the_login(deployment: float) -> None:
    for url in ("/admin/dashboard/", "/admin/dashboard.json"):
        response = Client().get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")


@pytest.mark.django_db
def test_dashboard_refuses_a_logged_in_user_who_is_not_staff(deployment: float, django_user_model) -> None:
    client = Client()
    client.force_login(django_user_model.objects.create_user("customer"))
    for url in ("/admin/dashboard/", "/admin/dashboard.json"):
        response = client.get(url)
        assert response.status_code == 302
        assert response["Location"].startswith("/admin/login/")


@pytest.mark.django_db
def test_dashboard_page_shows_each_worker_its_state_and_kv_hit_rate(
    deployment: float, staff_client: Client
) -> None:
    response = staff_client.get("/admin/dashboard/")
    assert response.status_code == 200
    page = response.content.decode()
    for name, expected in EXPECTED.items():
        row = re.search(rf'<tr data-worker="{name}">(.*?)</tr>', page, re.S)
        assert row, name
        cells = [
            re.sub(r"<[^>]+>", "", cell).strip() for cell in re.findall(r"<td[^>]*>(.*?)</td>", row[1], re.S)
        ]
        assert cells[0].split()[0] == name
        assert cells[1] == expected["state"]
        rate = expected["kv_hit_rate"]  # over the window, which holds every minute populate wrote
        assert cells[5] == ("—" if rate is None else f"{rate * 100:.1f}%")
        if name == "gpu0":  # the engine's batch, and its KV pool held by requests, from its heartbeat
            assert cells[2].endswith(" batch 3/16 +1")
            assert cells[3].split() == ["4.0%", "40/1000"]
    # The script starts from the same snapshot the table shows.
    embedded = re.search(
        r'<script id="dashboard-snapshot" type="application/json">(.*?)</script>', page, re.S
    )
    assert embedded and [w["name"] for w in json.loads(embedded[1])["workers"]] == list(EXPECTED)
    assert re.search(r'<script src="/static/dashboard/dashboard.js"', page)
    # whose figures: the deployment whose statistics these are
    assert f"deployment <code>{deployment_id()}</code>" in page
    assert re.search(r'<script src="/static/vendor/uplot/uPlot.iife.min.js"', page)


@pytest.mark.django_db
def test_the_model_filter_keeps_the_page_and_its_data_to_one_models_workers(
    deployment: float, staff_client: Client
) -> None:
    # given workers of two models ("demo": gpu0, gpu1; "old-model": gpu2)
    page = staff_client.get("/admin/dashboard/?minutes=5").content.decode()
    # then the page offers each model, and every model at once
    assert re.search(r'<a href="\?minutes=5&amp;model=old-model" data-model="old-model"', page)
    assert 'data-model="" aria-current="page"' in page
    # when an operator chooses one model
    page = staff_client.get("/admin/dashboard/?minutes=5&model=old-model").content.decode()
    data = staff_client.get("/admin/dashboard.json?minutes=5&model=old-model").json()
    # then the workers table, its per-worker series and the polled data are that model's workers
    assert re.findall(r'<tr data-worker="([^"]+)">', page) == ["gpu2"]
    assert [w["name"] for w in data["workers"]] == ["gpu2"] and data["model"] == "old-model"
    assert "model=old-model" in re.search(r'"dataUrl": "([^"]+)"', page)[1]
    # and the windows keep the choice
    assert '<a href="?minutes=60&amp;model=old-model"' in page


@pytest.mark.django_db
def test_the_page_polls_as_often_as_the_setting_says_up_to_an_hour_and_less_often_beyond(
    deployment: float, staff_client: Client, settings
) -> None:
    from inference_platform.admin_dashboard import poll_interval_ms

    def page_poll_ms(minutes: int) -> int:
        page = staff_client.get(f"/admin/dashboard/?minutes={minutes}").content.decode()
        return int(re.search(r'"pollMs": (\d+)', page)[1])

    # by default every 5 s up to an hour, every 30 s to six hours, then every minute
    assert page_poll_ms(60) == 5000
    assert [poll_interval_ms(m) for m in (5, 60, 360, 1440)] == [5000, 5000, 30_000, 60_000]
    # an operator's interval: for an hour or less, and for longer windows where it is longer
    settings.DASHBOARD_POLL_INTERVAL_SECS = 0.5
    assert page_poll_ms(5) == 500
    assert [poll_interval_ms(m) for m in (5, 60, 360)] == [500, 500, 30_000]
    settings.DASHBOARD_POLL_INTERVAL_SECS = 45
    assert [poll_interval_ms(m) for m in (60, 360, 1440)] == [45_000, 45_000, 60_000]


@pytest.mark.django_db
def test_dashboard_page_loads_nothing_from_outside(deployment: float, staff_client: Client) -> None:
    page = staff_client.get("/admin/dashboard/").content.decode()
    assert not re.search(r'(src|href)="(https?:)?//', page)


@pytest.mark.django_db
def test_dashboard_json_has_the_numbers_the_workers_wrote(deployment: float, staff_client: Client) -> None:
    response = staff_client.get("/admin/dashboard.json?minutes=3")
    assert response.status_code == 200
    snapshot = response.json()
    assert snapshot["minutes"] == 3
    workers = {w["name"]: w for w in snapshot["workers"]}
    assert set(workers) == set(EXPECTED)
    for name, expected in EXPECTED.items():
        check_worker_entry(workers[name], expected)
    assert workers["gpu0"]["series"]["kv"] == [0.5, None, 1.0]
    assert snapshot["caches"]["kv"]["hit_rate"] == 0.6


@pytest.mark.django_db
def test_dashboard_follows_an_operator_draining_a_worker(deployment: float, staff_client: Client) -> None:
    Worker.objects.filter(name="gpu0").update(draining=True)
    gpu0 = staff_client.get("/admin/dashboard.json").json()["workers"][0]
    assert gpu0["name"] == "gpu0" and gpu0["state"] == "draining" and gpu0["draining"]


@pytest.mark.django_db
def test_dashboard_minutes_are_kept_within_what_redis_keeps(deployment: float, staff_client: Client) -> None:
    assert staff_client.get("/admin/dashboard.json?minutes=999999").json()["minutes"] == 24 * 60
    assert staff_client.get("/admin/dashboard.json?minutes=0").json()["minutes"] == 1
    assert staff_client.get("/admin/dashboard.json?minutes=many").json()["minutes"] == 60


@pytest.mark.django_db
def test_dashboard_never_shows_the_redis_password(
    deployment: float, staff_client: Client, settings, redis_url: str
) -> None:
    # given: the same Redis, reached with a password in the URL (its default user takes any)
    settings.REDIS_URL = redis_url.replace("redis://", f"redis://default:{PASSWORD_IN_URL}@", 1)
    # when
    response = staff_client.get("/admin/dashboard/")
    # then: the page works, names the Redis, and keeps the password out
    page = response.content.decode()
    assert response.status_code == 200
    assert 'data-worker="gpu0"' in page
    assert "redis://default:***@127.0.0.1" in page
    assert PASSWORD_IN_URL not in page
    assert PASSWORD_IN_URL not in staff_client.get("/admin/dashboard.json").content.decode()


@pytest.mark.django_db
def test_dashboard_reports_an_unreachable_redis_without_its_password(
    deployment: float, staff_client: Client, settings
) -> None:
    settings.REDIS_URL = f"redis://default:{PASSWORD_IN_URL}@127.0.0.1:{closed_port()}/0"
    page = staff_client.get("/admin/dashboard/")
    data = staff_client.get("/admin/dashboard.json")
    assert page.status_code == 200
    assert "Redis unavailable" in page.content.decode()
    assert data.status_code == 503 and "Redis unavailable" in data.json()["error"]
    assert PASSWORD_IN_URL not in page.content.decode() + data.content.decode()


@pytest.mark.django_db
def test_admin_index_links_to_the_dashboard(staff_client: Client) -> None:
    page = staff_client.get("/admin/").content.decode()
    assert 'href="/admin/dashboard/"' in page
    assert "Site administration" in page  # still the stock index around it


@pytest.mark.django_db
def test_dashboard_flags_workers_that_disagree_on_session_scoping(
    deployment: float, staff_client: Client, redis_client: redis.Redis, key_namespace: str
) -> None:
    # given: gpu0 scoped, gpu1 not, on different shared caches (one URL with a password)
    registry = WorkerRegistry(redis_client, key_namespace)
    registry.beat(
        Heartbeat(
            "gpu0",
            "demo",
            block_size=16,
            session_scoped=True,
            shared_image_cache="redis://u:***@cache:6379/0",
        ),
        ttl_s=60,
    )
    registry.beat(
        Heartbeat("gpu1", "demo", block_size=16, session_scoped=False, shared_image_cache="off"), ttl_s=60
    )
    # when
    page = staff_client.get("/admin/dashboard/").content.decode()
    snapshot = staff_client.get("/admin/dashboard.json").json()
    # then: each worker's configuration is shown, and the mismatch is flagged
    workers = {w["name"]: w for w in snapshot["workers"]}
    assert (workers["gpu0"]["session_scoped"], workers["gpu1"]["session_scoped"]) == (True, False)
    assert snapshot["configuration"]["session_scope_mismatch"]
    assert snapshot["configuration"]["shared_cache_mismatch"]
    assert 'class="errornote config-problem">Session-scoped caches are on for gpu0 but off for gpu1' in page
    row = re.search(r'<tr data-worker="gpu0">(.*?)</tr>', page, re.S)[1]
    assert "scoped" in row and "redis://u:***@cache:6379/0" in row


@pytest.mark.django_db
def test_dashboard_shows_no_problem_when_workers_agree(deployment: float, staff_client: Client) -> None:
    snapshot = staff_client.get("/admin/dashboard.json").json()
    assert snapshot["configuration"] == {
        "session_scope_mismatch": False,
        "shared_cache_mismatch": False,
        "problems": [],
    }


@pytest.mark.django_db
def test_admin_help_texts_are_escaped(admin_client: Client) -> None:
    Worker.objects.create(name="gpu9", device="cpu", model_name="demo")
    page = admin_client.get(
        f"/admin/routing/worker/{Worker.objects.get(name='gpu9').pk}/change/"
    ).content.decode()
    assert "worker.gpu9" in page  # the queue, from the name
    assert "worker.<name>" not in page


def test_window_figures_come_from_the_minutes_of_the_window_only(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given: what frontends recorded now, and a request answered 10 minutes ago
    now = away_from_a_minute_boundary()
    recorder = MetricsRecorder(redis_client, key_namespace, source="web", clock=lambda: now)
    for status, ttft in (("200", 0.02), ("200", 0.02), ("200", 0.3), ("503", None)):
        recorder.inc("requests", labels={"status": status, "worker": "gpu0", "model": "demo"})
        if ttft is not None:
            recorder.observe("ttft_seconds", ttft, labels={"worker": "gpu0", "model": "demo"})
    recorder.inc("prompt_tokens", 90, labels={"worker": "gpu0", "model": "demo"})
    recorder.inc("cached_prompt_tokens", 30, labels={"worker": "gpu0", "model": "demo"})
    recorder.inc("routing_overlap_given_up_blocks", 2, labels={"worker": "gpu0"})
    recorder.inc("routing_best_overlap_blocks", 8, labels={"worker": "gpu0"})
    recorder.close()
    old = MetricsRecorder(redis_client, key_namespace, source="web", clock=lambda: now - 600)
    old.inc("requests", 50, labels={"status": "500", "worker": "gpu0", "model": "demo"})
    old.close()
    # when
    snapshot = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=5, now=now)
    window = snapshot["window"]
    # then
    totals = window["totals"]
    assert (totals["requests"], totals["errors"], totals["by_status"]) == (4, 1, {"200": 3, "503": 1})
    assert totals["prompt_tokens"] == 90 and totals["kv_hit_rate"] == pytest.approx(1 / 3)
    assert 0.01 < totals["ttft"]["p50"] <= 0.025  # two of three first tokens in (10 ms, 25 ms]
    assert 0.25 < totals["ttft"]["p99"] <= 0.5
    assert (totals["overlap_given_up_blocks"], totals["overlap_given_up_share"]) == (2, 0.25)
    assert totals["best_overlap_blocks"] == 8
    shown = {number["key"]: number["value"] for number in big_numbers(snapshot)}
    assert (shown["requests"], shown["server_errors"], shown["overlap_given_up"]) == (
        "4",
        "1 (25.0%)",
        "2 blocks (25.0%)",
    )
    assert totals["requests_per_s"] == pytest.approx(4 / 300)
    assert window["statuses"] == ["200", "503"]
    assert len(window["per_minute"]) == 5 and window["per_minute"][-1]["requests"] == 4
    assert window["minute_starts"][-1] == int(now // 60) * 60


def test_snapshot_shows_the_overlap_the_router_gave_up(redis_client: redis.Redis, key_namespace: str) -> None:
    # given: two decisions recorded by a frontend process: one took the best overlap, one gave up 6
    from inference_platform.serving.dispatch import record_decision
    from routing.kv.decision import RoutingDecision
    from routing.observe import telemetry

    recorder = telemetry.MetricsRecorder(redis_client, key_namespace, source="frontend-test")
    original = telemetry._process_recorder
    telemetry._process_recorder = recorder
    try:
        record_decision(RoutingDecision("gpu0", 10, 12, [], "cost", best_overlap=10))
        record_decision(RoutingDecision("gpu1", 2, 12, [], "affinity", best_overlap=8))
        recorder.flush()
    finally:
        telemetry._process_recorder = original

    # when
    routing = DashboardReader(redis_client, key_namespace).snapshot([], minutes=0)["routing"]

    # then
    assert routing == {
        "decisions": 2,
        "best_overlap_blocks": 18,
        "overlap_given_up_blocks": 6,
        "given_up_fraction": 6 / 18,
    }


def test_the_dashboard_separates_server_errors_from_client_mistakes_and_rate_limits(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given: answers of every kind in one minute: 10 served, 2 failed by the platform, 5 client
    # mistakes (a bad request, a wrong key, not JSON, a client that left) and 3 over a limit
    now = away_from_a_minute_boundary()
    recorder = MetricsRecorder(redis_client, key_namespace, source="web", clock=lambda: now)
    for status, n in (
        ("200", 10),
        ("503", 1),
        ("500", 1),
        ("400", 2),
        ("401", 1),
        ("415", 1),
        ("499", 1),
        ("429", 3),
    ):
        recorder.inc("requests", n, labels={"status": status, "worker": "none", "model": "none"})
    recorder.close()
    # when
    snapshot = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=5, now=now)
    totals = snapshot["window"]["totals"]
    # then: counts and shares per class, statuses in order, and the big numbers say the same
    assert (totals["server_errors"], totals["client_errors"], totals["rate_limited"]) == (2, 5, 3)
    assert totals["server_error_share"] == pytest.approx(2 / 20)
    assert totals["client_error_share"] == pytest.approx(5 / 20)
    assert totals["rate_limited_share"] == pytest.approx(3 / 20)
    assert list(totals["by_status"]) == ["200", "400", "401", "415", "429", "499", "500", "503"]
    assert snapshot["window"]["per_minute"][-1]["server_errors"] == 2
    shown = {number["key"]: number["value"] for number in big_numbers(snapshot)}
    assert (shown["server_errors"], shown["client_errors"], shown["rate_limited"]) == (
        "2 (10.0%)",
        "5 (25.0%)",
        "3 (15.0%)",
    )
    assert "errors" not in shown, "one red 'Errors' figure lumped the client's mistakes with ours"


def test_queue_depth_and_kv_use_over_time_come_from_the_workers_gauge_samples(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given: a worker that reported, over two flushes this minute, 2 then 4 requests waiting and
    # 100 then 300 of 1000 KV blocks held by running requests
    now = away_from_a_minute_boundary()
    # (flushed by hand only: a background flush would take a third sample)
    worker = MetricsRecorder(
        redis_client, key_namespace, source="gpu0", clock=lambda: now, flush_interval=3600
    )
    for waiting, used in ((2, 100), (4, 300)):
        worker.set_gauge("engine_waiting_requests", waiting, labels={"worker": "gpu0"})
        worker.set_gauge("engine_running_requests", 1, labels={"worker": "gpu0"})
        worker.set_gauge("engine_kv_blocks_used", used, labels={"worker": "gpu0"})
        worker.set_gauge("engine_kv_blocks_free", 1000 - used, labels={"worker": "gpu0"})
        worker.flush()
    # when
    window = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=3, now=now)["window"]
    # then: the minute's means, per worker and in all; the minutes before have none
    gpu0 = window["per_worker"]["gpu0"]
    assert gpu0["engine_waiting"][-1] == pytest.approx(3)
    assert gpu0["kv_usage"][-1] == pytest.approx(0.2)
    assert gpu0["engine_waiting"][:2] == [None, None] and gpu0["kv_usage"][:2] == [None, None]
    assert window["per_minute"][-1]["engine_waiting"] == pytest.approx(3)
    assert window["workers"] == ["gpu0"]  # listed for its queue, though it answered nothing yet


def test_latency_and_inter_token_quantiles_are_in_the_window(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    now = away_from_a_minute_boundary()
    recorder = MetricsRecorder(redis_client, key_namespace, source="web", clock=lambda: now)
    for _ in range(10):
        recorder.observe("request_duration_seconds", 0.7, labels={"worker": "gpu0", "model": "demo"})
        recorder.observe("inter_token_seconds", 0.004, labels={"worker": "gpu0"})
    recorder.close()
    snapshot = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=2, now=now)
    totals = snapshot["window"]["totals"]
    assert 0.5 < totals["latency"]["p50"] <= 1.0
    assert 0.0025 < totals["inter_token"]["p50"] <= 0.005
    shown = {number["key"]: number["value"] for number in big_numbers(snapshot)}
    assert shown["latency_p50"].endswith(" ms") and shown["inter_token_p50"].endswith(" ms")
    assert "." in shown["inter_token_p50"], "under 10 ms is shown with a decimal"


def test_the_epd_table_shows_the_embeddings_a_both_worker_holds_not_the_routers_empty_list(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    from routing.fleet.encoders import EncoderPool

    # given: a `both` worker that ran its vision tower and holds 6 embeddings in its own cache
    # (which it lists for no router), and an encode worker whose 2 entries the router lists
    registry = WorkerRegistry(redis_client, key_namespace)
    registry.beat(Heartbeat("gpu0", "demo", block_size=16, role="both"), ttl_s=60)
    registry.beat(Heartbeat("enc0", "demo", block_size=16, role="encode"), ttl_s=60)
    pool = EncoderPool(redis_client, key_namespace)
    pool.count("gpu0", {"tower_forwards": 6})
    pool.count("enc0", {"images": 2, "cache_misses": 2})
    pool.cached("enc0", "-:aa")
    pool.cached("enc0", "-:bb")
    worker = MetricsRecorder(redis_client, key_namespace, source="gpu0")
    worker.set_gauge("embedding_cache_entries", 6, labels={"worker": "gpu0"})
    worker.close()
    # when
    rows = [Row("gpu0"), Row("enc0")]
    section = DashboardReader(redis_client, key_namespace).snapshot(rows, minutes=0)["encoders"]
    # then
    held = {entry["name"]: entry["cached_entries"] for entry in section["workers"]}
    assert held == {"gpu0": 6, "enc0": 2}


def test_the_admission_queue_over_time_comes_from_the_frontends_waits_and_sheds(
    redis_client: redis.Redis, key_namespace: str
) -> None:
    # given: two frontends whose requests waited in the admission queue 30 s and 15 s this minute
    # (one request waiting all the time, and another half of it, on average), and a request shed
    now = away_from_a_minute_boundary()
    labels = {"model": "demo", "priority": "4"}
    for source, waits in (("web:a", (20.0, 10.0)), ("web:b", (0.2, 14.8))):
        frontend = MetricsRecorder(
            redis_client, key_namespace, source=source, clock=lambda: now, flush_interval=3600
        )
        for waited in waits:
            frontend.observe("admission_queue_wait_seconds", waited, labels=labels)
        if source == "web:a":
            frontend.inc("requests_shed", labels={"cause": "queue_timeout"})
        frontend.flush()

    # when
    window = DashboardReader(redis_client, key_namespace).snapshot(ROWS, minutes=3, now=now)["window"]

    # then: the minute's mean depth over both frontends, the waits' quantiles, the shed count
    minute = window["per_minute"][-1]
    assert minute["queued"] == pytest.approx(45 / 60)
    assert minute["queue_wait"]["p50"] <= 10 < minute["queue_wait"]["p90"] <= 30
    assert minute["shed"] == 1 and window["totals"]["shed"] == 1
    assert window["per_minute"][0]["queued"] is None
