"""What the frontend's own chain costs an API request: `/v1/*` through `ApiHandler` (the API's
middleware only, on the event loop) against the same request through Django's handler with the
whole `MIDDLEWARE` (the admin's browser stack, each synchronous middleware a thread hand-over
and back), in one process, interleaved.

Run: `.venv/bin/python bench/api_handler.py [--requests N] [--rounds N]`. The request is an
authenticated `GET /v1/models` driven straight into each ASGI app (no socket, no server), so
what differs between the two is the chain alone; a chat completion pays the same difference.
It uses a temporary SQLite database and the demo model (built into var/models/demo if absent),
and Redis at REDIS_URL (default redis://127.0.0.1:6379/14) under a namespace of its own: the key's
check keeps what it verified there. Both are removed afterwards. The last line is the summary:
    api_cpu_ms=<x.xx> full_cpu_ms=<x.xx> ratio=<x.xx>   (CPU per request, medians of the rounds)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.samples import demo_model_dir  # noqa: E402


def asgi_scope(path: str, key: str, method: str = "GET", body: bytes = b"") -> dict:
    """An authenticated HTTP scope for `path`, as a server would hand it over (benches share it)."""
    headers = [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {key}".encode())]
    if body:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def serve(app, scope: dict, body: bytes = b"") -> tuple[int, bytes]:
    """One request through an ASGI app: its status and its whole body."""
    status, chunks = 0, []
    body_sent = False
    answered = asyncio.Event()

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()  # as a server does: the client leaves once it has the answer
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                answered.set()

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def _cpu_ms_per_request(app, scope: dict, requests: int) -> float:
    started = time.process_time()  # every thread of the process: the hand-overs' threads count
    for _ in range(requests):
        status, _ = await serve(app, scope)
        if status != 200:
            raise RuntimeError(f"GET {scope['path']} answered {status}")
    return (time.process_time() - started) * 1000 / requests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="requests per chain per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-api-handler-") as scratch:
        redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
        namespace = f"bench:api:{uuid.uuid4().hex[:10]}:"
        try:
            return _measure(Path(scratch), redis_url, namespace, args.requests, args.rounds)
        finally:  # what the bench's key and its checks wrote, and nothing else
            client = redis.Redis.from_url(redis_url)
            for key in client.scan_iter(match=f"{namespace}*", count=1000):
                client.delete(key)


def _measure(scratch: Path, redis_url: str, namespace: str, requests: int, rounds: int) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "inference_platform.settings")
    os.environ["DATABASE_URL"] = f"sqlite:///{scratch / 'db.sqlite3'}"
    os.environ["REDIS_URL"] = redis_url
    os.environ["REDIS_KEY_PREFIX"] = namespace
    os.environ["MODEL_PATH"] = str(demo_model_dir())
    os.environ["LOG_LEVEL"] = "WARNING"

    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", interactive=False, verbosity=0)

    from django.core.asgi import get_asgi_application

    from inference_platform.api.handler import ApiHandler
    from tenants.keys import create_api_key
    from tenants.models import Tenant

    key = create_api_key(Tenant.objects.create(name="bench"), "bench")[1]
    chains = {"api": ApiHandler(), "full": get_asgi_application()}
    scope = asgi_scope("/v1/models", key)

    async def run() -> dict[str, list[float]]:
        for app in chains.values():  # warm both: imports, the model card, the first connection
            await _cpu_ms_per_request(app, scope, 20)
        figures: dict[str, list[float]] = {name: [] for name in chains}
        for _ in range(rounds):
            for name, app in chains.items():
                figures[name].append(await _cpu_ms_per_request(app, scope, requests))
        return figures

    figures = asyncio.run(run())
    api, full = statistics.median(figures["api"]), statistics.median(figures["full"])
    for name, values in figures.items():
        print(f"{name:5} CPU per request: median {statistics.median(values):.3f} ms over {rounds} "
              f"rounds of {requests} [{min(values):.3f}-{max(values):.3f}]")  # fmt: skip
    print(f"api_cpu_ms={api:.2f} full_cpu_ms={full:.2f} ratio={api / full:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
