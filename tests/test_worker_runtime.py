"""The worker's side of one task: what reaches the response stream when an image fails there."""

from __future__ import annotations

import pytest

from routing.contract.responses import ERROR, parse_stream_entries, response_key
from routing.contract.tasks import CONTRACT_VERSION, GenerateTask, ImageRef
from tests.image_server import ImageServer


@pytest.fixture(scope="module")
def engine_and_loader(demo_model_dir):
    from django.conf import settings as django_settings

    from workers.engine import Engine
    from workers.runtime import build_image_loader

    django_settings.MEDIA_ALLOWED_HOSTS = ["127.0.0.1"]  # read once, when the loader is built
    try:
        loader = build_image_loader("w", stats=None)
    finally:
        django_settings.MEDIA_ALLOWED_HOSTS = []
    engine = Engine.load(demo_model_dir, load_image=loader.load_for_engine, worker_name="w")
    yield engine, loader
    loader.close()


def test_an_origin_failing_when_the_worker_fetches_is_a_4xx_naming_the_image(
    engine_and_loader, redis_client, key_namespace
):
    from workers.runtime import WorkerRuntime

    engine, loader = engine_and_loader
    runtime = WorkerRuntime(
        name="w", engine=engine, client=redis_client, namespace=key_namespace, image_loader=loader
    )
    with ImageServer() as origin:
        url = origin.url("/gone.png")  # the origin answers 404: the image went away since routing
        runtime.serve(
            {
                "request_id": "r-gone",
                "prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n",
                "images": [{"identity": "0" * 32, "url": url}],
                "max_tokens": 2,
                "temperature": 0.0,
                "top_p": 1.0,
                "contract_version": CONTRACT_VERSION,
            }
        )
    events = parse_stream_entries(redis_client.xrange(response_key(key_namespace, "r-gone")))
    error = next(event for event in events if event.type == ERROR)
    assert error.data["status"] == 400
    assert error.data["code"] == "origin_error"
    assert "404" in error.data["message"]


@pytest.mark.parametrize("version", [None, 1, 99], ids=["no-version", "older", "newer"])
def test_a_task_in_a_contract_version_the_worker_does_not_speak_is_refused_naming_both(
    engine_and_loader, redis_client, key_namespace, version
):
    # given a worker and a task payload written by a frontend of another contract version
    from workers.runtime import WorkerRuntime

    engine, _loader = engine_and_loader
    runtime = WorkerRuntime(name="w", engine=engine, client=redis_client, namespace=key_namespace)
    payload = GenerateTask(request_id="r-old", prompt="Hi", max_tokens=2).to_payload()
    if version is None:
        del payload["contract_version"]
    else:
        payload["contract_version"] = version

    # when the worker is handed it
    runtime.serve(payload)

    # then the request's stream says why, and nothing was generated
    events = parse_stream_entries(redis_client.xrange(response_key(key_namespace, "r-old")))
    assert [event.type for event in events] == [ERROR]
    error = events[0].event
    assert error.status == 503 and error.code == "unsupported_contract_version"
    assert f"contract version {version!r}" in error.message
    assert str(CONTRACT_VERSION) in error.message and "worker w" in error.message


def test_an_image_reference_whose_bytes_are_gone_is_a_clear_error_at_once(
    engine_and_loader, redis_client, key_namespace
):
    import time

    from routing.media.store import MediaStore
    from workers.runtime import WorkerRuntime

    # given a reference the frontend released (or that expired) before the worker got to it
    engine, loader = engine_and_loader
    store = MediaStore(redis_client, key_namespace)
    runtime = WorkerRuntime(
        name="w",
        engine=engine,
        client=redis_client,
        namespace=key_namespace,
        image_loader=loader,
        media=store,
    )
    ref = store.put("r-expired", b"\x89PNG\r\n\x1a\n....")
    store.release("r-expired", [ref])
    # when the worker serves the task
    started = time.monotonic()
    runtime.serve(
        GenerateTask(
            request_id="r-expired",
            prompt="<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n",
            images=(ImageRef(identity="0" * 32, **ref.to_payload()),),
            max_tokens=2,
        ).to_payload()
    )
    # then the client learns why, without a wait
    assert time.monotonic() - started < 2.0
    events = parse_stream_entries(redis_client.xrange(response_key(key_namespace, "r-expired")))
    error = next(event for event in events if event.type == ERROR).event
    assert (error.status, error.code) == (503, "media_missing")
    assert "no longer stored" in error.message


def test_a_worker_refusing_an_origin_the_frontend_allowed_names_the_image_and_how_to_allow_it(
    engine_and_loader, redis_client, key_namespace, monkeypatch
):
    """MEDIA_ALLOWED_HOSTS set on the frontend only: the worker's refusal carries the frontend's
    context (which image, the setting and where to set it), not less."""
    from workers.runtime import WorkerRuntime, build_image_loader

    # given a worker whose loader has no allowlist (the frontend's had one and sent the URL on)
    engine, _ = engine_and_loader
    strict_loader = build_image_loader("w", stats=None)
    monkeypatch.setattr(engine, "_load_image", strict_loader.load_for_engine)
    runtime = WorkerRuntime(
        name="w", engine=engine, client=redis_client, namespace=key_namespace, image_loader=strict_loader
    )
    # when it is asked to fetch an image from a loopback origin
    try:
        with ImageServer() as origin:
            runtime.serve(
                {
                    "request_id": "r-loopback",
                    "prompt": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n",
                    "images": [{"identity": "0" * 32, "url": origin.url("/a.png")}],
                    "max_tokens": 2,
                    "temperature": 0.0,
                    "top_p": 1.0,
                    "contract_version": CONTRACT_VERSION,
                }
            )
    finally:
        strict_loader.close()
    # then the refusal names the image, the setting and both places it must be set
    events = parse_stream_entries(redis_client.xrange(response_key(key_namespace, "r-loopback")))
    error = next(event for event in events if event.type == ERROR)
    assert (error.data["status"], error.data["code"]) == (403, "address_refused")
    assert error.data["image_index"] == 0
    assert error.data["message"].startswith("image 0: ")
    assert "MEDIA_ALLOWED_HOSTS" in error.data["message"]
    assert "API server and of every worker" in error.data["message"]
