"""Several models behind one endpoint: does a second model's pool slow the first's routing?

Two configurations on the real Redis, each in a namespace of its own: one model with 32 workers,
and two models with 32 workers each. Every request is for the first model. Timed, per request:
from eligibility (the model's workers' rows and heartbeats: `eligible_workers`) to the
reservation (`areserve_worker`: the atomic decide-and-reserve), as `ServedRequest` runs them;
the lease is released untimed. The two configurations are interleaved, request by request, so a
shared machine's load falls on both alike. Also counted: the heartbeat keys read per request.

Run: `.venv/bin/python bench/models.py` (REDIS_URL, default redis://127.0.0.1:6379/14; a scratch
SQLite database). It deletes every key it wrote. The last line is the summary (ratio <= 1.1 is
issue 37's bar).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WORKERS_PER_MODEL = 32
REQUESTS = 400  # per configuration
BLOCK_SIZE = 16
PROMPT_TOKENS = 1_024
PROMPTS = 64  # cached prompts, a few per worker


def main() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="bench-models-"))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    os.environ["DATABASE_URL"] = f"sqlite:///{scratch / 'db.sqlite3'}"
    os.environ["REDIS_URL"] = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    os.environ["LOG_LEVEL"] = "WARNING"
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    asyncio.run(_bench())


async def _bench() -> None:
    import redis
    from django.conf import settings

    from inference_platform.serving import dispatch
    from inference_platform.serving.frontend import frontend
    from inference_platform.serving.prepare import PreparedRequest, areserve_worker
    from routing.contract.kv_events import KvEvent
    from routing.fleet.registry import Heartbeat, WorkerRegistry
    from routing.fleet.worker_rows import WorkerRow, announce_change, current_generation, kept_rows
    from routing.kv.events import KvEventPublisher
    from routing.prompt.token_view import build_token_view

    client = redis.Redis.from_url(settings.REDIS_URL)
    rng = random.Random(37)
    prompts = [[rng.randrange(4_000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    fingerprints = {"first": "a" * 32, "second": "b" * 32}

    class Configuration:
        def __init__(self, label: str, models: tuple[str, ...]) -> None:
            self.label = label
            self.namespace = f"bench:models:{uuid.uuid4().hex[:8]}:"
            self.rows = tuple(
                WorkerRow(f"{model}{n}", True, False, model)
                for model in models
                for n in range(WORKERS_PER_MODEL)
            )
            registry = WorkerRegistry(client, self.namespace)
            for row in self.rows:
                beat = Heartbeat(
                    name=row.name,
                    model=row.model_name,
                    block_size=BLOCK_SIZE,
                    fingerprint=fingerprints[row.model_name],
                    kv_capacity_blocks=4_096,
                    kv_blocks_free=4_096,
                    instance=uuid.uuid4().hex[:16],
                )
                registry.beat(beat, 600)
            announce_change(client, self.namespace)
            self.generation = current_generation(client, self.namespace)
            # Each worker holds a few prompts, in the first model's partition.
            with_settings(self.namespace)
            publisher = KvEventPublisher(client, self.namespace, index=frontend().router().index)
            for i, row in enumerate(self.rows):
                held = [self.view(p) for p in range(i % PROMPTS, PROMPTS, WORKERS_PER_MODEL)]
                publisher.publish([KvEvent("stored", row.name, tuple(v.block_hashes)) for v in held])
            self.seconds: list[float] = []

        @staticmethod
        def view(p: int):
            view = build_token_view(prompts[p], [], layout=None, placeholder_id=None, block_size=BLOCK_SIZE)
            return view.of_model(fingerprints["first"])

        async def decide(self, n: int) -> None:
            with_settings(self.namespace)
            kept_rows().put(self.generation, self.rows)  # what a frontend keeps between requests
            prepared = PreparedRequest(None, None, "", [], self.view(n % PROMPTS), False)  # type: ignore[arg-type]
            started = time.perf_counter()
            workers = await dispatch.eligible_workers("first", BLOCK_SIZE, fingerprints["first"])
            lease = await areserve_worker(prepared, workers, None, f"bench-{n}")
            self.seconds.append(time.perf_counter() - started)
            assert len(workers) == WORKERS_PER_MODEL and lease.worker.startswith("first")
            lease.release("bench")

    def with_settings(namespace: str) -> None:
        settings.REDIS_KEY_PREFIX = namespace

    configurations = [
        Configuration("1 model x 32", ("first",)),
        Configuration("2 models x 32", ("first", "second")),
    ]
    read: list[int] = []
    real_mget = redis.Redis.mget

    def counting_mget(self, keys, *args):
        read.append(sum(1 for k in keys if b":hb:" in (k if isinstance(k, bytes) else k.encode())))
        return real_mget(self, keys, *args)

    redis.Redis.mget = counting_mget  # type: ignore[method-assign]
    try:
        for config in configurations:  # warm: collaborators built, scripts loaded
            for n in range(20):
                await config.decide(n)
            config.seconds.clear()
        read.clear()
        for n in range(REQUESTS):
            for config in configurations if n % 2 == 0 else reversed(configurations):
                await config.decide(n)
    finally:
        redis.Redis.mget = real_mget  # type: ignore[method-assign]
        for config in configurations:
            for key in client.scan_iter(match=f"{config.namespace}*", count=1000):
                client.delete(key)

    for config in configurations:
        ms = sorted(s * 1000 for s in config.seconds)
        print(
            f"{config.label:>14}: eligibility to reservation median {statistics.median(ms):.3f} ms, "
            f"p90 {ms[int(len(ms) * 0.9)]:.3f} ms ({len(ms)} requests)"
        )
    one, two = (statistics.median(c.seconds) for c in configurations)
    print(f"heartbeat keys read per request: {sorted(set(read))} (the model's {WORKERS_PER_MODEL} workers)")
    print(f"summary: 2 models x 32 / 1 model x 32 routing time (median) = {two / one:.3f} (bar: <= 1.1)")


if __name__ == "__main__":
    main()
