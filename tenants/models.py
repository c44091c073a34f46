"""Tenants and their API keys: who may call the API, within which limits, sharing which caches.

A key's secret is never stored: only its SHA-256 and a short public prefix that identifies it
in the admin, in logs and in the database lookup (see tenants/keys.py).
"""

from __future__ import annotations

import secrets
import uuid

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from routing.admission.queue import DEFAULT_PRIORITY, MAX_PRIORITY


def new_cache_salt() -> str:
    return secrets.token_hex(16)


class Tenant(models.Model):
    """A customer of the platform. Every API key belongs to one; limits and usage are per tenant."""

    name = models.CharField(max_length=100, unique=True)
    # Keys the tenant's usage counters in Redis: never reused, unlike a database id (a new
    # database numbers its tenants from 1 again, and tenant #1 would inherit an old #1's usage).
    usage_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    # Secret: it keys the tenant's partition of every cache (prefix KV, embeddings, images).
    # Never shown: knowing it would not let anyone in, but nothing needs to see it.
    cache_salt = models.CharField(max_length=64, default=new_cache_salt, editable=False)
    share_prefix_cache = models.BooleanField(
        default=False,
        help_text=(
            "Share cached prefixes, embeddings and images with the other tenants that opted in "
            "(a common system prompt across teams). Off: nothing cached for this tenant is "
            "reused by, or observable to, any other tenant."
        ),
    )
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: no limit. Shared by every frontend through Redis."
    )
    prompt_tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Empty: no limit."
    )
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True, help_text="Empty: no limit.")
    # Flow control (routing.admission): while no worker can take a request, the queue serves
    # priority bands strictly and, within one, each tenant in proportion to its weight.
    queue_weight = models.FloatField(
        default=1.0,
        validators=[MinValueValidator(0.01), MaxValueValidator(1000.0)],
        help_text="The tenant's share of a busy platform against the others in a priority band (1: equal).",
    )
    default_priority = models.PositiveSmallIntegerField(
        default=DEFAULT_PRIORITY,
        validators=[MaxValueValidator(MAX_PRIORITY)],
        help_text=f"Priority of a request that names none (0-{MAX_PRIORITY}; higher waits less).",
    )
    max_priority = models.PositiveSmallIntegerField(
        default=DEFAULT_PRIORITY,
        validators=[MaxValueValidator(MAX_PRIORITY)],
        help_text="The highest priority a request may ask for (it may always ask for a lower one).",
    )
    # Names, not a relation: read with the tenant's row when a key is verified (no query more per
    # key), and a tenant may be limited to a model before its first worker announces it.
    allowed_models = models.TextField(
        blank=True,
        help_text="Models the tenant may use and sees in /v1/models, by name, separated by commas or "
        "spaces. Empty: every model.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def clean(self) -> None:
        low, high = self.default_priority, self.max_priority
        if low is not None and high is not None and low > high:
            raise ValidationError({"default_priority": "The default may not exceed the maximum priority."})

    def __str__(self) -> str:
        return self.name

    @property
    def allowed_model_names(self) -> frozenset[str] | None:
        """The models the tenant may use; None: every model."""
        return frozenset(self.allowed_models.replace(",", " ").split()) or None


class ApiKey(models.Model):
    """One bearer key of a tenant. `staff` keys may also call the operators' endpoints."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, help_text="What the key is for (who holds it).")
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    hashed_key = models.CharField(max_length=64, editable=False)  # SHA-256 hex of the whole key
    staff = models.BooleanField(
        default=False, help_text="Operator key: may also call /v1/route and /metrics."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: never expires.")
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["tenant__name", "name"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.masked})"

    @property
    def masked(self) -> str:
        """How the key is shown anywhere after its creation."""
        return f"sk-{self.prefix}.…"

    def refusal(self, now=None) -> str | None:
        """Why this key may not be used now, or None if it may."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= (now or timezone.now()):
            return "expired"
        return None
