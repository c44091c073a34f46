"""Operators' admin for workers: live state from the heartbeat beside the row they edit."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin

from routing.models import Worker
from routing.redis_keys import sync_client
from routing.registry import WorkerRegistry


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "live",
        "enabled",
        "draining",
        "device",
        "model_name",
        "block_size",
        "host",
        "pid",
    )
    list_editable = ("enabled", "draining")
    list_filter = ("enabled", "draining", "device")
    readonly_fields = (
        "device",
        "model_name",
        "block_size",
        "host",
        "pid",
        "registered_at",
        "deregistered_at",
    )
    actions = ("drain", "enable")

    def get_queryset(self, request):
        queryset = super().get_queryset(request)
        # By name: a SCAN for heartbeats would walk every KV index key in the database.
        registry = WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
        self._alive = registry.alive(queryset.values_list("name", flat=True))
        return queryset

    @admin.display(boolean=True, description="Live")
    def live(self, worker: Worker) -> bool:
        return worker.name in getattr(self, "_alive", {})

    @admin.action(description="Drain: finish current work, take nothing new")
    def drain(self, request, queryset) -> None:
        queryset.update(draining=True)

    @admin.action(description="Enable and stop draining")
    def enable(self, request, queryset) -> None:
        queryset.update(enabled=True, draining=False)
