"""`manage.py flush_caches` against a real worker process, its KV index and the shared image cache."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import httpx
import pytest
from PIL import Image

from routing.kv.index import KvIndex
from tests.conftest import LONE_WORKER
from tests.image_server import ImageServer
from tests.platform_harness import REPO


def flush(platform, *args: str) -> dict:
    """The command as an operator runs it: in a shell that knows nothing of the workers' caches."""
    env = {k: v for k, v in platform.env.items() if not k.startswith("DYN_MM_SHARED_IMAGE_CACHE")}
    return json.loads(platform.manage("flush_caches", "--json", *args, env=env).strip().splitlines()[-1])


def test_flush_caches_drops_kv_embeddings_images_and_shared_images_and_dry_run_changes_nothing(
    lone_frontend,
):
    # given the session's lone worker, its caches emptied first (other tests may have used it),
    # and its frontend
    platform = lone_frontend
    shared_prefix = platform.env["SHARED_IMAGE_CACHE_KEY_PREFIX"]
    flush(platform)
    base_url = platform.base_url
    buffer = io.BytesIO()
    Image.effect_noise((200, 150), 50).convert("RGB").save(buffer, format="PNG")
    with ImageServer() as origin:
        url = origin.add("/photo.png", buffer.getvalue(), content_type="image/png")
        body = {
            "model": "demo",
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this photo?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
        }
        assert (
            httpx.post(
                f"{base_url}/v1/chat/completions", json=body, headers=platform.headers, timeout=60
            ).status_code
            == 200
        )

    index = KvIndex(platform.redis, platform.namespace)
    blocks = index.worker_blocks(LONE_WORKER)
    assert blocks
    assert list(platform.redis.scan_iter(match=f"{shared_prefix}*"))

    # given a dry run, then the scoped flush: nothing of the KV cache moves
    dry = flush(platform, "--dry-run")
    assert dry["workers"][LONE_WORKER]["kv_blocks"] == len(blocks)
    assert dry["workers"][LONE_WORKER]["decoded_images"] == 1
    assert dry["workers"][LONE_WORKER]["embeddings"] == 1  # the photo's vision-encoder output
    # the workers' shared cache is found although this shell's environment does not enable it
    assert dry["shared_images"] == 1
    scoped = flush(platform, "--scope", "session-123", "--tenant", "harness")
    assert "kv_blocks" not in scoped["workers"][LONE_WORKER]
    assert index.worker_blocks(LONE_WORKER) == blocks
    assert list(platform.redis.scan_iter(match=f"{shared_prefix}*"))

    # when flushed for real
    flushed = flush(platform)

    # then every cache of the worker is empty, and the index learnt it through the KV events
    assert flushed["workers"][LONE_WORKER]["kv_blocks"] == len(blocks)
    assert flushed["workers"][LONE_WORKER]["decoded_images"] == 1
    assert flushed["workers"][LONE_WORKER]["embeddings"] == 1
    assert flushed["shared_images"] == 1
    assert index.worker_blocks(LONE_WORKER) == set()
    assert not list(platform.redis.scan_iter(match=f"{shared_prefix}*"))
    after = flush(platform, "--dry-run")["workers"][LONE_WORKER]
    assert (after["kv_blocks"], after["embeddings"], after["decoded_images"]) == (0, 0, 0)


def test_flush_caches_refuses_a_worker_that_is_not_live(platform_processes):
    platform = platform_processes()
    done = subprocess.run(
        [sys.executable, "manage.py", "flush_caches", "--worker", "nobody"],
        cwd=REPO,
        env=platform.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "not live: nobody" in done.stderr


def test_flush_caches_says_plainly_when_there_is_nothing_to_flush(platform_processes):
    platform = platform_processes()
    printed = platform.manage("flush_caches", "--dry-run")
    assert printed.strip() == "no live worker: nothing to flush (the caches live in the workers)"


@pytest.mark.django_db
def test_a_worker_that_is_not_live_is_refused_naming_the_live_set_the_router_reads(redis_client, settings):
    """Heartbeats with no process behind them (fault injection): the command reads the live set."""
    from django.core.management import CommandError, call_command

    from routing.fleet.registry import Heartbeat, WorkerRegistry
    from routing.models import Worker

    # given two registered workers with fresh heartbeats
    registry = WorkerRegistry(redis_client, settings.REDIS_KEY_PREFIX)
    for name in ("alpha", "beta"):
        Worker.objects.create(name=name, model_name="demo")
        registry.beat(Heartbeat(name=name, model="demo", block_size=16), 30)
    try:
        # when an operator names a worker that does not exist
        with pytest.raises(CommandError) as refused:
            call_command("flush_caches", "--dry-run", "--worker", "nope")
    finally:
        registry.remove("alpha")
        registry.remove("beta")
    # then the command names the live workers, as the router sees them, not "none"
    assert "not live: nope (live workers: alpha, beta)" in str(refused.value)


@pytest.mark.django_db
def test_with_model_only_that_models_workers_are_flushed(redis_client, settings):
    """Heartbeats with no process behind them (fault injection): the command reads the live set."""
    from django.core.management import CommandError, call_command

    from routing.fleet.registry import Heartbeat, WorkerRegistry
    from routing.models import Worker

    # given a live worker of each of two models
    registry = WorkerRegistry(redis_client, settings.REDIS_KEY_PREFIX)
    for name, model in (("small0", "small-vlm"), ("large0", "large-vlm")):
        Worker.objects.create(name=name, model_name=model)
        registry.beat(Heartbeat(name=name, model=model, block_size=16), 30)
    try:
        # when an operator flushes one model's caches, naming the other model's worker
        with pytest.raises(CommandError) as refused:
            call_command("flush_caches", "--dry-run", "--model", "small-vlm", "--worker", "large0")
    finally:
        registry.remove("small0")
        registry.remove("large0")
    # then only the model's workers count as the live set
    assert "not live: large0 (live workers: small0)" in str(refused.value)
