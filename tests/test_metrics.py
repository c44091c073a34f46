"""GET /metrics: workers' state, cache counters and telemetry, in Prometheus text and OpenMetrics."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings as live_settings
from django.test import Client
from prometheus_client.openmetrics import parser as openmetrics_parser
from prometheus_client.parser import text_string_to_metric_families

from routing.deployment import statistics_namespace
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.observe.cache_stats import CacheStats
from routing.observe.metric_catalog import CATALOG
from routing.observe.telemetry import MetricsRecorder
from routing.state.redis_keys import sync_client
from tests.test_dashboard import EXPECTED, closed_port, set_up_deployment

Sample = tuple[str, dict[str, str], float]

OPENMETRICS = "application/openmetrics-text; version=1.0.0"


METRICS_TOKEN = "metrics-token-of-the-tests"


@pytest.fixture
def deployment(settings, redis_client: redis.Redis, redis_url: str, key_namespace: str) -> float:
    settings.METRICS_TOKEN = METRICS_TOKEN  # what Prometheus would scrape with
    return set_up_deployment(settings, redis_client, redis_url, key_namespace)


def scraper() -> Client:
    return Client(headers={"Authorization": f"Bearer {METRICS_TOKEN}"})


def scrape(accept: str = "") -> tuple[list[Sample], dict[str, Any]]:
    """GET /metrics, parsed by prometheus_client's parser for the format the server chose."""
    response = scraper().get("/metrics", HTTP_ACCEPT=accept) if accept else scraper().get("/metrics")
    assert response.status_code == 200
    text = response.content.decode()
    if response["Content-Type"].startswith("application/openmetrics-text"):
        families = list(openmetrics_parser.text_string_to_metric_families(text))
    else:
        families = list(text_string_to_metric_families(text))
    samples = [(s.name, dict(s.labels), s.value) for family in families for s in family.samples]
    return samples, {family.name: family for family in families}


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [v for n, ls, v in samples if n == name and ls == labels]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.mark.django_db
@pytest.mark.parametrize("accept", ["", "text/plain", OPENMETRICS])
def test_metrics_parse_in_both_formats_with_help_and_type_for_every_metric(
    deployment: float, accept: str
) -> None:
    # given: requests recorded through the telemetry every process uses
    recorder = MetricsRecorder(sync_client(live_settings.REDIS_URL), statistics_namespace(), source="web:t")
    recorder.inc("requests", labels={"status": "200", "worker": "gpu0", "model": "demo"})
    recorder.observe("ttft_seconds", 0.2, labels={"worker": "gpu0", "model": "demo"})
    recorder.close()
    # when: scraped as Prometheus asks (text) and as OpenMetrics scrapers ask
    response = scraper().get("/metrics", HTTP_ACCEPT=accept)
    samples, families = scrape(accept)
    # then: the strict parser accepted it (no "Clashing name"), and each family has help and type
    expected_type = "application/openmetrics-text" if accept == OPENMETRICS else "text/plain; version=0.0.4"
    assert response["Content-Type"].startswith(expected_type)
    assert samples
    for family in families.values():
        assert family.documentation, family.name
        assert family.type in {"counter", "gauge", "histogram"}, family.name
    assert families["mmr_cache_hits"].type == "counter"
    assert families["mmr_ttft_seconds"].type == "histogram"
    assert value(samples, "mmr_requests_total", status="200", worker="gpu0", model="demo") == 1
    assert value(samples, "mmr_ttft_seconds_bucket", worker="gpu0", model="demo", le="0.25") == 1
    assert value(samples, "mmr_ttft_seconds_bucket", worker="gpu0", model="demo", le="0.1") == 0
    for name in CATALOG:
        assert f"mmr_{name}" in families, f"declared metric {name} missing from /metrics"


@pytest.mark.django_db
def test_worker_gauges_equal_what_the_workers_wrote(deployment: float) -> None:
    samples, _ = scrape()
    for worker, expected in EXPECTED.items():
        live = expected["state"] != "down"
        assert value(samples, "mmr_worker_live", worker=worker) == live
        assert value(samples, "mmr_worker_active_requests", worker=worker) == expected["active_requests"]
        assert (
            value(samples, "mmr_worker_active_prefill_tokens", worker=worker)
            == expected["active_prefill_tokens"]
        )
        assert (
            value(samples, "mmr_worker_active_decode_blocks", worker=worker)
            == expected["active_decode_blocks"]
        )
        assert value(samples, "mmr_worker_cached_blocks", worker=worker) == expected["cached_blocks"]
        assert value(samples, "mmr_worker_kv_capacity_blocks", worker=worker) == expected["capacity_blocks"]
        info = {"worker": worker, "model": expected["model"], "device": expected["device"]}
        assert value(samples, "mmr_worker_info", **info) == 1
    assert value(samples, "mmr_worker_enabled", worker="gpu0") == 1
    assert value(samples, "mmr_worker_enabled", worker="gpu2") == 0
    assert value(samples, "mmr_worker_enabled", worker="gpu3") == 0  # no row: nothing is sent to it
    assert value(samples, "mmr_worker_draining", worker="gpu1") == 1
    assert value(samples, "mmr_worker_draining", worker="gpu0") == 0


@pytest.mark.django_db
def test_cache_counters_equal_what_the_workers_counted(deployment: float) -> None:
    samples, _ = scrape()
    assert value(samples, "mmr_kv_cached_tokens_total", worker="gpu0") == 30
    assert value(samples, "mmr_kv_prompt_tokens_total", worker="gpu0") == 40
    assert value(samples, "mmr_kv_prompt_tokens_total", worker="gpu1") == 10
    assert value(samples, "mmr_cache_hits_total", worker="gpu0", cache="kv") == 3
    assert value(samples, "mmr_cache_misses_total", worker="gpu0", cache="kv") == 1
    assert value(samples, "mmr_cache_hits_total", worker="gpu0", cache="embedding") == 2
    assert value(samples, "mmr_cache_misses_total", worker="gpu0", cache="embedding") == 2
    assert value(samples, "mmr_cache_bytes_total", worker="gpu0", cache="shared_image") == 2048
    assert value(samples, "mmr_cache_errors_total", worker="gpu0", cache="shared_image") == 1
    assert value(samples, "mmr_cache_bypasses_total", worker="gpu1", cache="local_image") == 4
    assert value(samples, "mmr_cache_hits_total", worker="gpu2", cache="local_image") == 0
    # One sample per worker and cache: every series exists from the start, as counters should.
    assert len([s for s in samples if s[0] == "mmr_cache_hits_total"]) == len(EXPECTED) * 4


@pytest.mark.django_db
def test_label_values_are_escaped(deployment: float, redis_client: redis.Redis, key_namespace: str) -> None:
    # given: a worker whose name and model hold every character the format must escape
    odd_model = 'say "hi"\nC:\\models'
    odd_name = 'odd"\\name'
    WorkerRegistry(redis_client, key_namespace).beat(Heartbeat(odd_name, odd_model, block_size=16), ttl_s=60)
    counted = CacheStats(redis_client, statistics_namespace(), odd_name)
    counted.incr("kv", "hits")
    counted.close()
    # when
    samples, _ = scrape()
    # then: the exposition still parses, and gives the values back unchanged
    assert value(samples, "mmr_worker_info", worker=odd_name, model=odd_model, device="cpu") == 1
    assert value(samples, "mmr_worker_live", worker=odd_name) == 1
    assert value(samples, "mmr_cache_hits_total", worker=odd_name, cache="kv") == 1


@pytest.mark.django_db
def test_metrics_answer_503_when_redis_is_unreachable(deployment: float, settings) -> None:
    settings.REDIS_URL = f"redis://default:pw-for-metrics@127.0.0.1:{closed_port()}/0"
    response = scraper().get("/metrics")
    assert response.status_code == 503
    assert "pw-for-metrics" not in response.content.decode()


@pytest.mark.django_db
def test_metrics_refuse_other_methods(deployment: float) -> None:
    assert scraper().post("/metrics").status_code == 405


def scraped_from(url: str, headers: dict[str, str]) -> list[Sample]:
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert response.status_code == 200
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    ]


def counted(samples: list[Sample], name: str, **labels: str) -> float:
    return sum(v for n, ls, v in samples if n == name and ls == labels)


@pytest.mark.integration
def test_refusals_at_the_edge_401_and_415_appear_in_metrics(shared_platform) -> None:
    # given: what /metrics said before (the platform is shared by other tests)
    url, chat = shared_platform.base_url, "/v1/chat/completions"
    before = scraped_from(url, shared_platform.headers)
    # when: a client with a wrong key, one with none, one sending a form, and a key guessed on /v1/models
    wrong = {"Authorization": "Bearer sk-00000000.guessedguessedguessedguessedguessed"}
    body = {"model": "x", "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{url}{chat}", json=body, headers=wrong, timeout=30).status_code == 401
    assert httpx.post(f"{url}{chat}", json=body, timeout=30).status_code == 401
    form = httpx.post(f"{url}{chat}", data={"a": "b"}, headers=shared_platform.headers, timeout=30)
    assert form.status_code == 415
    assert httpx.get(f"{url}/v1/models", headers=wrong, timeout=30).status_code == 401
    assert httpx.get(f"{url}/metrics", headers=wrong, timeout=30).status_code == 401

    # then: within a flush, each is counted by route and status, and the chat ones as chat requests
    def added(samples: list[Sample], name: str, **labels: str) -> float:
        return counted(samples, name, **labels) - counted(before, name, **labels)

    expected = {
        ("mmr_http_requests_total", chat, "401"): 2,
        ("mmr_http_requests_total", chat, "415"): 1,
        ("mmr_http_requests_total", "/v1/models", "401"): 1,
        ("mmr_http_requests_total", "/metrics", "401"): 1,
    }
    deadline = time.monotonic() + 15
    while True:
        samples = scraped_from(url, shared_platform.headers)
        seen = {key: added(samples, key[0], handler=key[1], status=key[2]) for key in expected}
        chat_401 = added(samples, "mmr_requests_total", status="401", worker="none", model="none")
        chat_415 = added(samples, "mmr_requests_total", status="415", worker="none", model="none")
        if (seen, chat_401, chat_415) == (expected, 2, 1) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert seen == expected
    assert (chat_401, chat_415) == (2, 1)


@pytest.mark.django_db
def test_the_admission_queue_depth_adds_up_over_frontends_with_its_waits_and_shed_requests(
    deployment: float,
) -> None:
    # given: two frontend processes with requests waiting, waits recorded and a request shed
    labels = {"model": "demo", "tenant": "7", "priority": "4"}
    for source, waiting in (("web:a", 2), ("web:b", 1)):
        recorder = MetricsRecorder(
            sync_client(live_settings.REDIS_URL), statistics_namespace(), source=source
        )
        recorder.set_gauge("admission_queue_depth", waiting, labels=labels)
        recorder.observe("admission_queue_wait_seconds", 1.5, labels={"model": "demo", "priority": "4"})
        recorder.inc("requests_shed", labels={"cause": "queue_timeout"})
        recorder.close()

    # when: scraped
    samples, families = scrape()

    # then: the queue's depth by model, tenant and priority, its wait histogram, shed by cause
    assert families["mmr_admission_queue_depth"].type == "gauge"
    assert value(samples, "mmr_admission_queue_depth", **labels) == 3
    wait = {"model": "demo", "priority": "4"}
    assert value(samples, "mmr_admission_queue_wait_seconds_bucket", **wait, le="2.5") == 2
    assert value(samples, "mmr_admission_queue_wait_seconds_bucket", **wait, le="1.0") == 0
    assert value(samples, "mmr_requests_shed_total", cause="queue_timeout") == 2
