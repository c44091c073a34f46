"""`manage.py ensure_demo_key`: for `make run`, a key for the demo tenant, printed once.

Like `ensure_admin`: if the demo tenant has an active key already, nothing is created (it
cannot be shown again: `manage.py api_keys revoke <prefix>` and run this again for a new one).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandParser

from tenants.keys import create_api_key
from tenants.models import ApiKey, Tenant


class Command(BaseCommand):
    help = "Create an API key for the demo tenant if it has no active one; print it once."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--tenant", default="demo")

    def handle(self, *args, **options) -> None:
        tenant, _ = Tenant.objects.get_or_create(name=options["tenant"])
        active = [key for key in ApiKey.objects.filter(tenant=tenant, name="demo") if key.refusal() is None]
        if active:
            self.stdout.write(
                f"The demo API key exists already ({active[0].masked}); it cannot be shown again "
                f"(manage.py api_keys revoke {active[0].prefix}, then run this again for a new one)."
            )
            return
        _key, plaintext = create_api_key(tenant, "demo", staff=True)
        self.stdout.write(self.style.SUCCESS(f"Created the demo API key (shown only this once): {plaintext}"))
