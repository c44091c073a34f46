"""The workers' admin: what an operator may change (enabled, draining) and what only the worker
itself says when it registers (its name, role, device, model)."""

from __future__ import annotations

import pytest

from routing.models import Worker

pytestmark = pytest.mark.django_db


def test_renaming_a_worker_in_the_admin_is_impossible(admin_client):
    # given a registered worker
    worker = Worker.objects.create(name="gpu1", model_name="demo", device="cuda:1")
    page = admin_client.get(f"/admin/routing/worker/{worker.pk}/change/").content.decode()
    # then its page offers no name field to edit
    assert 'name="name"' not in page and "gpu1" in page

    # when a form with another name is sent anyway (the page the issue saw had the field)
    response = admin_client.post(
        f"/admin/routing/worker/{worker.pk}/change/",
        {"name": "gpu9", "enabled": "on", "draining": "on", "model_name": "other", "device": "cpu"},
    )

    # then the operator's fields change and the worker's identity does not
    assert response.status_code == 302
    worker.refresh_from_db()
    assert (worker.name, worker.model_name, worker.device) == ("gpu1", "demo", "cuda:1")
    assert worker.draining is True


def test_the_admin_makes_no_worker_rows_registration_does(admin_client):
    listing = admin_client.get("/admin/routing/worker/").content.decode()
    assert "/admin/routing/worker/add/" not in listing
    assert admin_client.get("/admin/routing/worker/add/").status_code == 403
    admin_client.post("/admin/routing/worker/add/", {"name": "gpu9", "enabled": "on"})
    assert not Worker.objects.exists()


def test_a_live_worker_without_session_scoping_reads_not_scoped_without_a_red_cross(admin_client, settings):
    from routing.fleet.registry import Heartbeat, WorkerRegistry
    from routing.state.redis_keys import sync_client

    # given a live worker whose caches are not session-scoped
    Worker.objects.create(name="gpu0", model_name="demo")
    registry = WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    registry.beat(Heartbeat(name="gpu0", model="demo", block_size=16, session_scoped=False), ttl_s=30)
    try:
        page = admin_client.get("/admin/routing/worker/").content.decode()
    finally:
        registry.remove("gpu0")
    # then the list says so in words; only the live state keeps its icon (a green check here)
    assert "not scoped" in page
    assert "icon-no.svg" not in page and "icon-yes.svg" in page
