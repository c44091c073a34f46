"""Database state operators manage from the admin: the workers and how requests are routed to them."""

from __future__ import annotations

from django.db import models


class Worker(models.Model):
    """A GPU worker process. The row is the operator's handle; liveness comes from its Redis heartbeat."""

    name = models.SlugField(
        max_length=64, unique=True, help_text="Also the Celery queue suffix: worker.<name>."
    )
    enabled = models.BooleanField(default=True, help_text="Disabled workers receive no requests.")
    draining = models.BooleanField(
        default=False, help_text="A draining worker finishes what it has and receives nothing new."
    )
    device = models.CharField(max_length=32, blank=True)
    model_name = models.CharField(max_length=200, blank=True)
    block_size = models.PositiveIntegerField(default=16)
    host = models.CharField(max_length=255, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    deregistered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @property
    def queue(self) -> str:
        return worker_queue(self.name)


def worker_queue(name: str) -> str:
    """The Celery queue a worker consumes, and the only one it consumes."""
    return f"worker.{name}"
