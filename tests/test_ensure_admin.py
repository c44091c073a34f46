"""`manage.py ensure_admin`: what `make run` relies on for a first login."""

from __future__ import annotations

import io
import re

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command


@pytest.mark.django_db
def test_ensure_admin_creates_one_login_once_and_prints_its_password_once():
    out = io.StringIO()
    call_command("ensure_admin", stdout=out)
    printed = out.getvalue()
    password = re.search(r"password '([^']+)'", printed).group(1)
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.check_password(password)

    again = io.StringIO()
    call_command("ensure_admin", stdout=again)
    assert password not in again.getvalue()
    assert get_user_model().objects.filter(is_superuser=True).count() == 1
