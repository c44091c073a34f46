"""Operators' admin: workers (live state from the heartbeat beside the row they edit) and the
live routing policy."""

from __future__ import annotations

import redis
from django.conf import settings
from django.contrib import admin, messages
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.html import escape

from routing.fleet.registry import WorkerRegistry
from routing.models import RoutingPolicySettings, Worker
from routing.state.redis_keys import redact_text, sync_client


class EscapedHelpTexts:
    """The admin renders a field's help text as HTML: escape it, so `worker.<name>` reads as written."""

    def formfield_for_dbfield(self, db_field, request, **kwargs):
        formfield = super().formfield_for_dbfield(db_field, request, **kwargs)
        if formfield is not None and formfield.help_text:
            formfield.help_text = escape(formfield.help_text)
        return formfield


@admin.register(Worker)
class WorkerAdmin(EscapedHelpTexts, admin.ModelAdmin):
    # Fits 1,400 px without scrolling sideways; block size, host and pid are on each worker's page.
    list_display = (
        "name", "live", "role", "enabled", "draining", "device", "model_name", "session_scoped",
        "shared_image_cache",
    )  # fmt: skip
    list_editable = ("enabled", "draining")
    list_filter = ("role", "enabled", "draining", "device")
    # Identity comes from the worker process when it registers: the name is its Celery queue and
    # the key of its heartbeat, so a name changed here would orphan a healthy worker (its
    # heartbeat no longer matches a row) and leave a row that can only ever be down.
    readonly_fields = (
        "name", "role", "device", "model_name", "block_size", "host", "pid", "registered_at",
        "deregistered_at",
    )  # fmt: skip
    actions = ("drain", "enable")

    def has_add_permission(self, request) -> bool:
        return False  # rows are made by registration (run_worker): one made here could only be down

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        # By name: a SCAN for heartbeats would walk every KV index key in the database.
        registry = WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
        try:
            self._alive = registry.alive(queryset.values_list("name", flat=True))
            self._live_known = True
        except redis.RedisError as exc:
            # Like the dashboard: the rows still show and stay editable; the live state is unknown.
            self._alive, self._live_known = {}, False
            messages.warning(
                request,
                f"Redis unavailable ({type(exc).__name__}: {redact_text(str(exc))}): "
                "the workers' live state is unknown.",
            )
        return queryset

    @admin.display(boolean=True, description="Live")
    def live(self, worker: Worker) -> bool | None:
        if not getattr(self, "_live_known", True):
            return None
        return worker.name in getattr(self, "_alive", {})

    @admin.display(boolean=True, description="Scoped")
    def session_scoped(self, worker: Worker) -> bool | None:
        beat = getattr(self, "_alive", {}).get(worker.name)
        return None if beat is None else beat.session_scoped

    @admin.display(description="Shared cache")
    def shared_image_cache(self, worker: Worker) -> str:
        beat = getattr(self, "_alive", {}).get(worker.name)
        return "" if beat is None else beat.shared_image_cache  # already redacted by the worker

    @admin.action(description="Drain: finish current work, take nothing new")
    def drain(self, request, queryset) -> None:
        names = ", ".join(sorted(queryset.values_list("name", flat=True)))
        queryset.update(draining=True)
        self.message_user(request, f"Draining: {names}.")

    @admin.action(description="Enable and stop draining")
    def enable(self, request, queryset) -> None:
        names = ", ".join(sorted(queryset.values_list("name", flat=True)))
        queryset.update(enabled=True, draining=False)
        self.message_user(request, f"Enabled, not draining: {names}.")


@admin.register(RoutingPolicySettings)
class RoutingPolicyAdmin(EscapedHelpTexts, admin.ModelAdmin):
    """One row: the list page opens it, created from the environment's settings the first time."""

    fields = (
        "mode", "overlap_credit", "prefill_load_scale", "temperature", "session_affinity",
        "frontend_decoding", "updated_at",
    )  # fmt: skip
    readonly_fields = ("updated_at",)

    def changelist_view(self, request, extra_context=None):
        from routing.policy import environment_defaults

        policy, _ = RoutingPolicySettings.objects.get_or_create(pk=1, defaults=environment_defaults())
        return HttpResponseRedirect(reverse("admin:routing_routingpolicysettings_change", args=[policy.pk]))

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change) -> None:
        from routing.policy import forget_cached_policy

        super().save_model(request, obj, form, change)
        forget_cached_policy()
