"""Operators' admin for tenants (limits, cache sharing, usage) and their API keys.

A key's plaintext is shown once. The add form's POST answers with a redirect (POST/redirect/GET)
to the key's "created" page, which takes the plaintext out of the operator's session and forgets
it there as it renders: a reload of that page asks for nothing and shows the key no more. The
session holds it only between the POST and that GET (at most NEW_KEY_TTL_SECS). After that only
its prefix is shown. The add form also carries a one-time token (kept in the session; it opens
nothing): sending the same form again (the browser's "back", then "submit") makes no second key.
"""

from __future__ import annotations

import secrets
import time

import redis
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied, ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.decorators import method_decorator
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.views.decorators.http import require_POST

from routing.deployment import statistics_namespace
from routing.state.redis_keys import sync_client
from tenants.key_use import last_used
from tenants.keys import hash_key, new_key_parts, revoke_api_key
from tenants.models import ApiKey, Tenant
from tenants.usage import TenantUsage


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    fields = ("name", "masked", "kind", "state", "created_at", "expires_at")
    readonly_fields = ("name", "masked", "kind", "state", "created_at", "expires_at")
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # from the API key page, which shows the new key once

    @admin.display(description="Kind")
    def kind(self, key: ApiKey) -> str:
        return key_kind(key)

    @admin.display(description="State")
    def state(self, key: ApiKey) -> str:
        return key.refusal() or "active"


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    # The limits share one column and numbers break only between groups of digits, so every
    # usage column README promises is in sight at 800 px (tests/test_admin_browser.py).
    list_display = (
        "name", "sharing", "limits", "usage_requests", "usage_prompt_tokens", "usage_cached_tokens",
        "usage_completion_tokens", "usage_refused",
    )  # fmt: skip
    list_filter = ("share_prefix_cache",)
    search_fields = ("name",)
    fields = (
        "name", "share_prefix_cache", "requests_per_minute", "prompt_tokens_per_minute",
        "max_concurrent_requests", "allowed_models", "queue_weight", "default_priority",
        "max_priority", "usage_requests", "usage_prompt_tokens", "usage_cached_tokens",
        "usage_completion_tokens", "usage_refused", "created_at",
    )  # fmt: skip
    readonly_fields = (
        "usage_requests", "usage_prompt_tokens", "usage_cached_tokens", "usage_completion_tokens",
        "usage_refused", "created_at",
    )  # fmt: skip
    inlines = (ApiKeyInline,)

    @admin.display(description="Prefix cache", ordering="share_prefix_cache")
    def sharing(self, tenant: Tenant) -> str:
        return "shared" if tenant.share_prefix_cache else "own"

    @admin.display(description="Limits")
    def limits(self, tenant: Tenant) -> str:
        parts = [
            (tenant.requests_per_minute, "requests/min"),
            (tenant.prompt_tokens_per_minute, "prompt tokens/min"),
            (tenant.max_concurrent_requests, "at once"),
        ]
        shown = [format_html("{} {}", counted(value), unit) for value, unit in parts if value is not None]
        return format_html_join(mark_safe("<br>"), "{}", ((part,) for part in shown)) if shown else "none"

    def _usage(self, tenant: Tenant) -> dict[str, int]:
        """The tenant's counters; read for every tenant of a list page at once (changelist_view)."""
        cache = getattr(self, "_usage_cache", None) or {}
        if tenant.pk not in cache:
            cache = {**cache, **self._read_usage([tenant])}
            self._usage_cache = cache
        return cache.get(tenant.pk, {})

    @staticmethod
    def _read_usage(tenants: list[Tenant]) -> dict[int, dict[str, int]]:
        """Counters by tenant pk, read under each tenant's usage id in this deployment's statistics."""
        try:
            usage = TenantUsage(sync_client(settings.REDIS_URL), statistics_namespace())
            totals = usage.totals(str(tenant.usage_id) for tenant in tenants)
        except redis.RedisError:
            return {}  # the page still opens; the counters show "?"
        return {tenant.pk: totals[str(tenant.usage_id)] for tenant in tenants}

    def changelist_view(self, request, extra_context=None):
        self._usage_cache = {}  # counters are read afresh for each page
        # Ten columns need the page's width more than the models' sidebar needs a third of it.
        extra_context = {"is_nav_sidebar_enabled": False, **(extra_context or {})}
        response = super().changelist_view(request, extra_context)
        tenants = getattr(getattr(response, "context_data", {}).get("cl"), "result_list", None)
        if tenants is not None:
            self._usage_cache = self._read_usage(list(tenants))
        return response

    def change_view(self, request, object_id, form_url="", extra_context=None):
        self._usage_cache = {}
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="Requests")
    def usage_requests(self, tenant: Tenant) -> str:
        return counted(self._usage(tenant).get("requests"))

    @admin.display(description="Prompt tokens")
    def usage_prompt_tokens(self, tenant: Tenant) -> str:
        return counted(self._usage(tenant).get("prompt_tokens"))

    @admin.display(description="Cached tokens")
    def usage_cached_tokens(self, tenant: Tenant) -> str:
        return counted(self._usage(tenant).get("cached_tokens"))

    @admin.display(description="Completion tokens")
    def usage_completion_tokens(self, tenant: Tenant) -> str:
        return counted(self._usage(tenant).get("completion_tokens"))

    @admin.display(description="Refused")
    def usage_refused(self, tenant: Tenant) -> str:
        return counted(self._usage(tenant).get("refused"))


ADD_TOKENS_SESSION_KEY = "tenants-apikey-add-tokens"
NEW_KEY_SESSION_KEY = "tenants-apikey-new"  # {key pk: [plaintext, created at (unix)]}, popped once shown
NEW_KEY_TTL_SECS = 300  # a redirect never followed leaves no usable key in the session after this
SENT_ALREADY = (
    "This form was sent already (a reload of the page that showed the new key?): that key exists, "
    "listed under API keys, and cannot be shown again. Open a new form to create another."
)


class ApiKeyAddForm(forms.ModelForm):
    once = forms.CharField(widget=forms.HiddenInput)

    class Meta:
        model = ApiKey
        fields = ("tenant", "name", "staff", "expires_at")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    # What an operator acts on, short enough for 800 px: the revocation's date is on the key's page.
    list_display = ("name", "tenant", "masked", "kind", "state", "last_used", "expires_at")
    list_filter = ("staff", "tenant")
    search_fields = ("name", "prefix", "tenant__name")
    actions = ("revoke",)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("tenant", "name", "staff", "expires_at", "once")
        return (
            "tenant", "name", "masked", "staff", "state", "last_used", "created_at", "expires_at",
            "revoked_at",
        )  # fmt: skip

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        return ("tenant", "masked", "state", "last_used", "created_at", "revoked_at")

    @admin.display(description="Key")
    def masked(self, key: ApiKey) -> str:
        return key.masked

    @admin.display(description="Kind")
    def kind(self, key: ApiKey) -> str:
        return key_kind(key)

    @admin.display(description="State")
    def state(self, key: ApiKey) -> str:
        return key.refusal() or "active"

    @admin.display(description="Last used")
    def last_used(self, key: ApiKey) -> str:
        if not hasattr(key, "_last_used"):  # a key's own page: read it alone
            key._last_used = (last_used([key.prefix]) or {}).get(key.prefix, UNKNOWN)
        used = key._last_used
        if used is UNKNOWN:
            return "unknown (Redis unavailable)"
        return "never" if used is None else f"{used:%Y-%m-%d %H:%M} UTC"

    def changelist_view(self, request, extra_context=None):
        extra_context = {"is_nav_sidebar_enabled": False, **(extra_context or {})}
        response = super().changelist_view(request, extra_context)
        keys = getattr(getattr(response, "context_data", {}).get("cl"), "result_list", None)
        if keys is not None:  # one Redis read for the page, before it renders
            used = last_used(key.prefix for key in keys)
            for key in keys:
                key._last_used = UNKNOWN if used is None else used.get(key.prefix)
        return response

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is not None:
            return super().get_form(request, obj, change=change, **kwargs)
        base = super().get_form(request, obj, change=change, form=ApiKeyAddForm, **kwargs)

        class OnceForm(base):
            def clean(self):
                cleaned = super().clean()
                if cleaned.get("once") not in request.session.get(ADD_TOKENS_SESSION_KEY, []):
                    raise ValidationError(SENT_ALREADY, code="sent_already")
                return cleaned

        return OnceForm

    def get_changeform_initial_data(self, request):
        """A fresh add form (a GET): its one-time token, remembered in the session (the last 20)."""
        token = secrets.token_urlsafe(16)
        request.session[ADD_TOKENS_SESSION_KEY] = [
            *request.session.get(ADD_TOKENS_SESSION_KEY, [])[-19:],
            token,
        ]
        return {**super().get_changeform_initial_data(request), "once": token}

    def save_model(self, request, obj: ApiKey, form, change) -> None:
        if not change:
            tokens = request.session.get(ADD_TOKENS_SESSION_KEY, [])
            request.session[ADD_TOKENS_SESSION_KEY] = [t for t in tokens if t != form.cleaned_data["once"]]
            prefix, plaintext = new_key_parts()
            obj.prefix, obj.hashed_key = prefix, hash_key(plaintext)
            request._new_api_key = plaintext  # for response_add only; never stored
        super().save_model(request, obj, form, change)

    def response_add(self, request, obj: ApiKey, post_url_continue=None):
        plaintext = getattr(request, "_new_api_key", None)
        if plaintext is None:
            return super().response_add(request, obj, post_url_continue)
        request.session[NEW_KEY_SESSION_KEY] = {
            **_fresh_new_keys(request.session.get(NEW_KEY_SESSION_KEY, {})),
            str(obj.pk): [plaintext, time.time()],
        }
        return HttpResponseRedirect(reverse("admin:tenants_apikey_created", args=[obj.pk]))

    def get_urls(self):
        created = path(
            "<int:key_id>/created/",
            self.admin_site.admin_view(self.created_view),
            name="tenants_apikey_created",
        )
        revoke = path(
            "<int:key_id>/revoke/",
            self.admin_site.admin_view(self.revoke_view),
            name="tenants_apikey_revoke",
        )
        return [created, revoke, *super().get_urls()]

    def created_view(self, request: HttpRequest, key_id: int) -> HttpResponse:
        """The new key, once: taken out of the session as the page renders."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        key = get_object_or_404(ApiKey.objects.select_related("tenant"), pk=key_id)
        kept = _fresh_new_keys(request.session.get(NEW_KEY_SESSION_KEY, {}))
        plaintext = (kept.pop(str(key_id), None) or [None])[0]
        request.session[NEW_KEY_SESSION_KEY] = kept
        response = TemplateResponse(
            request,
            "admin/tenants/apikey/created.html",
            {
                **self.admin_site.each_context(request),
                "title": "API key created" if plaintext else "API key shown already",
                "key": key,
                "plaintext": plaintext,
                "opts": self.model._meta,
            },
        )
        response["Cache-Control"] = "no-store"  # the browser's history keeps no copy of the key
        return response

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset) -> None:
        revoked = sum(revoke_api_key(key) for key in queryset)
        self.message_user(
            request,
            f"Revoked {revoked} key(s) as of {timezone.now():%Y-%m-%d %H:%M:%S} UTC.",
            messages.SUCCESS,
        )

    @method_decorator(require_POST)
    def revoke_view(self, request: HttpRequest, key_id: int) -> HttpResponse:
        """The key's page's Revoke button: refused from now on, the row kept (Delete forgets it)."""
        key = get_object_or_404(ApiKey, pk=key_id)
        if not self.has_change_permission(request, key):
            raise PermissionDenied
        if revoke_api_key(key):
            self.log_change(request, key, "Revoked.")
            self.message_user(request, f"Revoked {key.masked} ({key.name}).", messages.SUCCESS)
        else:
            self.message_user(request, f"{key.masked} was revoked already.", messages.WARNING)
        return HttpResponseRedirect(reverse("admin:tenants_apikey_change", args=[key.pk]))


UNKNOWN = object()  # a key's last use when Redis could not say


def key_kind(key: ApiKey) -> str:
    """Staff or not, in words: not being an operator's key is no fault to mark in red."""
    return "operator" if key.staff else "tenant"


def _fresh_new_keys(kept: dict[str, list]) -> dict[str, list]:
    """The new keys still waiting to be shown, without those older than NEW_KEY_TTL_SECS."""
    oldest = time.time() - NEW_KEY_TTL_SECS
    return {pk: entry for pk, entry in kept.items() if entry[1] >= oldest}


def counted(value: int | None) -> str:
    """A count with thousands separators that a narrow column may break after ("?": unknown,
    Redis did not answer), never inside a group of digits."""
    if value is None:
        return "?"
    return mark_safe(f"{value:,}".replace(",", ",<wbr>"))  # digits and commas only
