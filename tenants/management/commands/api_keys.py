"""`manage.py api_keys create|list|revoke`: API keys from the command line, as in the admin.

`create` prints the new key once (the only time it exists in the clear); it creates a tenant
only when asked (`--create-tenant`), so a misspelt name is refused instead of becoming a new
tenant with no limits; `list` shows prefixes only; `revoke` takes a key's prefix (or its masked form).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from tenants.keys import create_api_key, revoke_api_key
from tenants.models import ApiKey, Tenant


class Command(BaseCommand):
    help = "Create, list or revoke API keys (each belongs to a tenant)."

    def add_arguments(self, parser: CommandParser) -> None:
        actions = parser.add_subparsers(dest="action", required=True)
        create = actions.add_parser("create", help="Create a key and print it once.")
        create.add_argument("--tenant", required=True, help="Tenant name (an existing tenant).")
        create.add_argument(
            "--create-tenant", action="store_true", help="Create the tenant if no tenant has that name."
        )
        create.add_argument("--name", required=True, help="What the key is for.")
        create.add_argument("--staff", action="store_true", help="Operator key (/v1/route, /metrics).")
        create.add_argument(
            "--share-cache", action="store_true", help="With --create-tenant: it opts into the shared pool."
        )
        expiry = create.add_mutually_exclusive_group()
        expiry.add_argument("--expires-in-days", type=float)
        expiry.add_argument("--expires-at", help="ISO 8601 date-time (UTC if no offset).")
        listing = actions.add_parser("list", help="List keys (prefixes only).")
        listing.add_argument("--tenant")
        revoke = actions.add_parser("revoke", help="Revoke a key by its prefix.")
        revoke.add_argument("prefix", help="The 8-character prefix, or the masked form sk-<prefix>.…")

    def handle(self, *args, **options) -> None:
        getattr(self, f"_{options['action']}")(options)

    def _create(self, options) -> None:
        tenant = self._tenant(options)
        expires_at = None
        if options["expires_in_days"] is not None:
            expires_at = timezone.now() + timedelta(days=options["expires_in_days"])
        elif options["expires_at"]:
            try:
                expires_at = datetime.fromisoformat(options["expires_at"])
            except ValueError as exc:
                raise CommandError(f"--expires-at: {exc}") from None
            if timezone.is_naive(expires_at):
                expires_at = timezone.make_aware(expires_at, timezone.UTC)
        key, plaintext = create_api_key(
            tenant, options["name"], staff=options["staff"], expires_at=expires_at
        )
        self.stdout.write(
            self.style.SUCCESS(
                f"Created API key {key.name!r} of tenant {tenant.name!r} (shown only this once):"
            )
        )
        self.stdout.write(plaintext)

    def _tenant(self, options) -> Tenant:
        name = options["tenant"]
        tenant = Tenant.objects.filter(name=name).first()
        if tenant is not None:
            return tenant
        if not options["create_tenant"]:
            known = list(Tenant.objects.values_list("name", flat=True))
            raise CommandError(
                f"No tenant is named {name!r}. Tenants: {', '.join(known) if known else 'none yet'}. "
                "Add --create-tenant to create it (with no limits: set them in the admin)."
            )
        tenant = Tenant.objects.create(name=name, share_prefix_cache=options["share_cache"])
        self.stdout.write(f"Created tenant {tenant.name!r} (no limits: set them in the admin).")
        return tenant

    def _list(self, options) -> None:
        keys = ApiKey.objects.select_related("tenant")
        if options["tenant"]:
            keys = keys.filter(tenant__name=options["tenant"])
        for key in keys:
            expiry = f"expires {key.expires_at:%Y-%m-%d %H:%M}" if key.expires_at else "no expiry"
            self.stdout.write(
                f"{key.masked}  {key.tenant.name}  {key.name}  {'staff  ' if key.staff else ''}"
                f"{key.refusal() or 'active'}  {expiry}"
            )

    def _revoke(self, options) -> None:
        prefix = options["prefix"].removeprefix("sk-").split(".")[0]
        key = ApiKey.objects.filter(prefix=prefix).first()
        if key is None:
            raise CommandError(f"No API key has the prefix {prefix!r}.")
        if revoke_api_key(key):
            self.stdout.write(
                self.style.SUCCESS(f"Revoked {key.masked} ({key.name}, tenant {key.tenant.name}).")
            )
        else:
            self.stdout.write(f"{key.masked} was revoked already.")
