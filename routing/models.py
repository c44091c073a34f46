"""Database state operators manage from the admin: the workers and how requests are routed to them."""

from __future__ import annotations

from django.core.validators import MinValueValidator
from django.db import models


class WorkerQuerySet(models.QuerySet):
    def update(self, **kwargs):
        """An update() sends no signal: say it to every frontend's kept rows (routing.fleet.worker_rows)
        as a save does."""
        from routing.fleet.worker_rows import workers_changed

        updated = super().update(**kwargs)
        if updated:
            workers_changed()
        return updated


class Worker(models.Model):
    """A GPU worker process. The row is the operator's handle; liveness comes from its Redis heartbeat."""

    name = models.SlugField(
        max_length=64, unique=True, help_text="Also the Celery queue suffix: worker.<name>."
    )
    enabled = models.BooleanField(default=True, help_text="Disabled workers receive no requests.")
    draining = models.BooleanField(
        default=False, help_text="A draining worker finishes what it has and receives nothing new."
    )
    ROLES = [
        ("both", "Encode and generate"),
        ("llm", "Generate (LLM worker, E/PD)"),
        ("encode", "Encode images (encode worker, E/PD)"),
    ]
    role = models.CharField(
        max_length=8,
        choices=ROLES,
        default="both",
        help_text="Set by the worker when it registers (run_worker --role).",
    )
    device = models.CharField(max_length=32, blank=True)
    model_name = models.CharField(max_length=200, blank=True)
    block_size = models.PositiveIntegerField(default=16)
    host = models.CharField(max_length=255, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    registered_at = models.DateTimeField(null=True, blank=True)
    deregistered_at = models.DateTimeField(null=True, blank=True)

    objects = WorkerQuerySet.as_manager()

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


class RoutingPolicySettings(models.Model):
    """The live routing and media policy: one row, edited in the admin, picked up by every
    frontend process within a second, without a restart. Until an operator saves it, the
    environment's settings (ROUTER_*, DYN_MM_FRONTEND_DECODING) apply."""

    MODES = [("kv", "KV-aware (cache and load)"), ("round_robin", "Round robin"), ("random", "Random")]

    mode = models.CharField(max_length=16, choices=MODES, default="kv")
    overlap_credit = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.0)],
        help_text="Blocks of prefill saved per cached block.",
    )
    prefill_load_scale = models.FloatField(
        default=32.0,
        validators=[MinValueValidator(0.0)],
        help_text="Weight of prefill work against decode blocks.",
    )
    temperature = models.FloatField(
        default=0.0,
        validators=[MinValueValidator(0.0)],
        help_text="0 always picks the cheapest worker; above 0 samples workers by a softmax over costs.",
    )
    session_affinity = models.BooleanField(
        default=True, help_text="Send a session back to its last worker while that worker is eligible."
    )
    frontend_decoding = models.BooleanField(
        default=False,
        help_text="Identify images by their decoded pixels (stable across URLs); the frontend fetches them "
        "and workers never fetch the origin again.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "routing policy"
        verbose_name_plural = "routing policy"

    def __str__(self) -> str:
        return "Routing policy"

    def save(self, *args, **kwargs) -> None:
        self.pk = 1  # one row: the deployment's policy
        super().save(*args, **kwargs)


class Deployment(models.Model):
    """This deployment's identity: one row, made on first use.

    Statistics, telemetry and tenant usage live in Redis under a prefix that includes this id
    (routing.deployment), so a fresh database on a Redis another deployment used (or still uses,
    with the same REDIS_KEY_PREFIX) starts from zero instead of inheriting its figures.
    """

    deployment_id = models.CharField(max_length=32, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.deployment_id
