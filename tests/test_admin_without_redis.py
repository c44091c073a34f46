"""The admin while Redis is down (fault injection: the URL points at a closed port): pages show a
banner, as the dashboard does, never a 500."""

from __future__ import annotations

import pytest

from routing.models import Worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def redis_down(settings):
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens on port 9


def test_the_worker_list_shows_a_banner_not_a_500_while_redis_is_down(admin_client, redis_down):
    # given a registered worker
    Worker.objects.create(name="gpu0", model_name="demo")
    # when an operator opens the workers' page
    response = admin_client.get("/admin/routing/worker/")
    # then the page is served with the rows, and says the live state is unknown
    assert response.status_code == 200
    page = response.content.decode()
    assert "gpu0" in page
    assert "Redis unavailable" in page and "live state is unknown" in page


def test_the_worker_page_itself_opens_while_redis_is_down(admin_client, redis_down):
    worker = Worker.objects.create(name="gpu1", model_name="demo")
    response = admin_client.get(f"/admin/routing/worker/{worker.pk}/change/")
    assert response.status_code == 200
