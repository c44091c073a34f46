"""Every worker drained: the fleet is live but takes nothing new. A request is told why (naming
the workers) and when to retry, `/ready` says live and accepting apart, the admin and the
dashboard carry a banner, and the workers list says when a drain has finished.

Workers here are heartbeats with no process behind them (fault injection): nothing is sent to
them, as every one is drained.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from django.test import Client

from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.kv.load import LoadTracker
from routing.models import Worker
from routing.state.redis_keys import sync_client

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("served_demo_model")]

NAMES = ("drain-a", "drain-b")


@pytest.fixture
def registry(settings) -> WorkerRegistry:
    return WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)


@pytest.fixture
def drained_fleet(settings, served_demo_model, registry) -> Iterator[list[Worker]]:
    """Two live workers of the served model, both drained by an operator."""
    workers = [
        Worker.objects.create(name=name, model_name=served_demo_model, draining=True) for name in NAMES
    ]
    for name in NAMES:
        beat = Heartbeat(name=name, model=served_demo_model, block_size=settings.KV_BLOCK_SIZE)
        registry.beat(beat, 30)
    yield workers
    for name in NAMES:
        registry.remove(name)


def ask(headers: dict[str, str], model: str):
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    return Client(headers=headers).post(
        "/v1/chat/completions", data=json.dumps(body), content_type="application/json"
    )


def test_all_workers_drained_is_a_503_with_retry_after_naming_the_drained_workers(
    drained_fleet, api_headers, served_demo_model
):
    response = ask(api_headers, served_demo_model)
    assert response.status_code == 503
    assert int(response["Retry-After"]) > 0
    error = response.json()["error"]
    assert error["code"] == "no_worker_accepting"
    assert "drain-a, drain-b draining" in error["message"]
    assert "Enable and stop draining" in error["message"]  # what an operator does about it
    assert response["X-Request-Id"] in error["message"]


def test_ready_says_the_fleet_is_live_but_takes_nothing(drained_fleet):
    response = Client().get("/ready")
    assert response.status_code == 503 and int(response["Retry-After"]) > 0
    ready = response.json()
    assert (ready["live_workers"], ready["accepting_workers"]) == (2, 0)
    assert "none taking new requests" in ready["reason"]
    assert "drain-a" not in json.dumps(ready)  # open to anyone: counts, no names


def test_the_admin_and_the_dashboard_carry_a_banner_while_no_worker_takes_requests(
    drained_fleet, admin_client
):
    for page in ("/admin/", "/admin/routing/worker/", "/admin/dashboard/"):
        shown = admin_client.get(page).content.decode()
        assert 'id="no-worker-accepting"' in shown, page
        assert "drain-a, drain-b draining" in shown
    # when an operator ends one drain, the banner goes
    Worker.objects.filter(name="drain-a").update(draining=False)
    assert 'id="no-worker-accepting"' not in admin_client.get("/admin/").content.decode()


def test_the_workers_list_says_when_a_drain_has_finished(drained_fleet, admin_client, settings, registry):
    # given drain-b still has a request routed to it, and drain-a has none
    tracker = LoadTracker(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    tracker.add("drain-b", "req-1", prefill_tokens=10, blocks=1)
    try:
        listing = admin_client.get("/admin/routing/worker/").content.decode()
    finally:
        tracker.free("drain-b", "req-1")
    # then drain-a may be stopped, and drain-b shows what it still has
    assert row(listing, "drain-a").count("drained, safe to stop") == 1
    assert "drained, safe to stop" not in row(listing, "drain-b")
    assert '<td class="field-in_flight">1</td>' in row(listing, "drain-b")


def row(listing: str, name: str) -> str:
    """The list's table row of one worker."""
    start = listing.index(f">{name}</a>")
    return listing[listing.rindex("<tr", 0, start) : listing.index("</tr>", start)]


def test_a_fleet_shutting_down_is_told_apart_from_one_an_operator_drained():
    from inference_platform.fleet_status import Availability

    stopping = Availability(model="demo", accepting=(), held_back={"shutting down": ("gpu0",)}, live=1)
    assert "gpu0 shutting down" in stopping.reason and "once restarted" in stopping.reason
    assert "Enable and stop draining" not in stopping.reason
    mixed = Availability(
        model="demo",
        accepting=(),
        held_back={"draining": ("gpu0",), "disabled in the admin": ("gpu1",)},
        live=2,
    )
    assert "gpu0 draining; gpu1 disabled in the admin" in mixed.reason
    assert "Enable and stop draining" in mixed.reason
    assert Availability(model="demo", accepting=("gpu0",)).reason == ""
