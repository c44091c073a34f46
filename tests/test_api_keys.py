"""API keys: made, stored hashed, checked on every /v1/* call, revoked and expired; operators'
endpoints; the admin and the commands that manage keys. In-process against the real Redis."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import timedelta

import pytest
import redis.asyncio
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from routing.state.redis_direct import AsyncDirectCommands
from tenants.keys import (
    GENERATION_KEY,
    KeyRefused,
    authenticate,
    averified_caller,
    create_api_key,
    hash_key,
    revoke_api_key,
    verified_keys,
)
from tenants.models import ApiKey, Tenant

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("served_demo_model")]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_openai_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content
    body = json.loads(response.content)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    return body["error"]


def test_it_stores_only_the_hash_and_a_prefix():
    tenant = Tenant.objects.create(name="acme")
    key, plaintext = create_api_key(tenant, "ci")
    stored = ApiKey.objects.get(pk=key.pk)
    assert plaintext.startswith(f"sk-{stored.prefix}.")
    assert stored.hashed_key == hash_key(plaintext) != plaintext
    row = json.dumps(list(ApiKey.objects.values()), default=str)
    assert plaintext not in row and plaintext.split(".", 1)[1] not in row
    assert stored.masked == f"sk-{stored.prefix}.…"
    assert authenticate(plaintext).tenant_name == "acme"


@pytest.mark.parametrize(
    "presented", ["", "sk-anything", "Bearer", "sk-0123abcd.wrongwrongwrongwrongwrongwrongwrong12"]
)
def test_it_refuses_keys_that_open_nothing(presented):
    with pytest.raises(KeyRefused):
        authenticate(presented)


def test_it_refuses_a_right_prefix_with_a_wrong_secret():
    tenant = Tenant.objects.create(name="acme")
    key, _plaintext = create_api_key(tenant, "ci")
    forged = f"sk-{key.prefix}.{'x' * 43}"
    with pytest.raises(KeyRefused):
        authenticate(forged)


def test_it_answers_401_without_a_key_or_with_a_bad_one(served_demo_model):
    body = json.dumps({"model": served_demo_model, "messages": [{"role": "user", "content": "hi"}]})
    for headers in ({}, bearer("sk-anything"), {"Authorization": "Basic Zm9vOmJhcg=="}):
        response = Client(headers=headers).post(
            "/v1/chat/completions", data=body, content_type="application/json"
        )
        error = assert_openai_error(
            response, 401, "missing_api_key" if not headers or "Basic" in str(headers) else "invalid_api_key"
        )
        assert error["type"] == "authentication_error"
        assert response["WWW-Authenticate"].startswith("Bearer")
    for path in ("/v1/models", f"/v1/models/{served_demo_model}"):
        assert (Client(headers={}).get(path)).status_code == 401


def test_a_key_sent_without_bearer_is_told_the_header_must_be_bearer_key(make_api_key, served_demo_model):
    key = make_api_key()
    response = Client(headers={"Authorization": key}).get("/v1/models")
    error = assert_openai_error(response, 401, "missing_api_key")
    assert "must be 'Bearer <key>'" in error["message"]
    assert "didn't provide" not in error["message"]
    assert key not in error["message"]


def test_revoked_and_expired_keys_are_refused_and_say_why(make_api_key, served_demo_model):
    revoked, expired = make_api_key("acme"), make_api_key("acme")
    assert (Client(headers=bearer(revoked)).get("/v1/models")).status_code == 200
    call_command("api_keys", "revoke", revoked.split(".")[0])
    prefix = expired.split(".")[0].removeprefix("sk-")
    ApiKey.objects.filter(prefix=prefix).update(expires_at=timezone.now() - timedelta(seconds=1))
    for key, why in ((revoked, "revoked"), (expired, "expired")):
        response = Client(headers=bearer(key)).get("/v1/models")
        error = assert_openai_error(response, 401, "invalid_api_key")
        assert why in error["message"]
        assert key not in error["message"]


def test_operator_endpoints_refuse_a_tenant_key_and_take_a_staff_key_or_the_metrics_token(
    make_api_key, settings, served_demo_model
):
    settings.METRICS_TOKEN = "scrape-me"
    tenant, staff = bearer(make_api_key("acme")), bearer(make_api_key("ops", staff=True))
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    for _ in range(2):  # checked in the database, then known on the event loop: refused both times
        route = Client(headers=tenant).post("/v1/route", data=body, content_type="application/json")
        assert_openai_error(route, 403, "operator_only")
    route = Client(headers=staff).post("/v1/route", data=body, content_type="application/json")
    assert route.status_code == 200
    assert Client(headers=tenant).get("/metrics").status_code == 403
    assert Client().get("/metrics").status_code == 401
    assert Client(headers=bearer("scrape-me")).get("/metrics").status_code == 200
    assert Client(headers=staff).get("/metrics").status_code == 200
    assert Client(headers=bearer("scrape-me-not")).get("/metrics").status_code == 401


def test_with_authentication_off_anyone_is_served_and_the_admin_says_so(
    settings, served_demo_model, admin_client
):
    settings.API_AUTH_REQUIRED = False
    assert (Client(headers={}).get("/v1/models")).status_code == 200
    # a presented key that is wrong is still refused: a typo must not go unnoticed
    assert (Client(headers=bearer("sk-typo")).get("/v1/models")).status_code == 401


def test_the_admin_warns_loudly_while_authentication_is_off(settings, admin_client):
    settings.API_AUTH_REQUIRED = False
    assert b"API authentication is OFF" in admin_client.get("/admin/").content
    settings.API_AUTH_REQUIRED = True
    assert b"API authentication is OFF" not in admin_client.get("/admin/").content


def add_key_form(admin_client, **fields) -> dict:
    """The admin's add form as a browser fills it in: its one-time token from the page it GETs."""
    page = admin_client.get("/admin/tenants/apikey/add/").content.decode()
    once = re.search(r'name="once" value="([^"]+)"', page)
    assert once is not None, "the add form carries a one-time token"
    return {"expires_at_0": "", "expires_at_1": "", **fields, "once": once.group(1)}


def test_the_admin_shows_a_new_key_once_and_only_its_prefix_after(admin_client):
    tenant = Tenant.objects.create(name="acme")
    response = admin_client.post(
        "/admin/tenants/apikey/add/", add_key_form(admin_client, tenant=tenant.pk, name="laptop")
    )
    key = ApiKey.objects.get(name="laptop")
    # the POST answers with a redirect (POST/redirect/GET), and the key is on the page it names
    assert response.status_code == 302, response.content[:2000]
    assert response["Location"] == f"/admin/tenants/apikey/{key.pk}/created/"
    assert b"sk-" not in response.content
    shown = admin_client.get(response["Location"])
    assert shown.status_code == 200 and "no-store" in shown["Cache-Control"]
    page = shown.content.decode()
    start = page.index(f"sk-{key.prefix}.")
    plaintext = page[start : page.index("<", start)]
    assert authenticate(plaintext).tenant_name == "acme"
    assert 'id="copy-api-key"' in page
    for url in (
        "/admin/tenants/apikey/",
        f"/admin/tenants/apikey/{key.pk}/change/",
        f"/admin/tenants/tenant/{tenant.pk}/change/",
        "/admin/tenants/tenant/",
    ):
        shown = admin_client.get(url)
        assert shown.status_code == 200
        assert plaintext not in shown.content.decode()
        assert plaintext.split(".", 1)[1] not in shown.content.decode()
    assert key.masked in admin_client.get("/admin/tenants/apikey/").content.decode()


def test_reloading_the_page_that_showed_a_new_key_makes_no_second_key_and_shows_it_no_more(admin_client):
    tenant = Tenant.objects.create(name="acme")
    form = add_key_form(admin_client, tenant=tenant.pk, name="laptop")
    created = admin_client.post("/admin/tenants/apikey/add/", form)
    first = admin_client.get(created["Location"])
    assert b"shown only this once" in first.content
    secret = re.search(r'id="new-api-key">sk-[0-9a-f]{8}\.([^<]+)<', first.content.decode())[1]

    # a reload asks for the same page again: no key is made, and the secret is gone
    again = admin_client.get(created["Location"])
    assert again.status_code == 200 and b"shown once already" in again.content
    assert secret not in again.content.decode()
    assert ApiKey.objects.filter(name="laptop").count() == 1
    session = admin_client.session.get("tenants-apikey-new", {})
    assert session == {}, "the session forgot the key once it was shown"

    # the same form sent again (back, then submit) makes nothing either; a fresh one makes the next key
    resent = admin_client.post("/admin/tenants/apikey/add/", form)
    assert resent.status_code == 200 and b"This form was sent already" in resent.content
    forged = admin_client.post("/admin/tenants/apikey/add/", {**form, "once": "made-up"})
    assert b"This form was sent already" in forged.content
    fresh = admin_client.post(
        "/admin/tenants/apikey/add/", add_key_form(admin_client, tenant=tenant.pk, name="laptop")
    )
    assert b"shown only this once" in admin_client.get(fresh["Location"]).content
    assert ApiKey.objects.filter(name="laptop").count() == 2


def test_a_new_key_the_operator_never_came_to_see_leaves_the_session(admin_client, monkeypatch):
    import time

    tenant = Tenant.objects.create(name="acme")
    created = admin_client.post(
        "/admin/tenants/apikey/add/", add_key_form(admin_client, tenant=tenant.pk, name="laptop")
    )
    later = time.time() + 301
    monkeypatch.setattr(time, "time", lambda: later)
    page = admin_client.get(created["Location"])
    assert b"shown once already" in page.content and b"shown only this once" not in page.content


def test_a_key_verified_once_is_answered_without_the_database(django_assert_num_queries):
    tenant = Tenant.objects.create(name="acme")
    _key, plaintext = create_api_key(tenant, "ci")
    with django_assert_num_queries(1):
        first = authenticate(plaintext)
    with django_assert_num_queries(0):
        again = authenticate(f"  {plaintext} ")
    assert again == first and again.tenant_name == "acme"
    assert plaintext not in repr(verified_keys().__dict__)  # kept by its hash, never the key


def test_an_event_loop_knows_a_key_verified_lately_and_leaves_anything_else_to_the_database(settings):
    # given a key, and a frontend's event loop asking on its own connections
    tenant = Tenant.objects.create(name="acme")
    key, plaintext = create_api_key(tenant, "ci")

    def known(presented: str):
        async def ask():
            lines = AsyncDirectCommands(redis.asyncio.ConnectionPool.from_url(settings.REDIS_URL))
            try:
                return await averified_caller(presented, lines)
            finally:
                await lines.close()

        return asyncio.run(ask())

    # then a key not verified yet, or not a key at all, is left to `authenticate`
    assert known(plaintext) is None and known("sk-not-a-key") is None
    # when it is verified once, then the loop knows it as `authenticate` does, spaces and all
    caller = authenticate(plaintext)
    assert known(f" {plaintext} ") == caller
    # and a wrong secret never passes for it
    assert known(f"sk-{key.prefix}.{'x' * 43}") is None
    # and once it is revoked (the generation moved), the loop knows it no more
    assert revoke_api_key(key)
    assert known(plaintext) is None
    with pytest.raises(KeyRefused, match="revoked"):
        authenticate(plaintext)


def test_a_wrong_secret_is_never_answered_from_what_was_verified(django_assert_num_queries):
    tenant = Tenant.objects.create(name="acme")
    key, plaintext = create_api_key(tenant, "ci")
    authenticate(plaintext)
    forged = f"sk-{key.prefix}.{'x' * 43}"
    for _ in range(2):  # refusals are not kept: each costs its query
        with django_assert_num_queries(1), pytest.raises(KeyRefused):
            authenticate(forged)


def test_a_revoked_key_is_refused_at_its_next_use(django_assert_num_queries):
    tenant = Tenant.objects.create(name="acme")
    key, plaintext = create_api_key(tenant, "ci")
    authenticate(plaintext)
    assert revoke_api_key(key)
    with pytest.raises(KeyRefused, match="revoked"):
        authenticate(plaintext)


def test_a_change_another_process_made_is_seen_through_redis(settings, django_assert_num_queries):
    """Another process changed the tenant's limit: its row changed, and the generation in Redis
    moved (what `keys_changed` does there); this process has only Redis to learn it from."""
    from routing.state.redis_keys import sync_client

    tenant = Tenant.objects.create(name="acme", requests_per_minute=10)
    _key, plaintext = create_api_key(tenant, "ci")
    assert authenticate(plaintext).requests_per_minute == 10
    Tenant.objects.filter(pk=tenant.pk).update(requests_per_minute=99)  # no signal: another process
    with django_assert_num_queries(0):
        assert authenticate(plaintext).requests_per_minute == 10  # nothing said it changed
    sync_client(settings.REDIS_URL).set(f"{settings.REDIS_KEY_PREFIX}{GENERATION_KEY}", "another")
    with django_assert_num_queries(1):
        assert authenticate(plaintext).requests_per_minute == 99


def test_a_redis_restarted_empty_never_vouches_for_keys_kept_before(settings, django_assert_num_queries):
    """A generation counted from nothing again would repeat one keys were kept under: a key
    revoked elsewhere, announced, then Redis losing its data, would pass again."""
    from routing.state.redis_keys import sync_client

    client = sync_client(settings.REDIS_URL)
    generation = f"{settings.REDIS_KEY_PREFIX}{GENERATION_KEY}"
    client.delete(generation)
    tenant = Tenant.objects.create(name="acme")
    key, plaintext = create_api_key(tenant, "ci")
    client.delete(generation)  # the key's creation announced a change: start from an empty Redis
    authenticate(plaintext)  # verified, and kept under the generation an empty Redis gave
    # another process revokes it (no signal here) and announces it; then Redis loses its data
    ApiKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())
    client.set(generation, "after-the-revocation")
    client.delete(generation)
    with django_assert_num_queries(1), pytest.raises(KeyRefused):
        authenticate(plaintext)


def test_a_change_is_announced_to_other_frontends_once_committed(settings):
    """Announced inside the transaction, another frontend could read the old row again and keep
    it under the new generation."""
    from django.db import transaction

    from routing.state.redis_keys import sync_client

    generation = f"{settings.REDIS_KEY_PREFIX}{GENERATION_KEY}"
    client = sync_client(settings.REDIS_URL)
    tenant = Tenant.objects.create(name="acme")
    before = client.get(generation)
    with transaction.atomic():
        tenant.requests_per_minute = 5
        tenant.save()
        assert client.get(generation) == before
    assert client.get(generation) not in (None, before)


def test_a_tenant_edited_in_this_process_is_seen_at_once():
    tenant = Tenant.objects.create(name="acme", max_concurrent_requests=2)
    _key, plaintext = create_api_key(tenant, "ci")
    assert authenticate(plaintext).max_concurrent_requests == 2
    tenant.max_concurrent_requests = 5
    tenant.save()
    assert authenticate(plaintext).max_concurrent_requests == 5
    tenant.delete()
    with pytest.raises(KeyRefused):
        authenticate(plaintext)


def test_a_kept_key_still_expires_on_time(monkeypatch):
    tenant = Tenant.objects.create(name="acme")
    expires_at = timezone.now() + timedelta(minutes=5)
    _key, plaintext = create_api_key(tenant, "ci", expires_at=expires_at)
    authenticate(plaintext)
    monkeypatch.setattr(timezone, "now", lambda: expires_at + timedelta(seconds=1))
    with pytest.raises(KeyRefused, match="expired"):
        authenticate(plaintext)


def test_a_kept_key_is_asked_again_after_api_key_cache_secs(settings, monkeypatch, django_assert_num_queries):
    import time

    settings.API_KEY_CACHE_SECS = 30.0
    tenant = Tenant.objects.create(name="acme")
    _key, plaintext = create_api_key(tenant, "ci")
    now = time.monotonic()
    monkeypatch.setattr(time, "monotonic", lambda: now)
    authenticate(plaintext)
    monkeypatch.setattr(time, "monotonic", lambda: now + 29)
    with django_assert_num_queries(0):
        authenticate(plaintext)
    monkeypatch.setattr(time, "monotonic", lambda: now + 31)
    with django_assert_num_queries(1):
        authenticate(plaintext)


@pytest.mark.parametrize("setting", ["off", "no_redis"])
def test_without_the_cache_or_without_redis_every_use_asks_the_database(
    setting, settings, django_assert_num_queries
):
    if setting == "off":
        settings.API_KEY_CACHE_SECS = 0
    else:  # nothing listens there: nothing could say that a key changed
        settings.REDIS_URL = "redis://127.0.0.1:1/0"
    tenant = Tenant.objects.create(name="acme")
    _key, plaintext = create_api_key(tenant, "ci")
    for _ in range(2):
        with django_assert_num_queries(1):
            assert authenticate(plaintext).tenant_name == "acme"


def test_after_redis_failed_the_next_key_checks_ask_the_database_without_waiting_on_redis(
    settings, monkeypatch, redis_url
):
    from tenants import keys

    # given: a Redis that refuses, and no failure remembered from before
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    monkeypatch.setattr(keys, "_generation_failed", ("", float("-inf")))
    tenant = Tenant.objects.create(name="acme")
    _key, plaintext = create_api_key(tenant, "ci")
    asked: list[str] = []
    real_read = keys.read_generation
    monkeypatch.setattr(keys, "read_generation", lambda *args: (asked.append("redis"), real_read(*args))[1])
    # when: two key checks in a row
    callers = [authenticate(plaintext) for _ in range(2)]
    # then: both are answered by the database, and only the first waited on Redis
    assert [caller.tenant_name for caller in callers] == ["acme", "acme"]
    assert asked == ["redis"]
    # and: another Redis is asked at once
    settings.REDIS_URL = redis_url
    authenticate(plaintext)
    assert asked == ["redis", "redis"]


def test_the_admin_revokes_keys(admin_client):
    tenant = Tenant.objects.create(name="acme")
    key, plaintext = create_api_key(tenant, "old")
    admin_client.post("/admin/tenants/apikey/", {"action": "revoke", "_selected_action": [key.pk]})
    with pytest.raises(KeyRefused, match="revoked"):
        authenticate(plaintext)


def test_the_api_keys_command_creates_lists_and_revokes(capsys):
    call_command(
        "api_keys", "create", "--tenant", "acme", "--create-tenant", "--name", "ci", "--expires-in-days", "30"
    )
    printed = capsys.readouterr().out
    plaintext = printed.strip().splitlines()[-1]
    caller = authenticate(plaintext)
    assert caller.tenant_name == "acme" and not caller.staff
    call_command("api_keys", "list")
    listed = capsys.readouterr().out
    assert "acme" in listed and "active" in listed and plaintext not in listed
    call_command("api_keys", "revoke", plaintext.split(".")[0] + ".…")
    assert "Revoked" in capsys.readouterr().out
    call_command("api_keys", "list", "--tenant", "acme")
    assert "revoked" in capsys.readouterr().out


def test_a_misspelt_tenant_is_refused_with_the_tenants_there_are_not_created(capsys):
    # given one tenant
    Tenant.objects.create(name="acme", requests_per_minute=60)
    # when a key is asked for a tenant nobody made (a typo)
    with pytest.raises(CommandError) as refused:
        call_command("api_keys", "create", "--tenant", "acmee", "--name", "ci")
    # then nothing is made, and the message lists the tenants and says how to create one
    assert "acme" in str(refused.value) and "--create-tenant" in str(refused.value)
    assert list(Tenant.objects.values_list("name", flat=True)) == ["acme"]
    assert not ApiKey.objects.exists()
    # and the existing tenant still takes a key without the flag
    call_command("api_keys", "create", "--tenant", "acme", "--name", "ci")
    assert authenticate(capsys.readouterr().out.strip().splitlines()[-1]).requests_per_minute == 60


def test_ensure_demo_key_prints_a_key_once(capsys):
    call_command("ensure_demo_key")
    plaintext = capsys.readouterr().out.strip().rsplit(" ", 1)[-1]
    assert authenticate(plaintext).tenant_name == "demo"
    call_command("ensure_demo_key")
    again = capsys.readouterr().out
    assert "exists already" in again and plaintext not in again
    assert ApiKey.objects.filter(tenant__name="demo").count() == 1


def test_the_tenant_list_shows_each_tenants_usage_and_sharing(admin_client, settings):
    from routing.deployment import statistics_namespace
    from routing.state.redis_keys import sync_client
    from tenants.usage import TenantUsage

    # given two tenants, one sharing its cache, and usage the frontends counted in Redis
    busy = Tenant.objects.create(name="busy-tenant", share_prefix_cache=True, requests_per_minute=60)
    Tenant.objects.create(name="idle-tenant")
    usage = TenantUsage(sync_client(settings.REDIS_URL), statistics_namespace())
    usage.record(str(busy.usage_id), prompt=1234, cached=987, completion=55)
    try:
        # when an operator opens the tenant list and the tenant's page
        listing = admin_client.get("/admin/tenants/tenant/").content.decode()
        page = admin_client.get(f"/admin/tenants/tenant/{busy.pk}/change/").content.decode()
    finally:
        sync_client(settings.REDIS_URL).delete(usage.key(str(busy.usage_id)))

    # then both show the counters, and the list shows who shares
    for shown in (listing, page):
        assert "1,<wbr>234" in shown and "987" in shown and "55" in shown
    assert "Cached tokens" in listing and "Prefix cache" in listing and "shared" in listing


def test_a_keys_page_revokes_it_and_shows_when_it_was_last_used(admin_client):
    from django.contrib.admin.models import LogEntry

    from tenants.key_use import forget_recorded_uses

    # given a key that was never used, and one that opened a request
    tenant = Tenant.objects.create(name="acme")
    idle, _ = create_api_key(tenant, "idle")
    used, plaintext = create_api_key(tenant, "used")
    forget_recorded_uses()
    authenticate(plaintext)
    # then the list and each key's page say when each was last used
    listing = admin_client.get("/admin/tenants/apikey/").content.decode()
    assert "Last used" in listing and "never" in listing
    assert (
        f"{timezone.now():%Y-%m-%d}"
        in admin_client.get(f"/admin/tenants/apikey/{used.pk}/change/").content.decode()
    )
    page = admin_client.get(f"/admin/tenants/apikey/{idle.pk}/change/").content.decode()
    assert "never" in page and 'id="revoke-key"' in page

    # when the operator presses Revoke on the key's page (a GET of its address does nothing)
    assert admin_client.get(f"/admin/tenants/apikey/{used.pk}/revoke/").status_code == 405
    response = admin_client.post(f"/admin/tenants/apikey/{used.pk}/revoke/")

    # then the key is refused from now on, kept in the list, and the history says who revoked it
    assert response.status_code == 302
    with pytest.raises(KeyRefused, match="revoked"):
        authenticate(plaintext)
    assert ApiKey.objects.filter(pk=used.pk).exists()
    assert LogEntry.objects.get(object_id=str(used.pk)).get_change_message() == "Revoked."
    assert 'id="revoke-key"' not in admin_client.get(response["Location"]).content.decode()


def test_not_being_staff_or_sharing_is_written_in_words_not_a_red_cross(admin_client):
    tenant = Tenant.objects.create(name="acme")
    key, _ = create_api_key(tenant, "ci")
    for url in (
        "/admin/tenants/apikey/",
        f"/admin/tenants/apikey/{key.pk}/change/",
        "/admin/tenants/tenant/",
        f"/admin/tenants/tenant/{tenant.pk}/change/",
    ):
        page = admin_client.get(url).content.decode()
        assert "icon-no.svg" not in page, url
    assert "tenant" in admin_client.get("/admin/tenants/apikey/").content.decode()
    assert ">own<" in admin_client.get("/admin/tenants/tenant/").content.decode()
