"""Operators' admin: models (their live workers beside the row they edit), workers (live state from
the heartbeat beside the row they edit) and the live routing policy."""

from __future__ import annotations

import redis
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.models import LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.decorators import method_decorator
from django.utils.html import escape, format_html
from django.views.decorators.http import require_POST

from routing.fleet.registry import WorkerRegistry
from routing.kv.load import TOTALS_KEY, LoadTracker
from routing.models import Model, ModelAlias, ModelFleet, RoutingPolicySettings, Worker, model_fleets
from routing.policy import environment_defaults, forget_cached_policy
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
    # Every column in sight at 800 and 1,400 px (templates/admin/change_list.html wraps them);
    # block size, host and pid are on each worker's page.
    list_display = (
        "name", "live", "role_name", "enabled", "draining", "in_flight", "device", "model_name",
        "session_scoped", "shared_image_cache",
    )  # fmt: skip
    list_editable = ("enabled", "draining")
    list_filter = ("role", "enabled", "draining", "device")
    # Identity comes from the worker process when it registers: the name is its Celery queue and
    # the key of its heartbeat, so a name changed here would orphan a healthy worker (its
    # heartbeat no longer matches a row) and leave a row that can only ever be down.
    fields = (
        "worker_name", "enabled", "draining", "role", "device", "model_name", "block_size", "host", "pid",
        "registered_at", "deregistered_at",
    )  # fmt: skip
    readonly_fields = (
        "worker_name", "role", "device", "model_name", "block_size", "host", "pid", "registered_at",
        "deregistered_at",
    )  # fmt: skip
    actions = ("drain", "enable")

    @admin.display(description="Name", ordering="name")
    def worker_name(self, worker: Worker) -> str:
        # Shown, never a form field (a read-only model field would show its help text unescaped).
        return format_html('{} <span class="help">(Celery queue {})</span>', worker.name, worker.queue)

    def has_add_permission(self, request) -> bool:
        return False  # rows are made by registration (run_worker): one made here could only be down

    def changelist_view(self, request, extra_context=None):
        # Ten columns need the page's width more than the models' sidebar needs a third of it.
        return super().changelist_view(request, {"is_nav_sidebar_enabled": False, **(extra_context or {})})

    @admin.display(description="Role", ordering="role")
    def role_name(self, worker: Worker) -> str:
        return worker.role  # "both", "llm", "encode": run_worker's --role, and short

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        # By name: a SCAN for heartbeats would walk every KV index key in the database.
        client = sync_client(settings.REDIS_URL)
        registry = WorkerRegistry(client, settings.REDIS_KEY_PREFIX)
        names = list(queryset.values_list("name", flat=True))
        try:
            self._alive = registry.alive(names)
            # Read, not swept: a GET changes nothing (workers sweep expired entries as they beat).
            totals = client.hgetall(f"{settings.REDIS_KEY_PREFIX}{TOTALS_KEY}")
            loads = LoadTracker.loads(totals, names)
            self._routed = {n: load.active_requests for n, load in zip(names, loads, strict=True)}
            self._live_known = True
        except redis.RedisError as exc:
            # Like the dashboard: the rows still show and stay editable; the live state is unknown.
            self._alive, self._routed, self._live_known = {}, {}, False
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

    @admin.display(description="In flight")
    def in_flight(self, worker: Worker) -> str:
        """Requests routed to the worker and not finished, or, once a drained worker has none,
        that it may be stopped: what an operator waits for after "Drain"."""
        beat = getattr(self, "_alive", {}).get(worker.name)
        if beat is None:
            return "—"
        # The router's count includes requests sent and not yet taken from the worker's queue;
        # the heartbeat's, what its engine runs and holds waiting. Both zero: nothing is left.
        count = max(getattr(self, "_routed", {}).get(worker.name, 0), beat.running + beat.waiting)
        if count == 0 and (worker.draining or not worker.enabled or beat.stopping):
            return "drained, safe to stop"
        return str(count)

    @admin.display(description="Scoped")
    def session_scoped(self, worker: Worker) -> str:
        """In words: "not scoped" is a configuration, not a fault to mark with a red cross."""
        beat = getattr(self, "_alive", {}).get(worker.name)
        if beat is None:
            return "—"
        return "scoped" if beat.session_scoped else "not scoped"

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


class ModelAliasInline(admin.TabularInline):
    """Names that stand for this model, with its share of each (a canary between two versions: the
    same alias on both, weights 9 and 1)."""

    model = ModelAlias
    extra = 0
    fields = ("name", "weight")


@admin.register(Model)
class ModelAdmin(EscapedHelpTexts, admin.ModelAdmin):
    """Each model with its live workers, their roles and KV cache figures; a worker announcing the
    model's name with another fingerprint is flagged (it gets none of the model's requests)."""

    list_display = ("name", "enabled", "always_listed", "family", "short_fingerprint", "workers", "flagged")
    list_editable = ("enabled", "always_listed")
    list_filter = ("enabled", "family")
    fieldsets = (
        (None, {"fields": ("name", "enabled", "always_listed", "family", "fingerprint", "created_at")}),
        (
            "Routing policy (empty: the deployment's)",
            {"fields": ("routing_mode", "overlap_credit", "prefill_load_scale", "temperature")},
        ),
    )
    readonly_fields = ("created_at",)
    inlines = (ModelAliasInline,)
    actions = ("disable", "enable")

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        names = list(Worker.objects.values_list("name", flat=True))
        try:
            alive = WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX).alive(names)
            self._fleets: dict[str, ModelFleet] | None = model_fleets(queryset, alive.values())
        except redis.RedisError as exc:
            self._fleets = None
            messages.warning(
                request,
                f"Redis unavailable ({type(exc).__name__}: {redact_text(str(exc))}): "
                "the models' live workers are unknown.",
            )
        return queryset

    def _fleet(self, model: Model) -> ModelFleet | None:
        fleets = getattr(self, "_fleets", None)
        return None if fleets is None else fleets.get(model.name, ModelFleet((), ()))

    @admin.display(description="Fingerprint", ordering="fingerprint")
    def short_fingerprint(self, model: Model) -> str:
        return model.fingerprint[:12] or "—"

    @admin.display(description="Live workers (role, KV blocks used / capacity)")
    def workers(self, model: Model) -> str:
        fleet = self._fleet(model)
        if fleet is None:
            return "unknown"
        if not fleet.serving:
            return "none"
        return ", ".join(
            f"{b.name} ({b.role}, {b.kv_blocks_used}/{b.kv_capacity_blocks})" for b in fleet.serving
        )

    @admin.display(description="Flagged: another fingerprint")
    def flagged(self, model: Model) -> str:
        fleet = self._fleet(model)
        if fleet is None or not fleet.mismatched:
            return ""
        return ", ".join(f"{b.name} ({b.fingerprint[:12]})" for b in fleet.mismatched)

    @admin.action(description="Disable: new requests get 404 model_not_found")
    def disable(self, request, queryset) -> None:
        names = ", ".join(sorted(queryset.values_list("name", flat=True)))
        queryset.update(enabled=False)
        self.message_user(request, f"Disabled: {names}.")

    @admin.action(description="Enable")
    def enable(self, request, queryset) -> None:
        names = ", ".join(sorted(queryset.values_list("name", flat=True)))
        queryset.update(enabled=True)
        self.message_user(request, f"Enabled: {names}.")


@admin.register(RoutingPolicySettings)
class RoutingPolicyAdmin(EscapedHelpTexts, admin.ModelAdmin):
    """One row, which exists only once an operator saved the page. Until then (and after a reset)
    the page shows the environment's settings unsaved, and a GET never writes: a visit must not
    freeze the ROUTER_* values in the database, where they would silently outlive the
    environment they came from."""

    fields = (
        "source", "mode", "overlap_credit", "prefill_load_scale", "temperature", "session_affinity",
        "frontend_decoding",
    )  # fmt: skip
    readonly_fields = ("source",)
    change_form_template = "admin/routing/routingpolicysettings/change_form.html"

    def get_urls(self):
        reset = path(
            "reset/", self.admin_site.admin_view(self.reset_view), name="routing_routingpolicysettings_reset"
        )
        return [reset, *super().get_urls()]

    def changelist_view(self, request, extra_context=None):
        return HttpResponseRedirect(reverse("admin:routing_routingpolicysettings_change", args=[POLICY_PK]))

    def get_object(self, request, object_id, from_field=None):
        """The saved row, or (none saved) an unsaved one holding the environment's values: the
        form shows what applies, and its first save creates the row."""
        if str(object_id) != str(POLICY_PK):
            return None
        saved = RoutingPolicySettings.objects.filter(pk=POLICY_PK).first()
        return saved if saved is not None else RoutingPolicySettings(pk=POLICY_PK, **environment_defaults())

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # "reset to the environment" is the way back, and it says so in the log

    @admin.display(description="Source")
    def source(self, policy: RoutingPolicySettings) -> str:
        return policy_source(policy)

    def render_change_form(self, request, context, add=False, change=False, form_url="", obj=None):
        context["policy_saved"] = RoutingPolicySettings.objects.filter(pk=POLICY_PK).exists()
        return super().render_change_form(request, context, add, change, form_url, obj)

    def save_model(self, request, obj, form, change) -> None:
        super().save_model(request, obj, form, change)
        forget_cached_policy()

    @method_decorator(require_POST)
    def reset_view(self, request: HttpRequest) -> HttpResponse:
        """Forget the saved policy: the environment's settings apply again, in every process
        within a second; the admin's log says who did it and when."""
        if not self.has_change_permission(request):
            raise PermissionDenied
        saved = RoutingPolicySettings.objects.filter(pk=POLICY_PK).first()
        if saved is None:
            self.message_user(request, "Nothing was saved: the environment's settings apply already.")
        else:
            self.log_change(request, saved, RESET_MESSAGE)
            saved.delete()
            forget_cached_policy()
            self.message_user(request, "Reset: the environment's settings (ROUTER_*) apply again.")
        return HttpResponseRedirect(reverse("admin:routing_routingpolicysettings_change", args=[POLICY_PK]))


POLICY_PK = 1
RESET_MESSAGE = "Reset to the environment's settings."


def policy_source(policy: RoutingPolicySettings) -> str:
    """Where the values on the policy page come from, in the operator's words."""
    if not RoutingPolicySettings.objects.filter(pk=policy.pk).exists():
        return (
            "The environment (ROUTER_MODE, ROUTER_OVERLAP_CREDIT, ROUTER_PREFILL_LOAD_SCALE, "
            "ROUTER_TEMPERATURE, ROUTER_SESSION_AFFINITY, DYN_MM_FRONTEND_DECODING): nothing is saved "
            "here, so a change of those settings applies at the next restart. Saving this page "
            "replaces them until it is reset."
        )
    entry = (
        LogEntry.objects.filter(
            content_type=ContentType.objects.get_for_model(RoutingPolicySettings), object_id=str(policy.pk)
        )
        .select_related("user")
        .order_by("-action_time")
        .first()
    )
    # The admin logs a save just after it writes the row: an entry older than the row (a reset,
    # or a save from a shell since) does not say who saved these values.
    by_admin = entry is not None and entry.action_time >= policy.updated_at
    saved_by = f" by {entry.user.get_username()}" if by_admin else ""
    changed = [
        f"{name} {value!r}"
        for name, value in environment_defaults().items()
        if getattr(policy, name) != value
    ]
    differs = (
        f" The environment says {', '.join(changed)}."
        if changed
        else " It equals the environment's settings."
    )
    return (
        f"Saved{saved_by} at {policy.updated_at:%Y-%m-%d %H:%M:%S} UTC: the environment's ROUTER_* "
        f"settings do not apply until it is reset.{differs}"
    )
