"""What a new user meets at the server's root and through the admin's "View site" link."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.django_db


def test_the_root_leads_to_the_admin(client):
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"] == "/admin/"
    assert client.get("/", follow=True).redirect_chain[-1][0].startswith("/admin/login/")


def test_the_admins_view_site_link_opens_a_page(admin_client):
    index = admin_client.get("/admin/").content.decode()
    link = re.search(r'<a href="([^"]+)">View site</a>', index)
    assert link is not None, "the admin's header links to the site"
    target = link.group(1)
    assert target != "/"
    answer = admin_client.get(target)
    assert answer.status_code == 200
    assert "/v1/chat/completions" in answer.content.decode()


def test_the_icon_browsers_ask_every_host_for_is_there(client):
    response = client.get("/favicon.ico", follow=True)
    assert response.status_code == 200
    assert response.redirect_chain[-1][0].endswith("favicon.svg")
