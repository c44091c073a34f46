"""Database state operators manage from the admin: the workers and how requests are routed to them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from django.core.validators import MinValueValidator
from django.db import models

from routing.fleet.registry import Heartbeat


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


# The routing modes (RoutingPolicySettings.MODES), named before the models that offer them.
_POLICY_MODES = [("kv", "KV-aware (cache and load)"), ("round_robin", "Round robin"), ("random", "Random")]


class ModelQuerySet(WorkerQuerySet):
    """Model rows are read with the workers' rows, under their generation: an update() says so too."""


class Model(models.Model):
    """A model the deployment serves: made when a worker first announces it, or by an operator.

    Its fingerprint (routing.prompt.model_card) is authoritative: a worker announcing the name
    with another one is misconfigured (another tokenizer or template under the same name) and
    gets none of the model's requests. A worker announcing a model with no fingerprint recorded
    yet records its own.
    """

    name = models.CharField(
        max_length=200, unique=True, help_text="What clients send as `model`; also the name workers announce."
    )
    family = models.CharField(max_length=64, blank=True, help_text="Its config.json's model_type.")
    fingerprint = models.CharField(
        max_length=32,
        blank=True,
        help_text="The routing files' hash (tokenizer, chat template, processor settings) its workers "
        "must announce. Empty: the next worker to announce the model records its own.",
    )
    enabled = models.BooleanField(
        default=True, help_text="A disabled model answers new requests with 404 model_not_found."
    )
    always_listed = models.BooleanField(
        default=False, help_text="Listed in /v1/models even while no worker of it is live."
    )
    # The model's routing policy: each field left empty follows the deployment's (RoutingPolicySettings).
    routing_mode = models.CharField(
        max_length=16,
        blank=True,
        choices=[("", "The deployment's"), *[(m, n) for m, n in _POLICY_MODES]],
        help_text="Empty: the deployment's routing policy.",
    )
    overlap_credit = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0)], help_text="Empty: the deployment's."
    )
    prefill_load_scale = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0)], help_text="Empty: the deployment's."
    )
    temperature = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0)], help_text="Empty: the deployment's."
    )
    created_at = models.DateTimeField(auto_now_add=True)

    objects = ModelQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    @classmethod
    def announce(cls, name: str, family: str, fingerprint: str) -> Model:
        """A worker announces that it serves `name`: the row, made now if it is the first to, with
        this fingerprint recorded if none was. The caller compares the row's fingerprint with its
        own (a mismatch is the operator's to resolve, never overwritten by a worker)."""
        row, created = cls.objects.get_or_create(
            name=name, defaults={"family": family, "fingerprint": fingerprint}
        )
        if not created and not row.fingerprint:
            cls.objects.filter(pk=row.pk, fingerprint="").update(fingerprint=fingerprint, family=family)
            row.refresh_from_db()
        return row


class ModelAlias(models.Model):
    """Another name clients may send as `model`, standing for one model or several: a request
    naming it goes to one of its models in proportion to their weights, in a smooth rotation (a
    canary: 9 of every 10 requests to the current version, 1 to the next)."""

    name = models.CharField(max_length=200, help_text="The name clients send; never a model's own name.")
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="aliases")
    weight = models.PositiveIntegerField(
        default=1, validators=[MinValueValidator(1)], help_text="Its share of the alias's requests."
    )

    class Meta:
        ordering = ["name", "model__name"]
        constraints = [models.UniqueConstraint(fields=["name", "model"], name="one_weight_per_alias_model")]
        verbose_name_plural = "model aliases"

    def __str__(self) -> str:
        return f"{self.name} → {self.model.name} ({self.weight})"

    def clean(self) -> None:
        from django.core.exceptions import ValidationError

        if Model.objects.filter(name=self.name).exists():
            raise ValidationError({"name": f"{self.name!r} is a model's own name."})


@dataclass(frozen=True)
class ModelFleet:
    """A model's live workers as the admin and /metrics show them."""

    serving: tuple[Heartbeat, ...]  # live, announcing the model's fingerprint (or none, from before)
    # Live and announcing the model's name with another fingerprint: a configuration error, and
    # no request of the model goes there (inference_platform.serving.dispatch).
    mismatched: tuple[Heartbeat, ...]


def model_fleets(models: Iterable[Model], alive: Iterable[Heartbeat]) -> dict[str, ModelFleet]:
    """Each model's live workers by its name, split by whether they announce its fingerprint."""
    beats = list(alive)
    fleets = {}
    for model in models:
        own = [beat for beat in beats if beat.model == model.name]
        agrees = [
            b for b in own if not (model.fingerprint and b.fingerprint) or b.fingerprint == model.fingerprint
        ]
        fleets[model.name] = ModelFleet(
            serving=tuple(agrees), mismatched=tuple(b for b in own if b not in agrees)
        )
    return fleets


class RoutingPolicySettings(models.Model):
    """The live routing and media policy: one row, edited in the admin, picked up by every
    frontend process within a second, without a restart. Until an operator saves it, the
    environment's settings (ROUTER_*, DYN_MM_FRONTEND_DECODING) apply."""

    MODES = _POLICY_MODES

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
