"""`manage.py inspect_request FILE.json [--tenant NAME] [--json]`: what the router sees of a chat
request in a file.

Block hashes fold in the cache partition, as the API's own do: the tenant's salt (`--tenant`, the
tenant whose key would send the request) and the body's `cache_salt`. Without `--tenant` they are
the shared pool's: what an unauthenticated demo or a tenant sharing its prefix cache routes on.

Then every worker of the model, as `/v1/route` shows them: the choice the router would make now,
and each worker's overlap, load terms (prefill and decode blocks) and cost, computed by the router
itself with nothing reserved. Without Redis the workers are left out, and the command says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import redis
from asgiref.sync import async_to_sync
from django.core.management.base import BaseCommand, CommandError

from inference_platform.api.chat_request import parse_chat_request, parse_json_body
from inference_platform.serving.errors import ApiError
from inference_platform.serving.prepare import describe_workers, prepare, served_model
from routing.deployment import statistics_namespace


class Command(BaseCommand):
    help = "Print the routing token view of a chat request (a JSON file; its model may be omitted)."

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "file", type=Path, help="A chat completion request body, or - for standard input."
        )
        parser.add_argument(
            "--tenant",
            default=None,
            help="The tenant sending it: its cache salt folds into the block hashes, as for its keys.",
        )
        parser.add_argument(
            "--model",
            default=None,
            help="The model to ask (overrides the body's; default: the deployment's).",
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON object.")

    def handle(self, *args, **options) -> None:
        from django.conf import settings

        from tenants.keys import ANONYMOUS, tenant_caller
        from tenants.models import Tenant

        try:
            caller = ANONYMOUS if options["tenant"] is None else tenant_caller(options["tenant"])
        except Tenant.DoesNotExist:
            raise CommandError(f"No tenant is named {options['tenant']!r}.") from None
        path: Path = options["file"]
        try:
            if str(path) == "-":
                text = (options.get("stdin") or sys.stdin).read()  # call_command may pass its own
                raw = text.encode() if isinstance(text, str) else text
            else:
                raw = path.read_bytes()
        except OSError as exc:
            raise CommandError(f"cannot read {path}: {exc}") from exc
        try:
            body = parse_json_body(raw)
            if options["model"]:
                body["model"] = options["model"]
            body.setdefault("model", served_model().name)
            chat = parse_chat_request(body, max_tokens_limit=settings.MAX_TOKENS_LIMIT)
            salt = caller.cache_salt(chat.cache_salt)
            prepared = prepare(chat, salt)
        except ApiError as exc:
            raise CommandError(f"{exc.status} {exc.code}: {exc.message}") from exc
        description = prepared.describe()
        # The deployment id is read (made, on a new database) here, on this thread's connection:
        # describe_workers reads it from worker threads, which must not be the first to write.
        statistics_namespace()
        try:
            description |= async_to_sync(describe_workers)(prepared, None)
            workers_unavailable = None
        except redis.RedisError as exc:  # the token view needs no Redis; the workers do
            workers_unavailable = f"Redis did not answer ({exc})"
        if options["json"]:
            self.stdout.write(json.dumps(description))
            return
        self.stdout.write(f"model          {description['model']} ({description['model_type']})")
        self.stdout.write(f"family         {description['family'] or 'outside the support matrix'}")
        self.stdout.write(f"image counts   {description['count_source'] or 'no images'}")
        self.stdout.write(
            f"prompt tokens  {description['prompt_tokens']} (routed on {description['routed_tokens']})"
        )
        self.stdout.write(
            f"block size     {description['block_size']}, {description['total_blocks']} blocks, "
            f"{len(description['block_hashes'])} full"
        )
        if salt is None:
            partition = "none: the shared pool"
        else:
            partition = " and ".join(
                ([f"tenant {caller.tenant_name!r}"] if caller.partition is not None else [])
                + (["the body's cache_salt"] if chat.cache_salt is not None else [])
            )
        self.stdout.write(f"cache salt     {partition}")
        self.stdout.write(f"fallback       {description['fallback'] or 'none: exact image routing'}")
        for image in description["images"]:
            self.stdout.write(
                f"image {image['index']}        {image['identity']}  {image['width']}x{image['height']}  "
                f"{image['tokens']} tokens at {image['start']} ({image['count_source']})"
            )
        for video in description["videos"]:
            self.stdout.write(
                f"video {video['index']}        {video['identity']}  {video['width']}x{video['height']} "
                f"@ {video['fps']:g} fps: {video['frames_kept']} of {video['total_frames']} frames kept, "
                f"{video['tokens']} tokens at {video['start']}, {video['blocks']} blocks "
                f"({video['full_blocks']} wholly inside)"
            )
        self._write_workers(description, workers_unavailable)

    def _write_workers(self, description: dict[str, Any], unavailable: str | None) -> None:
        """The router's view of the workers: its choice, then one row per worker of the model."""
        if unavailable is not None:
            self.stdout.write(f"workers        unknown: {unavailable}")
            return
        candidates = description.get("candidates", [])
        choice = description.get("choice")
        total = description["total_blocks"]
        if not candidates:
            self.stdout.write("workers        none registered for this model")
            return
        if choice:
            self.stdout.write(
                f"choice         {choice['worker']}: {choice['overlap']}/{total} blocks cached "
                f"(best of any worker {choice['best_overlap']}; {choice['reason']})"
            )
        elif "choice" in description:
            self.stdout.write("choice         none: every eligible worker is busy")
        else:
            self.stdout.write("choice         none: no worker is eligible")
        header = f"  {'worker':<14} {'overlap':>9} {'prefill blk':>12} {'decode blk':>11} {'cost':>10}"
        self.stdout.write(header)
        for worker in candidates:
            name = worker["worker"]
            if "cost" not in worker:
                why = worker["ineligible_because"] or ("busy" if worker["busy"] else "not scored")
                self.stdout.write(f"  {name:<14} not eligible: {why}")
                continue
            self.stdout.write(
                f"  {name:<14} {worker['overlap']:>4}/{total:<4} {worker['prefill_blocks']:>12.2f} "
                f"{worker['decode_blocks']:>11.2f} {worker['cost']:>10.2f}"
                + ("  busy" if worker["busy"] else "")
            )
