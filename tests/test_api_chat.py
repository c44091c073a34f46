"""The chat API's answers to bad input and failing workers, in OpenAI's error format.

These run the real view in-process against the real Redis; workers that never answer or
vanish are fault injections (a heartbeat with no process behind it), and say so in their names.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import threading
import time

import pytest
import redis
from django.conf import settings as django_settings
from django.test import AsyncClient

from routing.contract.responses import ERROR, STARTED, TOKEN, ResponseEvent, ResponseWriter
from routing.contract.tasks import ENGINE_DEAD, DoneEvent, ErrorEvent, TokenEvent
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.kv.load import LoadTracker
from routing.models import Worker
from tests.api_client import KeyedAsyncClient

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def served_demo_model(served_demo_model, settings):
    settings.REQUEST_FIRST_TOKEN_TIMEOUT_SECS = 2.0
    return served_demo_model


@pytest.fixture
def client(api_headers) -> AsyncClient:
    return KeyedAsyncClient(api_headers)


@pytest.fixture
def ghost_worker(served_demo_model):
    """A registered worker with a heartbeat but no process: it never takes its tasks (fault injection)."""
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    registry = WorkerRegistry(conn, django_settings.REDIS_KEY_PREFIX)
    Worker.objects.create(name="ghost", model_name=served_demo_model)
    registry.beat(
        Heartbeat(name="ghost", model=served_demo_model, block_size=django_settings.KV_BLOCK_SIZE), 30
    )
    conn.delete(f"{django_settings.REDIS_KEY_PREFIX}worker.ghost")  # tasks earlier tests left unanswered
    yield registry
    registry.remove("ghost")
    conn.delete(f"{django_settings.REDIS_KEY_PREFIX}worker.ghost")


def chat_body(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **extra}


async def post(client: AsyncClient, body) -> tuple[int, dict, object]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await client.post("/v1/chat/completions", data=raw, content_type="application/json")
    return response.status_code, json.loads(response.content), response


def assert_openai_error(body: dict, *, code: str, param: str | None = None) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


async def test_invalid_json_is_a_400_with_the_request_id(client):
    status, body, response = await post(client, b"{not json")
    assert status == 400
    assert_openai_error(body, code="invalid_json")
    assert body["error"]["type"] == "invalid_request_error"
    assert response["X-Request-Id"].startswith("chatcmpl-")


async def test_a_body_that_is_not_an_object_is_a_400(client):
    status, body, _ = await post(client, [1, 2])
    assert status == 400
    assert_openai_error(body, code="invalid_json")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"model": None}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].image_url.url",
        ),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("-inf")}, "top_p"),
        ({"seed": -5}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"stream": "yes"}, "stream"),
        ({"n": 2}, "n"),
    ],
)
async def test_each_invalid_field_is_a_400_naming_it(client, served_demo_model, change, param):
    body = {**chat_body(served_demo_model), **change}
    body = {k: v for k, v in body.items() if v is not None}
    status, payload, _ = await post(client, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param
    assert payload["error"]["type"] == "invalid_request_error"


async def test_an_unknown_model_is_a_404(client):
    status, body, _ = await post(client, chat_body("gpt-17"))
    assert status == 404
    assert_openai_error(body, code="model_not_found", param="model")
    assert "gpt-17" in body["error"]["message"]


async def test_get_on_chat_completions_is_a_405(client):
    response = await client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert_openai_error(json.loads(response.content), code="method_not_allowed")


async def test_an_unknown_api_path_is_a_json_404(client):
    response = await client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert_openai_error(json.loads(response.content), code="not_found")


async def test_models_lists_the_served_model(client, served_demo_model):
    response = await client.get("/v1/models")
    assert response.status_code == 200
    assert [m["id"] for m in json.loads(response.content)["data"]] == [served_demo_model]


async def test_no_live_worker_is_a_503(client, served_demo_model):
    status, body, response = await post(client, chat_body(served_demo_model))
    assert status == 503
    assert_openai_error(body, code="no_live_worker")
    assert body["error"]["type"] == "server_error"
    assert response["X-Request-Id"] in body["error"]["message"]
    assert int(response["Retry-After"]) > 0  # a worker starting or restarting helps


async def test_a_disabled_or_draining_worker_receives_nothing(client, served_demo_model, ghost_worker):
    await Worker.objects.filter(name="ghost").aupdate(draining=True)
    status, body, response = await post(client, chat_body(served_demo_model))
    assert status == 503 and response["Retry-After"]
    assert body["error"]["code"] == "no_worker_accepting"
    assert "ghost draining" in body["error"]["message"]
    await Worker.objects.filter(name="ghost").aupdate(draining=False, enabled=False)
    status, body, _ = await post(client, chat_body(served_demo_model))
    assert status == 503
    assert body["error"]["code"] == "no_worker_accepting"
    assert "ghost disabled in the admin" in body["error"]["message"]


def _disable_as_another_process_would(name: str) -> None:
    """The row changed and the generation renewed, as another frontend's admin does: without this
    process's own signal, which would make it forget its read at once."""
    from django.db import connection

    from routing.fleet.worker_rows import announce_change

    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {Worker._meta.db_table} SET enabled = %s WHERE name = %s", [False, name])
    announce_change(redis.Redis.from_url(django_settings.REDIS_URL), django_settings.REDIS_KEY_PREFIX)


async def test_a_worker_disabled_elsewhere_after_this_frontends_last_read_receives_nothing(
    client, served_demo_model, ghost_worker
):
    # given: this frontend read the fleet with the ghost eligible (the read a request uses
    # without checking the rows' generation itself: its decision checks it)
    from asgiref.sync import sync_to_async

    from inference_platform.serving.dispatch import eligible_workers

    assert "ghost" in await eligible_workers(served_demo_model, django_settings.KV_BLOCK_SIZE)

    # when: another process disables it, then a request comes
    await sync_to_async(_disable_as_another_process_would)("ghost")
    status, body, _ = await post(client, chat_body(served_demo_model))

    # then: the decision saw the generation move, read again, and sent nothing to the ghost
    assert status == 503
    assert body["error"]["code"] == "no_worker_accepting"
    assert "ghost disabled in the admin" in body["error"]["message"]
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    assert conn.llen(f"{django_settings.REDIS_KEY_PREFIX}worker.ghost") == 0


async def test_a_worker_that_never_answers_fault_injected_is_a_504_with_the_request_id(
    client, served_demo_model, ghost_worker
):
    started = time.monotonic()
    status, body, response = await post(client, chat_body(served_demo_model))
    assert status == 504
    assert_openai_error(body, code="worker_timeout")
    assert response["X-Request-Id"] in body["error"]["message"]
    assert response["X-Routed-Worker"] == "ghost"
    assert time.monotonic() - started < 10


async def test_a_worker_that_vanishes_before_starting_fault_injected_is_a_503(
    client, served_demo_model, ghost_worker
):
    def vanish() -> None:
        # once the task is in the ghost's queue (sent to it), not after a time a loaded machine
        # may overrun before sending
        conn = redis.Redis.from_url(django_settings.REDIS_URL)
        queue = f"{django_settings.REDIS_KEY_PREFIX}worker.ghost"
        deadline = time.monotonic() + 30
        while not conn.llen(queue) and time.monotonic() < deadline:
            time.sleep(0.01)
        ghost_worker.remove("ghost")

    threading.Thread(target=vanish).start()
    status, body, response = await post(client, chat_body(served_demo_model))
    assert status == 503
    assert_openai_error(body, code="worker_vanished")
    assert response["X-Request-Id"] in body["error"]["message"]


async def answer_ghost_tasks(
    count: int, deadline_s: float, *, workers: tuple[str, ...] = ("ghost",), answers=(), **error
) -> list[str]:
    """Answer the next `count` tasks queued for the `workers` as a worker that failed them with
    `error`, or with the next of `answers` (an event each, in turn) while they last; the task
    ids, in order (only known once queued: read from the broker's message)."""
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    prefix = django_settings.REDIS_KEY_PREFIX
    answers = list(answers)
    task_ids: list[str] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline and len(task_ids) < count:
        for worker in workers:
            raw = conn.rpop(f"{prefix}worker.{worker}")
            if raw:
                args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
                task_ids.append(args[0]["request_id"])
                writer = ResponseWriter(conn, prefix, task_ids[-1])
                writer.send(STARTED, worker=worker)
                if answers:
                    writer.emit(answers.pop(0))
                else:
                    writer.send(ERROR, **error)
        await asyncio.sleep(0.02)
    return task_ids


@pytest.fixture
def second_ghost(ghost_worker, served_demo_model):
    """Another worker with a heartbeat and no process, whose queue the test reads."""
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    Worker.objects.create(name="phantom", model_name=served_demo_model)
    ghost_worker.beat(
        Heartbeat(name="phantom", model=served_demo_model, block_size=django_settings.KV_BLOCK_SIZE), 30
    )
    conn.delete(f"{django_settings.REDIS_KEY_PREFIX}worker.phantom")
    yield "phantom"
    ghost_worker.remove("phantom")
    conn.delete(f"{django_settings.REDIS_KEY_PREFIX}worker.phantom")


async def test_a_request_whose_workers_engine_died_fault_injected_is_answered_by_another(
    client, served_demo_model, ghost_worker, second_ghost
):
    """Each ghost is read by the test. The first to get the request answers as a worker whose
    engine died under it (vLLM's engine core, say): the frontend takes that worker for gone and
    sends the request on, as `<id>-m1`, to the other, which answers it."""
    died = ErrorEvent(status=503, code=ENGINE_DEAD, message="vLLM's engine core died")
    answered = DoneEvent(text="Hi there", prompt_tokens=9, completion_tokens=2)
    answering = asyncio.ensure_future(
        answer_ghost_tasks(2, 8, workers=("ghost", second_ghost), answers=[died, answered])
    )
    status, body, response = await post(client, chat_body(served_demo_model))
    assert status == 200, body
    request_id = response["X-Request-Id"]
    assert await answering == [request_id, f"{request_id}-m1"]
    assert response["X-Routed-Worker"] in ("ghost", second_ghost)
    assert body["choices"][0]["message"]["content"] == "Hi there"


async def test_a_request_whose_only_workers_engine_died_fault_injected_is_a_502_with_the_request_id(
    client, served_demo_model, ghost_worker
):
    answering = asyncio.ensure_future(
        answer_ghost_tasks(1, 5, status=503, code=ENGINE_DEAD, message="vLLM's engine core died")
    )
    status, body, response = await post(client, chat_body(served_demo_model))
    assert len(await answering) == 1
    # then: answered as a worker that stopped before answering, there being no other to go to
    assert status == 502
    assert_openai_error(body, code="worker_vanished")
    assert response["X-Request-Id"] in body["error"]["message"]


async def test_a_picture_that_changes_twice_fault_injected_is_planned_again_once_then_a_409(
    client, served_demo_model, ghost_worker
):
    """The ghost answers every task it is sent as a worker that found the request's picture
    changed at its origin: the first answer makes the frontend plan the request again under
    `<id>-r1`; the second reaches the client, and the reservation is freed once, not left."""
    answering = asyncio.ensure_future(
        answer_ghost_tasks(2, 8, status=409, code="image_changed", message="Image 0 changed at its origin.")
    )
    status, body, response = await post(client, chat_body(served_demo_model))
    task_ids = await answering
    assert status == 409
    assert_openai_error(body, code="image_changed")
    request_id = response["X-Request-Id"]
    assert task_ids == [request_id, f"{request_id}-r1"]
    load = LoadTracker(redis.Redis.from_url(django_settings.REDIS_URL), django_settings.REDIS_KEY_PREFIX)
    assert load.snapshot(["ghost"])["ghost"].active_requests == 0


async def test_a_replan_that_fails_unforeseen_fault_injected_answers_the_workers_409_not_a_500(
    client, served_demo_model, ghost_worker, monkeypatch
):
    """The request's second preparation (the replan's) raises what nothing foresaw: the client
    gets the worker's own `image_changed`, and the reservation is still freed."""
    from inference_platform.serving import served as serving

    prepare, calls = serving.prepare, []

    def prepare_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("fault injected into the replan")
        return prepare(*args, **kwargs)

    monkeypatch.setattr(serving, "prepare", prepare_once)
    answering = asyncio.ensure_future(
        answer_ghost_tasks(1, 5, status=409, code="image_changed", message="Image 0 changed at its origin.")
    )
    status, body, _response = await post(client, chat_body(served_demo_model))
    assert len(await answering) == 1
    assert (status, len(calls)) == (409, 2)
    assert_openai_error(body, code="image_changed")
    load = LoadTracker(redis.Redis.from_url(django_settings.REDIS_URL), django_settings.REDIS_KEY_PREFIX)
    assert load.snapshot(["ghost"])["ghost"].active_requests == 0


@pytest.mark.parametrize("after_a_token", [False, True], ids=["before-the-first-token", "after-a-token"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        (RuntimeError("fault injected"), 500, "internal_error"),
        (redis.ConnectionError("fault injected"), 503, "state_unavailable"),
    ],
    ids=["unforeseen", "redis"],
)
async def test_a_failure_while_following_fault_injected_still_answers_in_the_api_format_with_the_request_id(
    client, served_demo_model, ghost_worker, monkeypatch, stream, after_a_token, fault, status, code
):
    """Following the request raises what it should have turned into an ApiError: the client
    gets the API's error with the request id (a lost Redis as a 503), not Django's bare 500. A
    stream says it in its status line until its first token, in its last event after it."""
    from inference_platform.serving import served

    async def failing_follow(lease, task_id, marked_at=0.0):
        if after_a_token:
            yield ResponseEvent("1-0", TOKEN, {"text": "Hel"})
        raise fault
        yield  # an async generator, as follow_task() is

    monkeypatch.setattr(served, "follow_task", failing_follow)
    raw = json.dumps(chat_body(served_demo_model, stream=stream)).encode()
    response = await client.post("/v1/chat/completions", data=raw, content_type="application/json")
    request_id = response["X-Request-Id"]
    if stream and after_a_token:
        # The status line said 200 with the first token: the stream's last event carries it.
        chunks = b"".join([chunk async for chunk in response.streaming_content]).decode()
        events = [line[len("data: ") :] for line in chunks.splitlines() if line.startswith("data: ")]
        assert (response.status_code, events[-1]) == (200, "[DONE]")
        assert json.loads(events[1])["choices"][0]["delta"] == {"content": "Hel"}
        body = json.loads(events[-2])
    else:
        assert response.status_code == status
        body = json.loads(response.content)
    assert_openai_error(body, code=code)
    assert request_id in body["error"]["message"]


async def test_a_stream_whose_worker_fails_before_its_first_token_answers_with_the_status_fault_injected(
    client, served_demo_model, ghost_worker
):
    """The worker's own error before any token (here a 400 of the request's) is the stream's
    status line, not a 200 with the error inside: a client can tell it from an answer, and retry
    a 5xx."""
    answering = asyncio.ensure_future(
        answer_ghost_tasks(
            1,
            5,
            status=400,
            code="image_unreadable",
            message="The picture cannot be decoded.",
            param="messages",
        )
    )
    raw = json.dumps(chat_body(served_demo_model, stream=True)).encode()
    response = await client.post("/v1/chat/completions", data=raw, content_type="application/json")
    assert len(await answering) == 1
    assert response.status_code == 400
    body = json.loads(response.content)
    assert_openai_error(body, code="image_unreadable", param="messages")
    assert response["X-Routed-Worker"] == "ghost"
    load = LoadTracker(redis.Redis.from_url(django_settings.REDIS_URL), django_settings.REDIS_KEY_PREFIX)
    assert load.snapshot(["ghost"])["ghost"].active_requests == 0


async def test_a_stream_whose_client_leaves_before_its_first_token_is_cancelled_fault_injected(
    served_demo_model, ghost_worker, api_headers
):
    """The ghost never answers; the client goes away while the frontend waits for the first
    token (the real /v1 ASGI handler, which cancels the view): nothing is sent, the worker is
    told to stop, and the reservation is freed."""
    from inference_platform.api.handler import ApiHandler
    from routing.contract.responses import cancel_key

    body = json.dumps(chat_body(served_demo_model, stream=True)).encode()
    given = False
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    prefix = django_settings.REDIS_KEY_PREFIX

    async def receive():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        # goes once the task is in the ghost's queue, while the frontend waits for its first
        # token (a fixed half second raced the frontend's send on a loaded machine)
        deadline = time.monotonic() + 10
        while not conn.llen(f"{prefix}worker.ghost") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    headers = [
        (b"content-type", b"application/json"),
        (b"authorization", api_headers["Authorization"].encode()),
    ]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
        "headers": headers, "client": ("127.0.0.1", 40000), "server": ("testserver", 80),
    }  # fmt: skip
    await asyncio.wait_for(ApiHandler()(scope, receive, send), 10)

    assert [m for m in sent if m["type"] == "http.response.start"] == []
    queued = conn.rpop(f"{prefix}worker.ghost")  # the task the ghost never took
    args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(queued)["body"]))
    request_id = args[0]["request_id"]
    assert conn.exists(cancel_key(prefix, request_id))
    load = LoadTracker(conn, prefix)
    deadline = time.monotonic() + 5
    while load.snapshot(["ghost"])["ghost"].active_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert load.snapshot(["ghost"])["ghost"].active_requests == 0
    conn.delete(cancel_key(prefix, request_id))


@pytest.fixture
def silent_redis_url():
    """A TCP server that accepts connections and never answers: a hung Redis (fault injection)."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    server.close()


async def test_a_redis_that_never_answers_fault_injected_is_a_503_not_a_hang(
    client, settings, served_demo_model, silent_redis_url, monkeypatch
):
    from routing.state import redis_keys

    monkeypatch.setattr(redis_keys, "SOCKET_TIMEOUT_S", 0.5)
    settings.REDIS_URL = silent_redis_url
    await Worker.objects.acreate(name="unreachable", model_name=served_demo_model)
    started = time.monotonic()
    status, body, response = await post(client, chat_body(served_demo_model))
    assert status == 503
    assert_openai_error(body, code="state_unavailable")
    assert response["X-Request-Id"] in body["error"]["message"]
    assert time.monotonic() - started < 5


async def test_with_redis_silent_requests_waiting_at_the_arrival_gate_meet_their_own_timeout_fault_injected(
    client, settings, served_demo_model, silent_redis_url, monkeypatch
):
    from inference_platform.serving import dispatch
    from inference_platform.serving.arrivals import Bounds, arrival_gate
    from routing.state import redis_keys

    monkeypatch.setattr(redis_keys, "SOCKET_TIMEOUT_S", 0.5)
    monkeypatch.setattr(dispatch, "_redis_failed_at", float("-inf"))  # no failure of another test's
    settings.REDIS_URL = silent_redis_url
    settings.FRONTEND_ARRIVAL_CONCURRENCY = 1
    await Worker.objects.acreate(name="unreachable", model_name=served_demo_model)
    gate, release = arrival_gate(), asyncio.Event()

    async def hold_the_one_place() -> None:
        async with gate.turn("test", 9, 1.0, Bounds(30, 100, 100)):
            await release.wait()

    # given: four requests waiting at the gate behind the one place
    holder = asyncio.ensure_future(hold_the_one_place())
    requests = [asyncio.ensure_future(post(client, chat_body(served_demo_model))) for _ in range(4)]
    deadline = time.monotonic() + 30
    while gate.waiting < 4:
        assert time.monotonic() < deadline, "the requests never reached the gate"
        await asyncio.sleep(0.05)
    # when: the place goes to the first, which finds Redis silent
    release.set()
    await holder
    answers = await asyncio.gather(*requests)
    # then: every one is a 503, and the three behind the first did not wait for a place one
    # after another's timeout: they went on when the first found Redis gone
    for status, body, _ in answers:
        assert status == 503
        assert_openai_error(body, code="state_unavailable")
    assert gate.unplaced == 3
    assert (gate.working, gate.waiting) == (0, 0)


async def test_a_malformed_session_header_is_a_400_naming_the_header(client, served_demo_model):
    raw = json.dumps(chat_body(served_demo_model)).encode()
    response = await client.post(
        "/v1/chat/completions",
        data=raw,
        content_type="application/json",
        headers={"x-dynamo-session-id": 'has spaces and "quotes"'},
    )
    assert response.status_code == 400
    body = json.loads(response.content)
    assert_openai_error(body, code="invalid_session_scope", param="x-dynamo-session-id")
    assert "quotes" not in body["error"]["message"], "a scope is a secret: never echoed"


async def test_a_session_scope_reaches_redis_only_as_a_keyed_hash(client, served_demo_model, ghost_worker):
    secret = "sess-7f3a-very-secret"
    raw = json.dumps(chat_body(served_demo_model)).encode()
    response = await client.post(
        "/v1/chat/completions", data=raw, content_type="application/json", headers={"x-session-id": secret}
    )
    assert response.status_code == 504  # the ghost never answers; the dispatch itself happened
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    prefix = django_settings.REDIS_KEY_PREFIX
    message = conn.lindex(f"{prefix}worker.ghost", 0)
    args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(message)["body"]))
    scope_key = args[0]["scope_key"]
    assert scope_key and len(scope_key) == 32 and secret not in scope_key
    # every key and every value in the deployment's namespace, read as values (DUMP's output is
    # compressed for values over 20 bytes: a secret inside it would not show)
    everything = b"".join(
        key + b"".join(stored_values(conn, key)) for key in conn.scan_iter(match=f"{prefix}*", count=1000)
    )
    assert secret.encode() not in everything
    assert b'"scope_key"' in everything, "the task message was read, not skipped"
    assert conn.get(f"{prefix}aff:{scope_key}") == b"ghost", "affinity remembers the session by its hash"


def _decoded_body(item: bytes) -> bytes:
    try:
        message = json.loads(item)
    except ValueError:
        return b""
    if isinstance(message, dict) and message.get("properties", {}).get("body_encoding") == "base64":
        return base64.b64decode(message["body"])
    return b""


def stored_values(conn: redis.Redis, key: bytes) -> list[bytes]:
    """The values a key holds, whatever its type, as bytes."""
    kind = conn.type(key)
    if kind == b"string":
        return [conn.get(key) or b""]
    if kind == b"hash":
        return [k + v for k, v in conn.hgetall(key).items()]
    if kind == b"list":  # Celery's queues: their messages' bodies are base64, read them decoded
        return [item + _decoded_body(item) for item in conn.lrange(key, 0, -1)]
    if kind == b"set":
        return list(conn.smembers(key))
    if kind == b"zset":
        return conn.zrange(key, 0, -1)
    if kind == b"stream":
        return [b"".join(k + v for k, v in fields.items()) for _, fields in conn.xrange(key)]
    return []


async def test_image_bytes_travel_to_the_worker_by_reference_not_inside_the_task(
    client, served_demo_model, ghost_worker
):
    """The ghost worker (fault injection: it never answers) leaves its task in the queue to read."""
    import io

    from PIL import Image

    from routing.media.store import MediaRef, MediaStore

    # given a 300 KB data URL image
    buffer = io.BytesIO()
    Image.frombytes("RGB", (320, 320), bytes(range(256)) * 1200).save(buffer, "BMP")
    data_url = "data:image/bmp;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = chat_body(served_demo_model)
    body["messages"][0]["content"] = [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    queue = f"{django_settings.REDIS_KEY_PREFIX}worker.ghost"
    store = MediaStore(conn, django_settings.REDIS_KEY_PREFIX)
    seen: dict = {}

    async def read_the_task() -> None:
        while not (raw := conn.lindex(queue, 0)):
            await asyncio.sleep(0.05)
        seen["message_bytes"] = len(raw)
        message = json.loads(raw)
        args = json.loads(base64.b64decode(message["body"]))[0][0]
        seen["image"] = args["images"][0]
        seen["stored"] = store.get(MediaRef.from_payload(seen["image"]))

    # when the request is dispatched (and times out on the silent ghost)
    reader = asyncio.create_task(read_the_task())
    status, _, _ = await post(client, body)
    await reader
    # then the task held a reference to the bytes, which the side store held while it ran
    assert status == 504
    assert seen["message_bytes"] < 20_000, "the image travelled inside the Celery message"
    assert seen["image"]["url"] is None and MediaRef.in_payload(seen["image"])
    assert seen["stored"] == buffer.getvalue()
    # and once the request ended, the frontend released them rather than waiting for the TTL
    assert store.total_bytes() == 0
    assert conn.get(seen["image"]["media_ref"]) is None


async def test_the_queued_task_names_its_request_and_its_headers_carry_no_prompt(
    client, served_demo_model, ghost_worker
):
    """The ghost worker (fault injection: it never answers) leaves its task in the queue to read."""
    body = chat_body(served_demo_model)
    body["messages"][0]["content"] = "The launch code is tangerine-kestrel-42."
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    queue = f"{django_settings.REDIS_KEY_PREFIX}worker.ghost"
    seen: dict = {}

    async def read_the_task() -> None:
        while not (raw := conn.lindex(queue, 0)):
            await asyncio.sleep(0.05)
        message = json.loads(raw)
        seen["headers"] = message["headers"]
        seen["request_id"] = json.loads(base64.b64decode(message["body"]))[0][0]["request_id"]

    reader = asyncio.create_task(read_the_task())
    status, _, response = await post(client, body)
    await reader
    assert status == 504 and seen["request_id"] == response["X-Request-Id"]
    # what Celery's logs, events and monitors show of the task is its request, not its prompt
    assert seen["headers"]["argsrepr"] == repr([seen["request_id"]])
    assert "tangerine" not in json.dumps(seen["headers"])


async def test_a_streaming_client_that_hangs_up_mid_send_fault_injected_has_its_request_cancelled_at_once(
    api_headers, served_demo_model, ghost_worker
):
    """The client, played here over ASGI (the fault injected), reads the first piece of a
    streamed answer and then no more, and hangs up while the frontend is sending the next: Django
    cancels that send. The request must be cancelled on its worker then, not whenever the
    stream's generators are garbage collected (collection is off here: Django closes only its own
    wrappers of a response's content, so ours stayed suspended, and the worker ran on)."""
    from inference_platform.api.handler import ApiHandler

    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    prefix = django_settings.REDIS_KEY_PREFIX
    seen: dict[str, float] = {}

    async def play_the_worker() -> None:
        # the ghost takes the task and streams a piece every 20 ms until told to stop
        deadline = time.monotonic() + 15
        while not (raw := conn.rpop(f"{prefix}worker.ghost")):
            assert time.monotonic() < deadline, "the task never reached the ghost"
            await asyncio.sleep(0.01)
        args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
        writer = ResponseWriter(conn, prefix, args[0]["request_id"])
        writer.send(STARTED, worker="ghost")
        while time.monotonic() < deadline:
            writer.emit(TokenEvent(text="x", token_ids=[7]))
            if writer.cancelled():
                seen["cancelled"] = time.monotonic()
                return
            await asyncio.sleep(0.02)

    body = json.dumps(chat_body(served_demo_model, stream=True, max_tokens=2000)).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"authorization", api_headers["Authorization"].encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
    }
    request = [{"type": "http.request", "body": body, "more_body": False}]
    first_piece = asyncio.Event()
    bodies = 0

    async def receive() -> dict:
        if request:
            return request.pop()
        await first_piece.wait()
        seen["hung_up"] = time.monotonic()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        nonlocal bodies
        if message["type"] == "http.response.body" and message.get("body"):
            bodies += 1
            if bodies == 3:  # the role, the first piece, and now the next: the client reads no more
                first_piece.set()
                await asyncio.sleep(60)

    gc.disable()
    try:
        worker = asyncio.ensure_future(play_the_worker())
        await asyncio.wait_for(ApiHandler()({**scope}, receive, send), 20)
        await asyncio.wait_for(worker, 20)
    finally:
        gc.enable()

    # then the worker was told to stop within a second of the hang-up
    assert "hung_up" in seen, "the stream never reached its second piece"
    assert "cancelled" in seen, "the worker was never told to stop"
    assert seen["cancelled"] - seen["hung_up"] < 1.0


async def _through_the_api_handler(
    path: str, headers: dict[str, str], body: bytes = b""
) -> tuple[int, bytes]:
    """One request through `/v1`'s own ASGI handler, as the server hands it over: status, body."""
    from inference_platform.api.handler import ApiHandler

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "POST" if body else "GET", "scheme": "http", "path": path, "raw_path": path.encode(),
        "query_string": b"", "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        + [(name.lower().encode(), value.encode()) for name, value in headers.items()],
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
    }  # fmt: skip
    request = [{"type": "http.request", "body": body, "more_body": False}]
    answered = asyncio.Event()
    sent: list[dict] = []

    async def receive() -> dict:
        if request:
            return request.pop()
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    await asyncio.wait_for(ApiHandler()(scope, receive, send), 20)
    (start,) = [m for m in sent if m["type"] == "http.response.start"]
    return start["status"], b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_a_chat_completion_sends_no_request_signal_and_makes_no_hand_over_to_djangos_thread(
    api_headers, served_demo_model, ghost_worker, monkeypatch
):
    """Django's request signals only tidy the connections of asgiref's thread-sensitive thread,
    and each cost a hand-over to it: `/v1` sends neither, and a chat completion whose key was
    verified lately never enters that thread (inference_platform.api.handler)."""
    from asgiref.sync import SyncToAsync
    from django.core import signals

    heard: list[str] = []

    def started(**_kwargs) -> None:
        heard.append("request_started")

    def finished(**_kwargs) -> None:
        heard.append("request_finished")

    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    handed_over: list[object] = []
    hand_over = SyncToAsync.__call__

    async def counted(self, *args, **kwargs):
        if self._thread_sensitive:
            handed_over.append(self.func)
        return await hand_over(self, *args, **kwargs)

    monkeypatch.setattr(SyncToAsync, "__call__", counted)
    done = DoneEvent(text="Hi", finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    try:
        body = json.dumps(chat_body(served_demo_model)).encode()
        for turn in range(2):  # the first verifies the key, in Django's thread
            answering = asyncio.ensure_future(answer_ghost_tasks(1, 15, answers=[done]))
            status, answer = await _through_the_api_handler("/v1/chat/completions", api_headers, body)
            assert len(await answering) == 1
            assert status == 200, answer
            assert json.loads(answer)["choices"][0]["message"]["content"] == "Hi"
            if turn == 0:
                assert handed_over, "the key's first check reads the database, in Django's thread"
                handed_over.clear()
        assert handed_over == []
        assert heard == []
    finally:
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)


async def test_the_apis_calls_into_djangos_thread_tidy_its_connections_around_them(
    api_headers, served_demo_model, monkeypatch
):
    """What Django's request signals did is done around each of the API's database calls, in
    the thread that makes it: a connection past CONN_MAX_AGE or broken is closed before the
    call and after it (a key not yet verified, a synchronous view)."""
    import channels.db

    tidied: list[int] = []

    def close_old_connections() -> None:
        tidied.append(threading.get_ident())

    monkeypatch.setattr(channels.db, "close_old_connections", close_old_connections)
    loop_thread = threading.get_ident()

    # a synchronous view (its key checked inside it): tidied around the view
    status, answer = await _through_the_api_handler("/v1/models", api_headers)
    assert status == 200, answer
    assert len(tidied) == 2
    # a key never seen, on the event loop's path: tidied around its check (database_sync_to_async)
    body = json.dumps(chat_body(served_demo_model)).encode()
    status, answer = await _through_the_api_handler(
        "/v1/chat/completions", {"Authorization": "Bearer sk-never-issued"}, body
    )
    assert status == 401, answer
    assert len(tidied) == 4
    assert loop_thread not in tidied
