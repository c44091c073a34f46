"""`manage.py reset_stats --yes [--usage]`: start this deployment's statistics from zero.

Clears what is counted under the deployment's statistics namespace (routing.deployment): the
request counters and histograms behind /metrics and the dashboard, the per-minute buckets, cache
hit counters, process gauges. Tenants' usage stays unless `--usage` is given (it may be what
someone bills by). Another deployment on the same Redis (another database) is never touched:
its counters live under its own id. Without `--yes` it only says what it would clear.
"""

from __future__ import annotations

from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from routing.deployment import deployment_id, statistics_keys, statistics_namespace
from routing.state.redis_keys import redact_text, redact_url, sync_client
from tenants.usage import USAGE_FAMILY


class Command(BaseCommand):
    help = "Clear this deployment's statistics (metrics, dashboard, cache hit counters); --yes to do it."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--yes", action="store_true", help="Clear them (without it: say what would go).")
        parser.add_argument("--usage", action="store_true", help="Also clear every tenant's usage counters.")

    def handle(self, *args: Any, **options: Any) -> None:
        namespace = statistics_namespace()
        keep = () if options["usage"] else (USAGE_FAMILY,)
        try:
            client = sync_client(settings.REDIS_URL)
            keys = statistics_keys(client, namespace, keep_families=keep)
            if options["yes"] and keys:
                for start in range(0, len(keys), 500):
                    client.delete(*keys[start : start + 500])
        except redis.RedisError as exc:
            raise CommandError(
                f"Redis at {redact_url(settings.REDIS_URL)} unavailable: {redact_text(str(exc))}"
            ) from exc
        what = "statistics and tenant usage" if options["usage"] else "statistics (tenant usage kept)"
        where = f"deployment {deployment_id()} (Redis prefix {namespace})"
        if not options["yes"]:
            self.stdout.write(
                f"Would clear {len(keys)} keys of {what} of {where}. Run again with --yes to clear them."
            )
            return
        self.stdout.write(f"Cleared {len(keys)} keys of {what} of {where}.")
