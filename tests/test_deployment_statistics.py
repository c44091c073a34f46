"""Deployments that share one Redis (and one key prefix) never mix their figures: statistics and
tenant usage are kept under the id of each deployment's database, and `reset_stats` clears one
deployment's statistics only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.management import call_command

from routing.deployment import deployment_id, forget_deployment_id, statistics_namespace
from routing.observe.telemetry import MetricsRecorder
from tests.platform_harness import REPO

# One frontend's life in a few lines, run in a process of its own against the database it is
# given: the tenant "acme" (database id 1 in every fresh database), its usage and request
# metrics counted by the code the frontend counts with, then read back as the admin reads them.
_DEPLOYMENT = """
import json, sys
import django
django.setup()
from django.core.management import call_command
call_command("migrate", interactive=False, verbosity=0)
from inference_platform.admin_dashboard import deployment_snapshot
from inference_platform.serving.clock import RequestClock
from inference_platform.serving.frontend import frontend
from routing.deployment import deployment_id, statistics_namespace
from routing.observe import telemetry
from routing.state.redis_keys import sync_client
from django.conf import settings
from tenants.keys import tenant_caller
from tenants.models import Tenant

failed_requests, answered = json.loads(sys.argv[1])
tenant, _ = Tenant.objects.get_or_create(name="acme")
caller = tenant_caller("acme")
recorder = telemetry.attach(sync_client(settings.REDIS_URL), statistics_namespace(), "web:test")
for _ in range(failed_requests):
    RequestClock().finish(500, None)
for _ in range(answered):
    RequestClock().finish(200, "gpu0")
    frontend().usage().record(caller.usage_id, prompt=10, cached=0, completion=2)
recorder.flush()
window = deployment_snapshot(5)["window"]["totals"]
print(json.dumps({
    "deployment": deployment_id(),
    "tenant_pk": tenant.pk,
    "usage": frontend().usage().totals([caller.usage_id])[caller.usage_id],
    "requests": window["requests"],
    "by_status": window["by_status"],
}))
"""


def run_deployment(
    database: Path, namespace: str, redis_url: str, failed: int, answered: int
) -> dict[str, Any]:
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "inference_platform.settings",
        "DATABASE_URL": f"sqlite:///{database}",
        "REDIS_URL": redis_url,
        "REDIS_KEY_PREFIX": namespace,
    }
    done = subprocess.run(
        [sys.executable, "-c", _DEPLOYMENT, json.dumps([failed, answered])],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_deployments_with_different_databases_on_one_redis_keep_separate_usage_and_statistics(
    tmp_path: Path, redis_url: str, key_namespace: str, redis_client: redis.Redis
) -> None:
    # given: a deployment that answered requests and failed some, on the shared Redis and prefix
    old = run_deployment(tmp_path / "old.sqlite3", key_namespace, redis_url, failed=4, answered=3)
    assert old["usage"]["requests"] == 3 and old["by_status"] == {"500": 4, "200": 3}

    # when: a fresh install (a new database) on the same Redis and prefix serves its first request
    new = run_deployment(tmp_path / "new.sqlite3", key_namespace, redis_url, failed=0, answered=1)

    # then: its tenant #1 (the same database id as the old one's) has only its own usage, and its
    # dashboard shows none of the old errors
    assert new["tenant_pk"] == old["tenant_pk"] == 1
    assert new["deployment"] != old["deployment"]
    assert new["usage"] == {
        "requests": 1, "prompt_tokens": 10, "cached_tokens": 0, "completion_tokens": 2, "refused": 0,
    }  # fmt: skip
    assert (new["requests"], new["by_status"]) == (1, {"200": 1})
    # and the old deployment, still running, kept its own figures
    again = run_deployment(tmp_path / "old.sqlite3", key_namespace, redis_url, failed=0, answered=0)
    assert again["deployment"] == old["deployment"]
    assert again["usage"]["requests"] == 3 and again["by_status"] == {"500": 4, "200": 3}


@pytest.fixture
def this_deployment(settings, redis_url: str, key_namespace: str):
    settings.REDIS_URL, settings.REDIS_KEY_PREFIX = redis_url, key_namespace
    forget_deployment_id()
    yield statistics_namespace()
    forget_deployment_id()


@pytest.mark.django_db
def test_the_deployment_id_is_made_once_and_kept_in_the_database(this_deployment: str) -> None:
    from routing.models import Deployment

    first = deployment_id()
    forget_deployment_id()  # another process of the same deployment reads it from the database
    assert deployment_id() == first == Deployment.objects.get().deployment_id
    assert this_deployment.endswith(f"dep:{first}:")


def record_errors(client: redis.Redis, namespace: str, n: int) -> None:
    recorder = MetricsRecorder(client, namespace, source="web:t")
    recorder.inc("requests", n, labels={"status": "500", "worker": "none", "model": "none"})
    recorder.close()


def run_reset(*args: str) -> str:
    from io import StringIO

    out = StringIO()
    call_command("reset_stats", *args, stdout=out)
    return out.getvalue()


@pytest.mark.django_db
def test_reset_stats_asks_for_yes_before_clearing_anything(
    this_deployment: str, redis_client: redis.Redis
) -> None:
    record_errors(redis_client, this_deployment, 5)
    printed = run_reset()
    assert "--yes" in printed and "Would clear" in printed
    assert redis_client.exists(f"{this_deployment}m:total")


@pytest.mark.django_db
def test_reset_stats_clears_this_deployments_statistics_and_keeps_usage_and_other_deployments(
    this_deployment: str, redis_client: redis.Redis, key_namespace: str
) -> None:
    from tenants.usage import TenantUsage

    # given: this deployment's errors and a tenant's usage, and another deployment's errors
    record_errors(redis_client, this_deployment, 5)
    usage = TenantUsage(redis_client, this_deployment)
    tenant = str(uuid.uuid4())
    usage.record(tenant, prompt=10)
    other = f"{key_namespace}dep:another:"
    record_errors(redis_client, other, 7)
    # when
    printed = run_reset("--yes")
    # then
    assert printed.startswith("Cleared ")
    assert not redis_client.exists(f"{this_deployment}m:total")
    assert usage.totals([tenant])[tenant]["requests"] == 1
    assert redis_client.exists(f"{other}m:total")
    # and --usage clears the usage too
    run_reset("--yes", "--usage")
    assert usage.totals([tenant])[tenant]["requests"] == 0
    assert redis_client.exists(f"{other}m:total")


@pytest.mark.django_db(transaction=True)
async def test_a_request_counts_its_usage_from_the_loop_once_the_deployment_id_is_known():
    import asyncio

    from inference_platform.serving.frontend import frontend
    from routing.deployment import known_statistics_namespace

    # given a process that has not read its deployment id yet
    forget_deployment_id()
    assert known_statistics_namespace() is None

    # when a request's end asks for the usage from the event loop
    first = await frontend().ausage()

    # then the id was read (in a thread: the database may not be read on the loop), and the
    # next ask finds the same usage, under the deployment's statistics namespace, on the loop
    namespace = await asyncio.to_thread(statistics_namespace)
    assert known_statistics_namespace() == namespace
    assert first.key("u") == f"{namespace}usage:u"
    assert await frontend().ausage() is first
