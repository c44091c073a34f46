"""The live routing policy: edited in the admin, in force in every frontend within a second."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth import get_user_model
from django.test import Client

from routing.models import RoutingPolicySettings
from routing.policy import REFRESH_S, current_policy, forget_cached_policy
from tests.platform_harness import REPO

# Committed at once: an admin page's fleet banner reads the fleet, whose refresh works out the live
# policy in a thread of its own (serving.dispatch, `prepare_like`), with a database connection of
# its own, which a save left uncommitted in the test's transaction locks out of the table.
pytestmark = pytest.mark.django_db(transaction=True)


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


def test_the_policy_page_get_leaves_the_database_untouched_and_the_environment_still_applies(
    settings, staff_client
):
    # given no saved policy and an environment that says overlap credit 0.5
    settings.ROUTER_OVERLAP_CREDIT = 0.5
    # when an operator opens the policy page (the list redirects to the one policy's page)
    response = staff_client.get("/admin/routing/routingpolicysettings/")
    assert response.status_code == 302
    assert response["Location"].endswith("/admin/routing/routingpolicysettings/1/change/")
    page = staff_client.get(response["Location"])
    # then it shows the environment's values and says they come from there
    assert page.status_code == 200
    assert page.context["adminform"].form.initial["overlap_credit"] == 0.5
    assert "The environment (ROUTER_MODE" in page.content.decode()
    assert b"reset-policy" not in page.content  # nothing saved: nothing to reset
    # and nothing was written: a later change of the environment still applies
    assert not RoutingPolicySettings.objects.exists() and not LogEntry.objects.exists()
    settings.ROUTER_OVERLAP_CREDIT = 0.75
    forget_cached_policy()
    policy = current_policy()
    assert (policy.source, policy.routing.overlap_credit) == ("environment", 0.75)


POLICY_FORM = {
    "mode": "kv", "overlap_credit": "2.0", "prefill_load_scale": "0.5", "temperature": "0.1",
    "session_affinity": "", "frontend_decoding": "on",
}  # fmt: skip


def test_a_policy_saved_in_the_admin_applies_at_once_and_refuses_negative_values(staff_client):
    assert current_policy().source == "environment"
    response = staff_client.post("/admin/routing/routingpolicysettings/1/change/", POLICY_FORM)
    assert response.status_code == 302
    policy = current_policy()
    assert policy.source == "admin"
    assert (policy.routing.overlap_credit, policy.routing.prefill_load_scale, policy.routing.temperature) == (
        2.0, 0.5, 0.1,
    )  # fmt: skip
    assert policy.session_affinity is False and policy.frontend_decoding is True

    refused = staff_client.post(
        "/admin/routing/routingpolicysettings/1/change/", {**POLICY_FORM, "temperature": "-1"}
    )
    assert refused.status_code == 200  # the form again, with its error
    assert current_policy().routing.temperature == 0.1


def test_the_policy_page_says_who_saved_it_and_a_reset_gives_the_environment_back(settings, staff_client):
    settings.ROUTER_OVERLAP_CREDIT = 0.5
    # given a policy an operator saved
    staff_client.post("/admin/routing/routingpolicysettings/1/change/", POLICY_FORM)
    page = staff_client.get("/admin/routing/routingpolicysettings/1/change/").content.decode()
    assert "Saved by operator at" in page and "overlap_credit 0.5" in page
    assert 'id="reset-policy"' in page
    # a GET of the reset address changes nothing
    assert staff_client.get("/admin/routing/routingpolicysettings/reset/").status_code == 405
    assert current_policy().source == "admin"

    # when the operator resets it
    response = staff_client.post("/admin/routing/routingpolicysettings/reset/")

    # then the environment applies again, and the admin's log says who reset it
    assert response.status_code == 302
    assert not RoutingPolicySettings.objects.exists()
    policy = current_policy()
    assert (policy.source, policy.routing.overlap_credit) == ("environment", 0.5)
    entry = LogEntry.objects.order_by("-action_time").first()
    assert entry.get_change_message() == "Reset to the environment's settings."
    assert entry.user.get_username() == "operator"
    assert "The environment (ROUTER_MODE" in staff_client.get(response["Location"]).content.decode()


def test_a_policy_saved_outside_the_admin_is_not_credited_to_the_last_operator(staff_client):
    # given an operator's save, then another from a shell (no admin log entry)
    staff_client.post("/admin/routing/routingpolicysettings/1/change/", POLICY_FORM)
    RoutingPolicySettings(mode="random").save()
    # then the page says when it was saved, not that the operator saved it
    page = staff_client.get("/admin/routing/routingpolicysettings/1/change/").content.decode()
    assert "Saved at" in page and "Saved by operator" not in page


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
