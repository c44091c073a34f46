"""`manage.py routing_stats`: the dashboard's snapshot as a table or as JSON, from a terminal."""

from __future__ import annotations

import io
import json

import pytest
import redis
from django.conf import settings as live_settings
from django.core.management import CommandError, call_command

from routing.deployment import statistics_namespace
from routing.models import Worker
from routing.observe.dashboard import DashboardReader
from tests.test_dashboard import EXPECTED, closed_port, set_up_deployment


@pytest.fixture
def deployment(settings, redis_client: redis.Redis, redis_url: str, key_namespace: str) -> float:
    return set_up_deployment(settings, redis_client, redis_url, key_namespace)


def run_command(*args: str) -> str:
    out = io.StringIO()
    call_command("routing_stats", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_json_output_is_the_dashboards_snapshot(
    deployment: float, redis_client: redis.Redis, key_namespace: str
) -> None:
    # when
    printed = json.loads(run_command("--json", "--minutes", "5"))
    # then: the same as the reader gives the admin, bar the moment it was taken
    direct = DashboardReader(redis_client, key_namespace, statistics_namespace()).snapshot(
        Worker.objects.all(), minutes=5
    )
    assert printed.pop("generated_at") <= direct.pop("generated_at")
    assert printed == json.loads(json.dumps(direct))
    workers = {w["name"]: w for w in printed["workers"]}
    assert workers["gpu0"]["caches"]["kv"]["hit_rate"] == EXPECTED["gpu0"]["kv_hit_rate"]
    assert workers["gpu0"]["series"]["kv"][-3:] == [0.5, None, 1.0]


@pytest.mark.django_db
def test_table_lists_each_worker_with_its_state_load_and_hit_rates(deployment: float) -> None:
    lines = run_command("--minutes", "3").splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("worker"))
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 1 + len(EXPECTED)]}
    assert set(rows) == set(EXPECTED)
    # worker state model device reqs prefill decode blocks kv embed local shared
    assert rows["gpu0"][:8] == ["gpu0", "serving", "demo", "cuda:0", "2", "100", "10", "5/1000"]
    assert rows["gpu0"][8:] == ["75.0%", "50.0%", "-", "100.0%"]
    assert rows["gpu1"][1] == "draining" and rows["gpu1"][8] == "0.0%"
    assert rows["gpu2"][1] == "down"
    assert rows["gpu3"][1] == "unregistered"
    kv_totals = next(line for line in lines if line.startswith("kv ") and "%" in line).split()
    assert kv_totals[:4] == ["kv", "60.0%", "3", "1"]
    assert "kv tokens: 30 cached of 50 prompt tokens" in lines
    # Three minutes, oldest first: half, nothing, all of the prompt tokens of every worker.
    spark = next(line for line in lines if line.startswith("kv") and "|" in line)
    assert spark.split("|")[1] == "▅ ▆"


@pytest.mark.django_db
def test_an_empty_deployment_says_so(settings, redis_url: str, key_namespace: str) -> None:
    settings.REDIS_URL, settings.REDIS_KEY_PREFIX = redis_url, key_namespace
    assert "No worker has registered, beaten or reported yet." in run_command()


@pytest.mark.django_db
def test_minutes_beyond_what_redis_keeps_are_refused(deployment: float) -> None:
    with pytest.raises(CommandError, match="--minutes"):
        run_command("--minutes", "1441")


@pytest.mark.django_db
def test_an_unreachable_redis_is_reported_without_its_password(deployment: float, settings) -> None:
    settings.REDIS_URL = f"redis://default:pw-for-stats@127.0.0.1:{closed_port()}/0"
    with pytest.raises(CommandError) as refused:
        run_command("--json")
    assert "unavailable" in str(refused.value)
    assert "pw-for-stats" not in str(refused.value)


@pytest.mark.django_db
def test_the_all_time_block_is_labelled_and_statuses_are_in_order(deployment: float) -> None:
    from routing.observe.telemetry import MetricsRecorder
    from routing.state.redis_keys import sync_client

    # given: statuses recorded in no particular order
    recorder = MetricsRecorder(sync_client(live_settings.REDIS_URL), statistics_namespace(), source="web:t")
    for status in ("503", "200", "429", "401", "200"):
        recorder.inc("requests", labels={"status": status, "worker": "none", "model": "none"})
    recorder.close()
    # when
    lines = run_command("--minutes", "3").splitlines()
    # then: the totals say they are all-time, and the window's statuses read in code order
    all_time = lines.index("All time (since this deployment's statistics began, or were last reset):")
    assert lines[all_time + 1].startswith("cache")
    requests = next(line for line in lines if line.strip().startswith("requests"))
    assert requests.split(None, 1)[1] == "5 (200: 2, 401: 1, 429: 1, 503: 1)"
    failures = next(line for line in lines if line.strip().startswith("not 200"))
    assert failures.split(None, 2)[2] == "5xx 1 (20.0%), 4xx 1 (20.0%), 429 1 (20.0%)"


@pytest.mark.django_db
def test_with_model_only_that_models_workers_are_listed(deployment: float) -> None:
    # when an operator asks for one model's workers
    printed = json.loads(run_command("--json", "--model", "old-model"))
    # then the others are left out
    assert [w["name"] for w in printed["workers"]] == ["gpu2"]
