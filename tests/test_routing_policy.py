"""The live routing policy: edited in the admin, in force in every frontend within a second."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from routing.models import RoutingPolicySettings
from routing.policy import REFRESH_S, current_policy
from tests.platform_harness import REPO

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client() -> Client:
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("operator", password="x"))
    return client


def test_without_a_saved_policy_the_environment_applies(settings):
    settings.ROUTER_TEMPERATURE = 0.25
    settings.ROUTER_MODE = "random"
    policy = current_policy()
    assert (policy.source, policy.mode, policy.routing.temperature) == ("environment", "random", 0.25)


def test_the_admin_opens_the_one_policy_created_from_the_environment(settings, staff_client):
    settings.ROUTER_OVERLAP_CREDIT = 0.5
    response = staff_client.get("/admin/routing/routingpolicysettings/")
    assert response.status_code == 302
    assert response["Location"].endswith("/admin/routing/routingpolicysettings/1/change/")
    assert RoutingPolicySettings.objects.get().overlap_credit == 0.5
    assert staff_client.get(response["Location"]).status_code == 200


def test_a_policy_saved_in_the_admin_applies_at_once_and_refuses_negative_values(staff_client):
    staff_client.get("/admin/routing/routingpolicysettings/")
    assert current_policy().source == "admin"
    form = {
        "mode": "kv", "overlap_credit": "2.0", "prefill_load_scale": "0.5", "temperature": "0.1",
        "session_affinity": "", "frontend_decoding": "on",
    }  # fmt: skip
    response = staff_client.post("/admin/routing/routingpolicysettings/1/change/", form)
    assert response.status_code == 302
    policy = current_policy()
    assert (policy.routing.overlap_credit, policy.routing.prefill_load_scale, policy.routing.temperature) == (
        2.0, 0.5, 0.1,
    )  # fmt: skip
    assert policy.session_affinity is False and policy.frontend_decoding is True

    refused = staff_client.post(
        "/admin/routing/routingpolicysettings/1/change/", {**form, "temperature": "-1"}
    )
    assert refused.status_code == 200  # the form again, with its error
    assert current_policy().routing.temperature == 0.1


def test_an_edit_reaches_a_running_frontend_without_a_restart(pooled_platform):
    platform = pooled_platform()
    base_url = platform.start_server()
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}]}

    def reason() -> str:
        answer = httpx.post(f"{base_url}/v1/route", json=body, headers=platform.headers, timeout=30)
        return answer.json()["choice"]["reason"]

    assert reason() != "round_robin"
    try:
        # Another process (an operator's shell) saves the policy in the shared database.
        operator_shell(platform, "P(mode='round_robin').save()")
        # then the running frontend reads it at its next look (every REFRESH_S)
        deadline = time.monotonic() + REFRESH_S + 10
        while (after := reason()) != "round_robin" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert after == "round_robin"
    finally:
        # the database is the worker pool's: the frontends of later tests read the environment's
        operator_shell(platform, "P.objects.all().delete()")


def operator_shell(platform, statement: str) -> None:
    subprocess.run(
        [sys.executable, "manage.py", "shell", "-c",
         f"from routing.models import RoutingPolicySettings as P; {statement}"],
        cwd=REPO, env=platform.env, check=True, timeout=60,
    )  # fmt: skip
