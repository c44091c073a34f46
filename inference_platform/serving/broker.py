"""Putting a task on a worker's Celery queue from the frontend's event loop.

Celery's `send_task` costs about 0.9 ms of CPU a message on a 2-core machine (kombu's producer
and retry wrapper, a Redis client object made for each publish, the publish signals, a result
object nobody reads), and it blocks, so the frontend ran it in a thread (~0.1 ms more to hand it
there and back): together about a tenth of the frontend's CPU for a short chat request. On a Redis
broker, what it finally does is one LPUSH of a JSON envelope onto the queue's list.

`publish_task` keeps Celery's message and does that last step itself:
- the message is Celery's own: `app.amqp.create_task_message` makes the protocol-2 headers,
  properties and body as `send_task` does (the task id, `expires` as a date, the origin, the
  arguments' repr);
- the envelope is kombu's Redis transport's: the body JSON-serialized and base64-encoded, the
  delivery info (the anonymous exchange, the queue as routing key), a delivery tag, and the
  expiration in milliseconds as kombu's producer writes it;
- it goes onto the queue's list (under the broker's `global_keyprefix`) on the event loop's own
  connection to the broker, in one round trip; a connection the server dropped is tried once more
  on a fresh one, as `CELERY_TASK_PUBLISH_RETRY_POLICY` retries a publish once.

It is taken only where it is exactly what kombu would do:
- a plain `redis://` broker URL: a sentinel, a TLS broker, a Unix socket or a failover list go
  through `send_task` in a thread, as does a broker whose transport options ask for more than
  the key prefix and timeouts;
- JSON tasks of protocol 2, uncompressed, persistent, with no task routes or default priority
  (Celery's router could add options to a send) and no task-sent event asked for
  (monitoring's `task_send_sent_event`);
- no receiver of Celery's publish signals: an operator's tracing that adds headers to each task
  would otherwise be skipped.
tests/test_broker.py holds the envelope to `send_task`'s own and reads it back with kombu's
consumer.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import uuid
from typing import Any
from urllib.parse import urlsplit

from celery import signals
from django.conf import settings

from inference_platform.celery import app as celery_app
from inference_platform.serving.frontend import frontend

# The transport options the fast path reproduces (the key prefix) or that only bound its waits,
# which the loop's own connections take from the platform's settings (REDIS_TIMEOUT_SECS).
_OPTIONS_KEPT = {"global_keyprefix", "socket_timeout", "socket_connect_timeout"}


@functools.cache
def direct_broker_url() -> str | None:
    """The broker's URL where a task may be pushed straight onto its queue; None where only
    Celery's own publish does what the broker needs. Worked out once per process, as Celery
    reads its own configuration once (a look-up in Celery's configuration costs a few
    microseconds; tests that change it call `direct_broker_url.cache_clear()`)."""
    conf = celery_app.conf
    url = conf.broker_url or ""
    if urlsplit(url).scheme != "redis" or ";" in url or conf.get("broker_use_ssl"):
        return None
    if set(conf.broker_transport_options or {}) - _OPTIONS_KEPT:
        return None
    if conf.task_serializer != "json" or conf.task_compression or conf.task_protocol != 2:
        return None  # the envelope here is protocol 2's, its body plain JSON
    if conf.task_send_sent_event:
        return None  # monitoring (Flower) asked for a task-sent event at each send: Celery sends it
    if conf.task_routes or conf.task_default_priority is not None:
        return None  # Celery's router may add options (a priority: another list) to each send
    if conf.task_default_delivery_mode not in (2, "persistent"):
        return None  # the envelope says delivery mode 2
    return url


@functools.cache
def _queue_prefix() -> str:
    """The broker's key prefix, before each queue's name (kombu's `global_keyprefix`)."""
    return (celery_app.conf.broker_transport_options or {}).get("global_keyprefix", "")


def _publish_observed() -> bool:
    return bool(signals.before_task_publish.receivers or signals.after_task_publish.receivers)


def task_envelope(name: str, args: list[Any], queue: str, expires_s: float, argsrepr: str | None) -> bytes:
    """The message `send_task(name, args=args, queue=queue, expires=expires_s)` would push onto
    a Redis broker's list for `queue`, as bytes."""
    task_id = str(uuid.uuid4())
    headers, properties, body, _sent_event = celery_app.amqp.create_task_message(
        task_id,
        name,
        args,
        {},
        expires=expires_s,
        reply_to=celery_app.thread_oid,
        argsrepr=argsrepr,
        kwargsrepr="{}",
        ignore_result=None,  # send_task's default: the app's task_ignore_result decides
    )
    properties.update(
        argsrepr=argsrepr,
        kwargsrepr="{}",
        delivery_mode=2,
        expiration=str(int(expires_s * 1000)),
        delivery_info={"exchange": "", "routing_key": queue},
        priority=0,
        body_encoding="base64",
        delivery_tag=str(uuid.uuid4()),
    )
    envelope = {
        "body": base64.b64encode(json.dumps(body).encode()).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": properties,
    }
    return json.dumps(envelope).encode()


def push_with_state(
    name: str, args: list[Any], *, queue: str, expires_s: float, argsrepr: str | None = None
) -> tuple[str, str, bytes] | None:
    """The one command `publish_task` would send for this task (the LPUSH of its envelope), for a
    caller to send in one round trip with commands of its own on the platform's Redis: only where
    the broker is that Redis (CELERY_BROKER_URL is REDIS_URL, the default) and the push is direct.
    None otherwise: the caller sends its commands, then `publish_task`."""
    url = direct_broker_url()
    if url is None or url != settings.REDIS_URL or _publish_observed():
        return None
    return _push(name, args, queue, expires_s, argsrepr)


def _push(
    name: str, args: list[Any], queue: str, expires_s: float, argsrepr: str | None
) -> tuple[str, str, bytes]:
    """The LPUSH of the task's envelope onto the queue's list (under the broker's key prefix)."""
    return ("LPUSH", f"{_queue_prefix()}{queue}", task_envelope(name, args, queue, expires_s, argsrepr))


async def publish_task(
    name: str, args: list[Any], *, queue: str, expires_s: float, argsrepr: str | None = None
) -> None:
    """Put task `name` with `args` on `queue`, to expire unstarted after `expires_s`. Raises what
    the broker's connection raised (redis.RedisError, or Celery's and kombu's own errors on the
    slow path)."""
    url = direct_broker_url()
    if url is None or _publish_observed():
        await asyncio.to_thread(
            celery_app.send_task,
            name,
            args=args,
            argsrepr=argsrepr,
            kwargsrepr="{}",
            queue=queue,
            expires=expires_s,
        )
        return
    await frontend().redis_lines(url).execute(*_push(name, args, queue, expires_s, argsrepr))
