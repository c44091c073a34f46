"""Broker memory under 16 concurrent image requests: image bytes inside the Celery message (base64,
as before the media side store) against references to the side store, measured in one run on a
private redis-server.

Each request is what the frontend queues for one chat request with one 1.5 MB image: the real
`GenerateTask`, sent by the real Celery app to a worker queue nobody consumes (the state while 16
requests wait for a busy worker). Printed: the bytes the broker's queue holds, and the growth of
Redis' whole used memory (the side store lives in the same Redis: its raw bytes are counted too).

Run: .venv/bin/python bench/broker_memory.py [--requests 16] [--image-kb 1500]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import random
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from the repo root

from tests.platform_harness import PrivateRedis  # noqa: E402


def _images(count: int, kilobytes: int) -> list[bytes]:
    """Distinct noise PNGs (incompressible: the size is what travels)."""
    from PIL import Image

    side = int((kilobytes * 1024 / 3) ** 0.5)
    images = []
    for i in range(count):
        picture = Image.frombytes("RGB", (side, side), random.Random(i).randbytes(side * side * 3))
        buffer = io.BytesIO()
        picture.save(buffer, "PNG", compress_level=1)
        images.append(buffer.getvalue())
    return images


def _queue_bytes(client, queue_key: str) -> int:
    return sum(len(item) for item in client.lrange(queue_key, 0, -1))


def _used_memory(client) -> int:
    return int(client.info("memory")["used_memory"])


def _measure(client, namespace: str, images: list[bytes], *, by_reference: bool) -> tuple[int, int]:
    from django.conf import settings

    from inference_platform.celery import app as celery_app
    from routing.contract.tasks import GenerateTask, ImageRef
    from routing.media.store import media_store_from_settings

    client.flushdb()
    time.sleep(0.2)
    before = _used_memory(client)
    store = media_store_from_settings(client, namespace, settings)

    def send(image: bytes) -> None:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        if by_reference:
            ref = store.put(request_id, image)
            picture = ImageRef(identity="0" * 32, width=1, height=1, **ref.to_payload())
        else:
            picture = ImageRef(
                identity="0" * 32, width=1, height=1, data_b64=base64.b64encode(image).decode()
            )
        task = GenerateTask(
            request_id=request_id, prompt="<image> What is it?", max_tokens=8, images=(picture,)
        )
        celery_app.send_task(task.name, args=[task.to_payload()], queue="worker.nobody")

    with ThreadPoolExecutor(max_workers=len(images)) as pool:  # 16 frontends' requests at once
        list(pool.map(send, images))
    queued = _queue_bytes(client, f"{namespace}worker.nobody")
    return queued, _used_memory(client) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--image-kb", type=int, default=1500)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        server = PrivateRedis(directory)  # empty, no persistence: its memory is the bench's alone
        try:
            url = server.url
            os.environ.update(
                DJANGO_SETTINGS_MODULE="inference_platform.settings",
                REDIS_URL=url,
                CELERY_BROKER_URL=url,
                REDIS_KEY_PREFIX="bench:",
                MEDIA_STORE_MAX_TOTAL_MB="4096",
            )
            import django

            django.setup()
            import redis

            client = redis.Redis.from_url(url)

            images = _images(args.requests, args.image_kb)
            total = sum(len(image) for image in images)
            print(f"{args.requests} concurrent requests, one image each, {total / 2**20:.1f} MiB of images")
            inline_queue, inline_memory = _measure(client, "bench:", images, by_reference=False)
            ref_queue, ref_memory = _measure(client, "bench:", images, by_reference=True)
            print(f"{'':24}{'queue bytes':>14}{'Redis memory growth':>22}")
            print(f"{'inline (baseline)':24}{inline_queue:>14,}{inline_memory:>22,}")
            print(f"{'side store':24}{ref_queue:>14,}{ref_memory:>22,}")
            print(f"broker queue: {inline_queue / max(ref_queue, 1):.0f}x smaller with the side store")
            print(f"Redis memory: {inline_memory / max(ref_memory, 1):.2f}x less with the side store")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
