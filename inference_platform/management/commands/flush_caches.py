"""`manage.py flush_caches`: drop cached KV blocks, embeddings and images, on every worker or some.
Flushing every worker's images (no --worker, no --scope) also makes every frontend forget the
sizes of pictures it read by URL.

Each worker's caches are flushed by the worker itself (a control task on its own queue, answered
through a response stream), the shared image cache included: the workers know its URL and
whether it is on; this command's own environment need not.
A session scope limits the flush to that scope's entries (the KV cache, content-based and
shared by every scope, is then left alone). `--dry-run` reports what would go.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference_platform.celery import app as celery_app
from routing.contract.responses import DONE, ERROR, parse_stream_entries, response_key
from routing.contract.tasks import FlushCachesTask
from routing.fleet.registry import WorkerRegistry
from routing.media.images import SIZES_FLUSHED_KEY
from routing.models import Worker, worker_queue
from routing.prompt.session_scope import SessionScopeError, resolve_session_scope, scope_hash
from routing.state.redis_keys import renew_generation, sync_client

CACHES = ("kv", "embeddings", "images", "shared-images")


class Command(BaseCommand):
    help = "Flush KV, embedding, decoded-image and shared image caches, by worker or session scope."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--worker", action="append", default=[], help="Only this worker (repeatable).")
        parser.add_argument("--model", default=None, help="Only the workers of this model.")
        parser.add_argument(
            "--scope",
            default=None,
            help="Only this session scope's entries (the raw session id; never logged).",
        )
        parser.add_argument(
            "--tenant",
            default=None,
            help="The tenant whose session scope --scope names (scopes are bound to their tenant).",
        )
        parser.add_argument(
            "--cache", action="append", choices=CACHES, default=[], help="Only these caches (default: all)."
        )
        parser.add_argument(
            "--dry-run", action="store_true", help="Report what would be flushed; change nothing."
        )
        parser.add_argument(
            "--timeout", type=float, default=15.0, help="Seconds to wait for each worker's answer."
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")

    def handle(self, *args, **options) -> None:
        caches = set(options["cache"] or CACHES)
        scope_key = self._scope_key(options["scope"], options["tenant"])
        client = sync_client(settings.REDIS_URL)
        report: dict[str, Any] = {
            "dry_run": options["dry_run"],
            "scoped": scope_key is not None,
            "workers": {},
        }

        # The live set the router reads: registered workers with a heartbeat.
        rows = (
            Worker.objects.all()
            if options["model"] is None
            else Worker.objects.filter(model_name=options["model"])
        )
        registered = list(rows.values_list("name", flat=True))
        live = WorkerRegistry(client, settings.REDIS_KEY_PREFIX).alive(registered)
        unknown = sorted(set(options["worker"]) - set(live))
        if unknown:
            raise CommandError(
                f"not live: {', '.join(unknown)} (live workers: {', '.join(sorted(live)) or 'none'})"
            )
        targets = sorted(options["worker"] or live)

        worker_caches = caches & {"kv", "embeddings", "images", "shared-images"}
        if worker_caches:
            pending = {}
            for name in targets:
                flush_id = f"flush-{uuid.uuid4().hex}"
                task = FlushCachesTask(
                    flush_id=flush_id,
                    scope_key=scope_key,
                    dry_run=options["dry_run"],
                    shared_images="shared-images" in worker_caches,
                    **{cache: cache in worker_caches for cache in ("kv", "embeddings", "images")},
                )
                celery_app.send_task(
                    task.name,
                    args=[task.to_payload()],
                    queue=worker_queue(name),
                    expires=options["timeout"],
                )
                pending[name] = flush_id
            report["workers"] = self._answers(client, pending, options["timeout"])

        if "shared-images" in caches:
            report["shared_images"] = _shared_images(report["workers"])
        every_worker = not options["worker"] and options["model"] is None
        if "images" in caches and not options["dry_run"] and every_worker and scope_key is None:
            # The frontends keep the sizes of pictures read by URL: a flush of every worker's
            # images makes them forget those too, each at its next request a second or more
            # after it last looked (routing.media.images.ImageSizes). One limited to some workers or
            # to a session scope leaves them.
            renew_generation(client, f"{settings.REDIS_KEY_PREFIX}{SIZES_FLUSHED_KEY}")
            report["frontend_image_sizes"] = "forgotten by every frontend within about a second"

        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        verb = "would flush" if options["dry_run"] else "flushed"
        if "frontend_image_sizes" in report:
            self.stdout.write(f"frontends: image sizes {report['frontend_image_sizes']}")
        if not targets:
            self.stdout.write("no live worker: nothing to flush (the caches live in the workers)")
            return
        for name, answer in sorted(report["workers"].items()):
            details = ", ".join(
                f"{k} {v}" for k, v in answer.items() if k not in ("worker", "dry_run", "shared_images")
            )
            self.stdout.write(f"{name}: {verb} {details or 'nothing'}")
        if "shared_images" in report:
            shared = report["shared_images"]
            # A count, or why there was nothing to count ("not enabled on any live worker").
            self.stdout.write(
                f"shared image cache: {f'{verb} {shared}' if isinstance(shared, int) else shared}"
            )

    def _scope_key(self, scope: str | None, tenant_name: str | None) -> str | None:
        if scope is None:
            if tenant_name is not None:
                raise CommandError("--tenant goes with --scope")
            return None
        bind_to = None
        if tenant_name is not None:
            from tenants.keys import tenant_scope_binding

            bind_to = tenant_scope_binding(tenant_name)
            if bind_to is None:
                raise CommandError(f"No tenant is named {tenant_name!r}.")
        try:
            resolved = resolve_session_scope({"x-dynamo-session-id": scope})
        except SessionScopeError as exc:
            raise CommandError(str(exc)) from exc
        if resolved is None:
            raise CommandError("--scope is blank")
        return scope_hash(resolved, settings.SECRET_KEY.encode(), bind_to=bind_to)

    def _answers(self, client, pending: dict[str, str], timeout: float) -> dict[str, Any]:
        answers: dict[str, Any] = {}
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for name, flush_id in list(pending.items()):
                key = response_key(settings.REDIS_KEY_PREFIX, flush_id)
                events = parse_stream_entries(client.xrange(key))
                final = next((e for e in events if e.type in (DONE, ERROR)), None)
                if final is not None:
                    answers[name] = final.data if final.type == DONE else {"error": final.data.get("message")}
                    client.delete(key)
                    del pending[name]
            time.sleep(0.05)
        for name in pending:
            answers[name] = {"error": f"no answer within {timeout:g} s"}
        return answers


def _shared_images(answers: dict[str, Any]) -> int | str:
    """What the shared image cache lost (or would), as the workers that use it report it.

    Workers of one deployment share one cache: the first to flush it reports what went, the
    others the rest (usually 0), so the counts add up to what the cache held."""
    counts = [a["shared_images"] for a in answers.values() if isinstance(a.get("shared_images"), int)]
    if counts:
        return max(counts) if any(a.get("dry_run") for a in answers.values()) else sum(counts)
    if not answers:
        return "no live worker to flush it"
    return "not enabled on any live worker"
