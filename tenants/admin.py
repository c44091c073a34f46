"""Operators' admin for tenants (limits, cache sharing, usage) and their API keys.

A key's plaintext exists once: on the page that answers its creation, rendered straight from
the request (no message, session or cookie holds it). After that only its prefix is shown.
The add form carries a one-time token (kept in the session; it opens nothing): reloading the page
that showed the key sends the form again, which must not make a second key nobody has seen.
"""

from __future__ import annotations

import secrets

import redis
from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.core.exceptions import ValidationError
from django.template.response import TemplateResponse
from django.utils import timezone

from routing.deployment import statistics_namespace
from routing.state.redis_keys import sync_client
from tenants.keys import hash_key, new_key_parts, revoke_api_key
from tenants.models import ApiKey, Tenant
from tenants.usage import TenantUsage


class ApiKeyInline(admin.TabularInline):
    model = ApiKey
    fields = ("name", "masked", "staff", "created_at", "expires_at", "revoked_at")
    readonly_fields = ("name", "masked", "staff", "created_at", "expires_at", "revoked_at")
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False  # from the API key page, which shows the new key once


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = (
        "name", "share_prefix_cache", "requests_per_minute", "prompt_tokens_per_minute",
        "max_concurrent_requests", "usage_requests", "usage_prompt_tokens", "usage_cached_tokens",
        "usage_completion_tokens", "usage_refused",
    )  # fmt: skip
    list_filter = ("share_prefix_cache",)
    search_fields = ("name",)
    fields = (
        "name", "share_prefix_cache", "requests_per_minute", "prompt_tokens_per_minute",
        "max_concurrent_requests", "usage_requests", "usage_prompt_tokens", "usage_cached_tokens",
        "usage_completion_tokens", "usage_refused", "created_at",
    )  # fmt: skip
    readonly_fields = (
        "usage_requests", "usage_prompt_tokens", "usage_cached_tokens", "usage_completion_tokens",
        "usage_refused", "created_at",
    )  # fmt: skip
    inlines = (ApiKeyInline,)

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
        response = super().changelist_view(request, extra_context)
        tenants = getattr(getattr(response, "context_data", {}).get("cl"), "result_list", None)
        if tenants is not None:
            self._usage_cache = self._read_usage(list(tenants))
        return response

    def change_view(self, request, object_id, form_url="", extra_context=None):
        self._usage_cache = {}
        return super().change_view(request, object_id, form_url, extra_context)

    @admin.display(description="Requests")
    def usage_requests(self, tenant: Tenant) -> int | str:
        return self._usage(tenant).get("requests", "?")

    @admin.display(description="Prompt tokens")
    def usage_prompt_tokens(self, tenant: Tenant) -> int | str:
        return self._usage(tenant).get("prompt_tokens", "?")

    @admin.display(description="Cached tokens")
    def usage_cached_tokens(self, tenant: Tenant) -> int | str:
        return self._usage(tenant).get("cached_tokens", "?")

    @admin.display(description="Completion tokens")
    def usage_completion_tokens(self, tenant: Tenant) -> int | str:
        return self._usage(tenant).get("completion_tokens", "?")

    @admin.display(description="Refused (over a limit)")
    def usage_refused(self, tenant: Tenant) -> int | str:
        return self._usage(tenant).get("refused", "?")


ADD_TOKENS_SESSION_KEY = "tenants-apikey-add-tokens"
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
    list_display = ("name", "tenant", "masked", "staff", "state", "created_at", "expires_at", "revoked_at")
    list_filter = ("staff", "tenant")
    search_fields = ("name", "prefix", "tenant__name")
    actions = ("revoke",)

    def get_fields(self, request, obj=None):
        if obj is None:
            return ("tenant", "name", "staff", "expires_at", "once")
        return ("tenant", "name", "masked", "staff", "state", "created_at", "expires_at", "revoked_at")

    def get_readonly_fields(self, request, obj=None):
        if obj is None:
            return ()
        return ("tenant", "masked", "state", "created_at", "revoked_at")

    @admin.display(description="Key")
    def masked(self, key: ApiKey) -> str:
        return key.masked

    @admin.display(description="State")
    def state(self, key: ApiKey) -> str:
        return key.refusal() or "active"

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
        response = TemplateResponse(
            request,
            "admin/tenants/apikey/created.html",
            {
                **self.admin_site.each_context(request),
                "title": "API key created",
                "key": obj,
                "plaintext": plaintext,
                "opts": self.model._meta,
            },
        )
        response["Cache-Control"] = "no-store"
        return response

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset) -> None:
        revoked = sum(revoke_api_key(key) for key in queryset)
        self.message_user(
            request,
            f"Revoked {revoked} key(s) as of {timezone.now():%Y-%m-%d %H:%M:%S} UTC.",
            messages.SUCCESS,
        )
