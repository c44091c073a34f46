"""GET /metrics: Prometheus text exposition of workers' state, load and cache counters."""

from __future__ import annotations

import re

import pytest
import redis
from django.test import Client

from routing.cache_stats import CacheStats
from routing.registry import Heartbeat, WorkerRegistry
from tests.test_dashboard import EXPECTED, closed_port, set_up_deployment

Sample = tuple[str, dict[str, str], float]

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'\s*(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"\s*(?:,|$)')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@pytest.fixture
def deployment(settings, redis_client: redis.Redis, redis_url: str, key_namespace: str) -> float:
    return set_up_deployment(settings, redis_client, redis_url, key_namespace)


def parse_exposition(text: str) -> tuple[list[Sample], dict[str, str], dict[str, str]]:
    """Samples, and the TYPE and HELP of each metric, refusing any line the format does not allow."""
    samples: list[Sample] = []
    types: dict[str, str] = {}
    helps: dict[str, str] = {}
    assert text.endswith("\n"), "the exposition ends with a line feed"
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP ") :].partition(" ")
            assert name not in helps, f"second HELP for {name}"
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            assert kind in {"counter", "gauge", "histogram", "summary", "untyped"}, line
            assert name not in types, f"second TYPE for {name}"
            assert not any(s[0] == name for s in samples), f"TYPE for {name} after its samples"
            types[name] = kind
        else:
            match = _SAMPLE.match(line)
            assert match, f"not a sample line: {line!r}"
            labels: dict[str, str] = {}
            rest = match["labels"] or ""
            while rest:
                label = _LABEL.match(rest)
                assert label, f"bad labels in {line!r}"
                labels[label["key"]] = re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m[0]], label["value"])
                rest = rest[label.end() :]
            samples.append((match["name"], labels, float(match["value"])))
    return samples, types, helps


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [v for n, ls, v in samples if n == name and ls == labels]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.mark.django_db
def test_metrics_parse_as_prometheus_text_with_help_and_type_for_every_metric(deployment: float) -> None:
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    samples, types, helps = parse_exposition(response.content.decode())
    assert samples
    for name, _, _ in samples:
        assert name in types and helps.get(name), f"{name} has no TYPE or HELP"
    assert set(types) == set(helps)
    for name, kind in types.items():
        assert kind == ("counter" if name.endswith("_total") else "gauge"), name


@pytest.mark.django_db
def test_worker_gauges_equal_what_the_workers_wrote(deployment: float) -> None:
    samples, _, _ = parse_exposition(Client().get("/metrics").content.decode())
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
    samples, _, _ = parse_exposition(Client().get("/metrics").content.decode())
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
    counted = CacheStats(redis_client, key_namespace, odd_name)
    counted.incr("kv", "hits")
    counted.close()
    # when
    text = Client().get("/metrics").content.decode()
    # then: the exposition still parses, and gives the values back unchanged
    samples, _, _ = parse_exposition(text)
    assert value(samples, "mmr_worker_info", worker=odd_name, model=odd_model, device="cpu") == 1
    assert value(samples, "mmr_worker_live", worker=odd_name) == 1
    assert value(samples, "mmr_cache_hits_total", worker=odd_name, cache="kv") == 1


@pytest.mark.django_db
def test_metrics_answer_503_when_redis_is_unreachable(deployment: float, settings) -> None:
    settings.REDIS_URL = f"redis://default:pw-for-metrics@127.0.0.1:{closed_port()}/0"
    response = Client().get("/metrics")
    assert response.status_code == 503
    assert "pw-for-metrics" not in response.content.decode()


@pytest.mark.django_db
def test_metrics_refuse_other_methods(deployment: float) -> None:
    assert Client().post("/metrics").status_code == 405
