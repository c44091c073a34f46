"""The frontend's own send of a task (inference_platform.serving.broker): the message Celery's
`send_task` would queue, pushed from the event loop, and read back by kombu's own consumer; and
`send_task` itself wherever the push would not be what Celery does."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Iterator
from datetime import datetime

import pytest
import redis
from celery import signals
from django.conf import settings

from inference_platform.celery import app as celery_app
from inference_platform.serving.broker import direct_broker_url, publish_task

NAME = "workers.generate"
PAYLOAD = {"request_id": "r-1", "prompt_token_ids": [1, 2, 3], "text": "héllo \u2603", "n": None}


@pytest.fixture
def queue() -> Iterator[str]:
    """A queue of the test's own; its list, and what Celery declared for it, are deleted after."""
    name = f"worker.broker-{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(settings.REDIS_URL)
    prefix = settings.REDIS_KEY_PREFIX
    client.delete(
        f"{prefix}{name}", f"{prefix}_kombu.binding.{name}", f"{prefix}_kombu.binding_permanent.{name}"
    )


@pytest.fixture
def broker_settings(monkeypatch) -> Iterator[dict]:
    """Celery's configuration, for a test to change: the push's choice is worked out afresh."""
    direct_broker_url.cache_clear()
    yield celery_app.conf
    monkeypatch.undo()
    direct_broker_url.cache_clear()


def _queued(queue: str) -> list[dict]:
    """The queue's messages, oldest first, taken off it."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    key = f"{settings.REDIS_KEY_PREFIX}{queue}"
    out = []
    while (raw := client.rpop(key)) is not None:
        out.append(json.loads(raw))
    return out


def _without_what_differs_per_send(message: dict) -> dict:
    """The message less its ids, its expiry instant and the sending thread's reply address."""
    headers = dict(message["headers"])
    properties = dict(message["properties"])
    for field in ("id", "root_id", "expires"):
        headers.pop(field)
    for field in ("correlation_id", "delivery_tag", "reply_to"):
        properties.pop(field)
    return {**message, "headers": headers, "properties": properties}


async def test_a_task_pushed_from_the_loop_is_the_message_send_task_queues(queue) -> None:
    assert direct_broker_url() == settings.CELERY_BROKER_URL  # the test broker takes the push

    # when the same task is sent both ways
    await publish_task(NAME, [PAYLOAD], queue=queue, expires_s=30, argsrepr="['r-1']")
    await asyncio.to_thread(
        celery_app.send_task,
        NAME,
        args=[PAYLOAD],
        argsrepr="['r-1']",
        kwargsrepr="{}",
        queue=queue,
        expires=30,
    )

    # then both messages are alike but for what differs at every send
    ours, celerys = _queued(queue)
    assert _without_what_differs_per_send(ours) == _without_what_differs_per_send(celerys)
    assert ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]
    assert ours["headers"]["id"] != celerys["headers"]["id"]
    expires = [datetime.fromisoformat(m["headers"]["expires"]) for m in (ours, celerys)]
    assert abs((expires[0] - expires[1]).total_seconds()) < 5
    args, kwargs, _embed = json.loads(base64.b64decode(ours["body"]))
    assert (args, kwargs) == ([PAYLOAD], {})


async def test_kombus_consumer_reads_the_pushed_task_as_celerys_worker_would(queue) -> None:
    # given a task pushed onto the queue
    await publish_task(NAME, [PAYLOAD], queue=queue, expires_s=30, argsrepr="['r-1']")

    # when kombu's Redis transport takes it off the queue, as a worker's consumer does
    def take():
        with celery_app.connection_for_read() as connection:
            message = connection.default_channel.basic_get(queue, no_ack=True)
            return message.headers, message.delivery_info, message.decode()

    headers, delivery, body = await asyncio.to_thread(take)

    # then it is the task, for this queue, with its arguments as sent
    assert headers["task"] == NAME and headers["argsrepr"] == "['r-1']"
    assert delivery["routing_key"] == queue
    assert body[0] == [PAYLOAD] and body[1] == {}


async def test_a_receiver_of_celerys_publish_signals_gets_every_send(queue) -> None:
    # given an operator's tracing, which stamps each task it sees published
    def stamp(headers=None, **_):
        headers["traceparent"] = "00-trace-span-01"

    signals.before_task_publish.connect(stamp, weak=False)
    try:
        # when a task is sent
        await publish_task(NAME, [PAYLOAD], queue=queue, expires_s=30, argsrepr="['r-1']")
    finally:
        signals.before_task_publish.disconnect(stamp)

    # then it went through Celery's own publish, and carries the stamp
    (message,) = _queued(queue)
    assert message["headers"]["traceparent"] == "00-trace-span-01"


@pytest.mark.parametrize(
    ("url", "options", "use_ssl"),
    [
        ("sentinel://127.0.0.1:26379", {}, None),
        ("rediss://127.0.0.1:6380/0", {}, None),
        ("redis+socket:///run/redis.sock", {}, None),
        ("redis://a:6379/0;redis://b:6379/0", {}, None),
        ("amqp://guest@127.0.0.1//", {}, None),
        ("redis://127.0.0.1:6379/0", {"priority_steps": [0, 5]}, None),
        ("redis://127.0.0.1:6379/0", {}, {"ssl_cert_reqs": "required"}),
    ],
)
def test_only_a_plain_redis_broker_takes_the_push(
    broker_settings, monkeypatch, url, options, use_ssl
) -> None:
    conf = broker_settings
    monkeypatch.setitem(conf, "broker_url", url)
    monkeypatch.setitem(conf, "broker_transport_options", {"global_keyprefix": "p:", **options})
    monkeypatch.setitem(conf, "broker_use_ssl", use_ssl)
    assert direct_broker_url() is None


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("task_serializer", "pickle"),
        ("task_compression", "gzip"),
        ("task_protocol", 1),
        ("task_send_sent_event", True),
        ("task_routes", {"workers.generate": {"priority": 5}}),
        ("task_default_priority", 3),
        ("task_default_delivery_mode", "transient"),
    ],
)
def test_a_message_the_push_would_not_write_as_celery_does_goes_through_celery(
    broker_settings, monkeypatch, setting, value
):
    assert direct_broker_url() is not None
    direct_broker_url.cache_clear()
    monkeypatch.setitem(broker_settings, setting, value)
    assert direct_broker_url() is None


def test_a_plain_redis_broker_with_its_prefix_and_timeouts_takes_the_push(
    broker_settings, monkeypatch
) -> None:
    conf = broker_settings
    monkeypatch.setitem(conf, "broker_url", "redis://:secret@127.0.0.1:6379/3")
    monkeypatch.setitem(conf, "broker_transport_options", {"global_keyprefix": "p:", "socket_timeout": 5.0})
    monkeypatch.setitem(conf, "broker_use_ssl", None)
    assert direct_broker_url() == "redis://:secret@127.0.0.1:6379/3"


def _sent_task():
    from routing.contract.tasks import GenerateTask

    return GenerateTask(request_id="r-send", prompt="Hi", max_tokens=1, follow_id=f"f-{uuid.uuid4().hex[:8]}")


def _mark_ttl_ms(follow_id: str) -> int:
    from routing.contract.responses import live_key

    client = redis.Redis.from_url(settings.REDIS_URL)
    key = live_key(settings.REDIS_KEY_PREFIX, follow_id)
    try:
        return client.pttl(key)
    finally:
        client.delete(key)


async def test_a_requests_mark_and_task_go_in_one_round_trip_where_the_broker_is_the_platforms_redis(
    counted_lines,
) -> None:
    from inference_platform.serving.dispatch import send_to_worker

    # given the default: the broker is the platform's Redis
    worker = f"broker-{uuid.uuid4().hex[:8]}"
    assert direct_broker_url() == settings.REDIS_URL
    task = _sent_task()

    # when the frontend sends a request's task to a worker
    await send_to_worker(worker, task)

    # then the liveness mark is set and the task queued, in one round trip, the mark first
    assert counted_lines == [("SET", "LPUSH")]
    assert 0 < _mark_ttl_ms(task.follow_id) <= settings.REQUEST_LIVENESS_TTL_SECS * 1000
    (message,) = _queued(f"worker.{worker}")
    assert json.loads(base64.b64decode(message["body"]))[0][0]["follow_id"] == task.follow_id


async def test_with_a_broker_of_its_own_the_mark_is_set_before_the_task_is_pushed_there(
    broker_settings, monkeypatch, counted_lines
) -> None:
    from inference_platform.serving.dispatch import send_to_worker

    # given a broker that is not the platform's Redis (another database of the test server)
    broker_url = settings.REDIS_URL.rsplit("/", 1)[0] + "/12"
    monkeypatch.setitem(broker_settings, "broker_url", broker_url)
    worker = f"broker-{uuid.uuid4().hex[:8]}"
    task = _sent_task()
    broker = redis.Redis.from_url(broker_url)
    queue_key = f"{settings.REDIS_KEY_PREFIX}worker.{worker}"
    try:
        # when the frontend sends a request's task
        await send_to_worker(worker, task)

        # then the mark went to the platform's Redis, then the task to the broker: two round trips
        assert counted_lines == [("SET",), ("LPUSH",)]
        assert _mark_ttl_ms(task.follow_id) > 0
        assert broker.llen(queue_key) == 1
    finally:
        broker.delete(
            queue_key,
            f"{settings.REDIS_KEY_PREFIX}_kombu.binding.worker.{worker}",
        )
