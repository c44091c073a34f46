"""`manage.py routing_stats [--json] [--minutes N]`: the live dashboard's snapshot in a terminal."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from routing.deployment import statistics_namespace
from routing.models import Worker
from routing.observe.cache_stats import CACHES
from routing.observe.dashboard import DEFAULT_MINUTES, MAX_MINUTES, DashboardReader, Snapshot
from routing.state.redis_keys import redact_text, redact_url, sync_client

SPARK_LEVELS = "▁▂▃▄▅▆▇█"
CACHE_HEADINGS = {"kv": "kv", "embedding": "embed", "local_image": "local img", "shared_image": "shared img"}


def percent(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def sparkline(rates: list[float | None]) -> str:
    """One character per minute; a blank where the cache had no lookup."""
    top = len(SPARK_LEVELS) - 1
    return "".join(" " if rate is None else SPARK_LEVELS[round(rate * top)] for rate in rates)


def worker_table(snapshot: Snapshot) -> list[list[str]]:
    header = ["worker", "state", "model", "device", "reqs", "prefill", "decode", "blocks"]
    header += [f"{CACHE_HEADINGS[cache]} hit" for cache in CACHES]
    rows = [header]
    for w in snapshot["workers"]:
        blocks = str(w["cached_blocks"])
        if w["capacity_blocks"]:
            blocks += f"/{w['capacity_blocks']}"
        rows.append(
            [
                w["name"],
                w["state"],
                w["model"],
                w["device"],
                str(w["active_requests"]),
                str(w["active_prefill_tokens"]),
                str(w["active_decode_blocks"]),
                blocks,
                *(percent(w["caches"][cache]["hit_rate"]) for cache in CACHES),
            ]
        )
    return rows


def aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


class Command(BaseCommand):
    help = "Print every worker's live state, load, cached blocks and cache hit rates."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true", help="Print the snapshot as one JSON object.")
        parser.add_argument(
            "--model",
            default=None,
            help="Only the workers of this model (the deployment's totals stay whole).",
        )
        parser.add_argument(
            "--minutes",
            type=int,
            default=DEFAULT_MINUTES,
            help=f"Minutes of per-minute hit rates, 0 to {MAX_MINUTES} (default {DEFAULT_MINUTES}).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        minutes: int = options["minutes"]
        if not 0 <= minutes <= MAX_MINUTES:
            raise CommandError(f"--minutes must be between 0 and {MAX_MINUTES}")
        try:
            reader = DashboardReader(
                sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX, statistics_namespace()
            )
            snapshot = reader.snapshot(Worker.objects.all(), minutes=minutes)
        except redis.RedisError as exc:
            raise CommandError(
                f"Redis at {redact_url(settings.REDIS_URL)} unavailable: {redact_text(str(exc))}"
            ) from exc
        if options["model"] is not None:
            snapshot["workers"] = [w for w in snapshot["workers"] if w["model"] == options["model"]]
        if options["json"]:
            self.stdout.write(json.dumps(snapshot))
            return
        self._print_table(snapshot)

    def _print_table(self, snapshot: Snapshot) -> None:
        taken = datetime.fromtimestamp(snapshot["generated_at"], tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        where = f"Redis {redact_url(settings.REDIS_URL)}, prefix {settings.REDIS_KEY_PREFIX}"
        self.stdout.write(f"{where}, {taken}")
        if snapshot["workers"]:
            for line in aligned(worker_table(snapshot)):
                self.stdout.write(line)
        else:
            self.stdout.write("No worker has registered, beaten or reported yet.")
        self.stdout.write("")
        self.stdout.write("All time (since this deployment's statistics began, or were last reset):")
        rows = [["cache", "hit rate", "hits", "misses", "bypasses", "errors", "bytes"]]
        for cache in CACHES:
            totals = snapshot["caches"][cache]
            rows.append(
                [cache, percent(totals["hit_rate"])]
                + [str(totals[field]) for field in ("hits", "misses", "bypasses", "errors", "bytes")]
            )
        for line in aligned(rows):
            self.stdout.write(line)
        kv = snapshot["caches"]["kv"]
        self.stdout.write(f"kv tokens: {kv['cached_tokens']} cached of {kv['prompt_tokens']} prompt tokens")
        routing = snapshot["routing"]
        self.stdout.write(
            f"routing: {routing['decisions']} decisions, overlap given up "
            f"{routing['overlap_given_up_blocks']} of {routing['best_overlap_blocks']} best-overlap blocks "
            f"({percent(routing['given_up_fraction'])})"
        )
        if snapshot["window"] is not None:
            self._print_window(snapshot)
        if snapshot["minutes"]:
            self.stdout.write("")
            self.stdout.write(f"Hit rate per minute, last {snapshot['minutes']} minutes (oldest first):")
            for line in aligned([[cache, f"|{sparkline(snapshot['series'][cache])}|"] for cache in CACHES]):
                self.stdout.write(line)

    def _print_window(self, snapshot: Snapshot) -> None:
        window = snapshot["window"]
        figures = window["totals"]
        self.stdout.write("")
        self.stdout.write(f"Last {snapshot['minutes']} minutes:")
        # Sorted by status code (the snapshot's order), so two runs read alike.
        statuses = ", ".join(f"{status}: {n}" for status, n in figures["by_status"].items()) or "none"
        ttft = figures["ttft"]
        failures = ", ".join(
            f"{label} {figures[count]}" + ("" if figures[share] is None else f" ({percent(figures[share])})")
            for label, count, share in (
                ("5xx", "server_errors", "server_error_share"),
                ("4xx", "client_errors", "client_error_share"),
                ("429", "rate_limited", "rate_limited_share"),
            )
        )
        rows = [
            ["requests", f"{figures['requests']} ({statuses})"],
            ["not 200", failures],
            ["prompt tokens", str(figures["prompt_tokens"])],
            ["cached tokens", f"{figures['cached_prompt_tokens']} ({percent(figures['kv_hit_rate'])})"],
            ["completion tokens", str(figures["completion_tokens"])],
            ["ttft p50/p90/p99", " / ".join(seconds(ttft[q]) for q in ("p50", "p90", "p99"))],
            *(
                [label, " / ".join(seconds(figures[key][q]) for q in ("p50", "p90", "p99"))]
                for label, key in (
                    ("e2e p50/p90/p99", "latency"),
                    ("itl p50/p90/p99", "inter_token"),
                )
            ),
            *([f"{CACHE_HEADINGS[cache]} hits", f"{window['caches'][cache]['hits']}"] for cache in CACHES),
        ]
        given_up = figures["overlap_given_up_blocks"]
        rows.append(["overlap given up", "not recorded" if given_up is None else f"{given_up} blocks"])
        for line in aligned(rows):
            self.stdout.write(f"  {line}")


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"
