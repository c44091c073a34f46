"""`manage.py ensure_admin`: create an admin login if the platform has none, printing it once."""

from __future__ import annotations

import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create a superuser 'admin' with a random password if no superuser exists; print it once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--username", default="admin")

    def handle(self, *args, **options) -> None:
        users = get_user_model()
        if users.objects.filter(is_superuser=True).exists():
            self.stdout.write("An admin login exists already (manage.py changepassword <user> resets it).")
            return
        password = secrets.token_urlsafe(12)
        users.objects.create_superuser(options["username"], email="", password=password)
        self.stdout.write(
            self.style.SUCCESS(
                f"Created the admin login (shown only this once): "
                f"user {options['username']!r}, password {password!r}"
            )
        )
