"""A served request (inference_platform.serving.served.ServedRequest) frees everything it took,
once, on every path; and an answer whose worker dies mid-way continues on another worker as if
nothing had happened.

The first tests run the demo model in process: an answer continued from the tokens a client
already has equals the uninterrupted answer."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import logging
import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import httpx
import pytest
import redis
from django.conf import settings as django_settings
from PIL import Image

from inference_platform.api.boundary import new_request_id
from inference_platform.api.chat_request import parse_chat_request
from inference_platform.serving import served
from inference_platform.serving.arrivals import arrival_gate
from inference_platform.serving.chat import ChatRequest
from inference_platform.serving.clock import RequestClock
from inference_platform.serving.errors import ApiError
from inference_platform.serving.frontend import frontend
from inference_platform.serving.served import ServedRequest
from routing.contract.responses import ResponseWriter, live_key, response_key
from routing.contract.tasks import DoneEvent, ErrorEvent, GenerateTask, StartedEvent, TokenEvent
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.kv.load import LoadTracker
from routing.media.store import MediaStore
from routing.models import Worker, worker_queue
from tenants.keys import Caller, authenticate
from tenants.limits import TenantLimiter
from tests.api_client import KeyedAsyncClient
from tests.test_engine import LONG_TEXT, chat, image_input
from workers.engine import GenerationRequest


def _pieces(engine, **options):
    pieces: list[tuple[str, list[int]]] = []
    result = engine.generate(
        GenerationRequest(request_id="c", **options),
        on_piece=lambda text, logprobs, ids: pieces.append((text, ids)),
    )
    return result, pieces


@pytest.mark.parametrize(
    ("images", "after_pieces", "penalties"),
    [(0, 1, {}), (1, 7, {}), (0, 4, {"frequency_penalty": 0.8, "presence_penalty": 0.3})],
    ids=["text-after-1-piece", "image-after-7", "penalties-after-4"],
)
def test_a_greedy_answer_continued_from_its_first_pieces_equals_the_uninterrupted_answer(
    demo_engine, images, after_pieces, penalties
):
    # given an uninterrupted greedy answer, and the token ids its first pieces carried
    engine = demo_engine()
    prompt = chat(LONG_TEXT + " What next?", images=images)
    imgs = [image_input(1)] if images else []
    whole, pieces = _pieces(engine, prompt=prompt, images=imgs, max_tokens=24, ignore_eos=True, **penalties)
    assert sum(len(ids) for _, ids in pieces) <= whole.completion_tokens
    sent = pieces[:after_pieces]
    carried = [t for _, ids in sent for t in ids]
    # when a fresh engine (another worker: nothing cached) continues from those tokens
    fresh = demo_engine()
    rest, rest_pieces = _pieces(
        fresh,
        prompt=prompt,
        images=[image_input(1)] if images else [],
        max_tokens=24 - len(carried),
        ignore_eos=True,
        continued_token_ids=carried,
        **penalties,
    )
    # then the pieces sent plus the continuation are the answer, token for token, counted once
    assert "".join(t for t, _ in sent) + rest.text == whole.text
    assert len(carried) + rest.completion_tokens == whole.completion_tokens
    assert carried + [t for _, ids in rest_pieces for t in ids] == [t for _, ids in pieces for t in ids]


# --- every resource released once, on every path --------------------------------------------------
#
# These follow a ServedRequest against the real Redis, the real broker queues and the real router;
# the workers are scripted at the task contract's boundary (`ScriptedWorker`: it takes its task
# from its Celery queue and writes the events a worker writes), so each test chooses what the
# worker does. A worker that "dies" is a heartbeat removed: that is the fault the frontend sees.


def png_data_url() -> str:
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def chat_request(model: str, *, max_tokens: int = 6, stream: bool = False) -> ChatRequest:
    return parse_chat_request(chat_body(model, max_tokens=max_tokens, stream=stream), max_tokens_limit=64)


def chat_body(model: str, *, max_tokens: int = 6, stream: bool = False) -> dict[str, Any]:
    """A chat with a data-URL picture: the frontend holds its bytes, so the request stores media."""
    return {
        "model": model,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url()}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],
    }


class ScriptedWorker:
    """A registered worker whose answers a test writes: its heartbeat is real, its tasks are taken
    from its real Celery queue, and its events go on the request's real response stream."""

    def __init__(self, name: str, model: str, **beat: Any) -> None:
        self.name = name
        self.conn = redis.Redis.from_url(django_settings.REDIS_URL)
        self.prefix = django_settings.REDIS_KEY_PREFIX
        self.registry = WorkerRegistry(self.conn, self.prefix)
        Worker.objects.create(name=name, model_name=model)
        self.heartbeat = Heartbeat(name=name, model=model, block_size=django_settings.KV_BLOCK_SIZE, **beat)
        self.beat()
        self.conn.delete(self.queue)

    @property
    def queue(self) -> str:
        return f"{self.prefix}{worker_queue(self.name)}"

    def beat(self) -> None:
        self.registry.beat(self.heartbeat, 30)

    def die(self) -> None:
        """The process is gone: its heartbeat with it."""
        self.registry.remove(self.name)

    async def next_task(self, deadline_s: float = 10.0) -> GenerateTask:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            raw = self.conn.rpop(self.queue)
            if raw:
                args, _kwargs, _embed = json.loads(base64.b64decode(json.loads(raw)["body"]))
                return GenerateTask.from_payload(args[0])
            await asyncio.sleep(0.02)
        raise AssertionError(f"no task reached worker {self.name}")

    def writer(self, task: GenerateTask) -> ResponseWriter:
        return ResponseWriter(self.conn, self.prefix, task.request_id)

    def start(self, task: GenerateTask) -> ResponseWriter:
        writer = self.writer(task)
        writer.emit(StartedEvent(worker=self.name, instance=self.heartbeat.instance))
        return writer

    def answer(self, task: GenerateTask, pieces: list[tuple[str, list[int]]], *, prompt: int = 20) -> None:
        writer = self.start(task)
        for text, ids in pieces:
            writer.emit(TokenEvent(text=text, token_ids=ids))
        writer.emit(
            DoneEvent(
                text="".join(text for text, _ in pieces),
                prompt_tokens=prompt + len(task.continued_token_ids),
                completion_tokens=sum(len(ids) for _, ids in pieces),
                worker=self.name,
            )
        )


@dataclass
class Releases:
    """Counts, per request (or task), each release the served request makes: spies that call
    through to the real code."""

    tenant_slot: Counter = field(default_factory=Counter)
    load: Counter = field(default_factory=Counter)  # (worker, request id)
    media: Counter = field(default_factory=Counter)
    lease_callbacks: Counter = field(default_factory=Counter)
    cancels: Counter = field(default_factory=Counter)  # task ids
    clock: Counter = field(default_factory=Counter)  # statuses recorded


@pytest.fixture
def releases(monkeypatch) -> Releases:
    counted = Releases()

    def spy(owner: Any, name: str, count: Callable[..., None]) -> None:
        real = getattr(owner, name)

        def counting(*args: Any, **kwargs: Any) -> Any:
            count(*args, **kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)

    spy(TenantLimiter, "release", lambda self, tenant, rid: counted.tenant_slot.update([rid]))
    spy(TenantLimiter, "release_command", lambda self, tenant, rid: counted.tenant_slot.update([rid]))
    spy(LoadTracker, "free", lambda self, worker, rid: counted.load.update([(worker, rid)]))
    spy(LoadTracker, "afree", lambda self, lines, worker, rid, **_: counted.load.update([(worker, rid)]))
    spy(MediaStore, "release", lambda self, owner, refs: counted.media.update([owner]))
    spy(MediaStore, "arelease", lambda self, lines, owner, refs: counted.media.update([owner]))
    spy(ServedRequest, "_released", lambda self, lease: counted.lease_callbacks.update([self.request_id]))
    spy(served, "_cancel_command", lambda task_id: counted.cancels.update([task_id]))
    spy(RequestClock, "finish", lambda self, status, *a, **k: counted.clock.update([status]))
    return counted


@pytest.fixture
def tenant_key(make_api_key) -> str:
    """A key of a tenant with a concurrency limit: each request takes a slot in Redis."""
    return make_api_key("served-tenant", max_concurrent_requests=4)


@pytest.fixture
def tenant_caller(tenant_key) -> Caller:
    return authenticate(tenant_key)


def assert_nothing_left(rid: str, caller: Caller, workers: list[str]) -> None:
    """What the request held is gone from Redis, not just counted as released."""
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    prefix = django_settings.REDIS_KEY_PREFIX
    assert frontend().limiter().active(caller.tenant_id) == 0  # type: ignore[arg-type]
    load = LoadTracker(conn, prefix).snapshot(workers)
    assert all(load[worker].active_requests == 0 for worker in workers), load
    assert not conn.exists(live_key(prefix, rid))
    assert not conn.keys(f"{prefix}media:blob:{rid}*")


async def nothing_left(rid: str, caller: Caller, workers: list[str]) -> None:
    """`assert_nothing_left`, and the request's place at the arrival gate given back."""
    await asyncio.to_thread(assert_nothing_left, rid, caller, workers)
    gate = arrival_gate()
    assert (gate.working, gate.waiting) == (0, 0)


async def open_request(caller: Caller, chat: ChatRequest) -> ServedRequest:
    return await ServedRequest(new_request_id(), caller).open(chat, {})


async def drain(request: ServedRequest) -> list[TokenEvent | DoneEvent]:
    return [event async for event in request.events()]


pytestmark_db = pytest.mark.django_db(transaction=True)


@pytestmark_db
async def test_a_served_answer_releases_each_resource_once(served_demo_model, tenant_caller, releases):
    # given a worker that answers
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    rid = request.request_id

    # when it answers and the request is followed to the end
    task = await worker.next_task()
    worker.answer(task, [("Hel", [11]), ("lo", [12])])
    events = await drain(request)
    await request.close(200)  # a second close does nothing

    # then the answer came, and each resource was released exactly once
    assert isinstance(events[-1], DoneEvent) and events[-1].completion_tokens == 2
    assert releases.tenant_slot[rid] == 1 and releases.load[("w1", rid)] == 1
    assert releases.media[rid] == 1 and releases.lease_callbacks[rid] == 1
    assert releases.clock == Counter({200: 1})
    assert releases.cancels[rid] == 0  # the worker ended it: nothing to cancel
    await nothing_left(rid, tenant_caller, ["w1"])


@pytestmark_db
async def test_an_answered_requests_end_is_written_in_one_round_trip(
    served_demo_model, tenant_caller, counted_lines
):
    # given a text request (no media) of a tenant with a concurrency slot
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    text = {"model": served_demo_model, "max_tokens": 6, "messages": [{"role": "user", "content": "Hi"}]}
    request = await open_request(tenant_caller, parse_chat_request(text, max_tokens_limit=64))

    # when it is answered and followed to its end
    worker.answer(await worker.next_task(), [("Hel", [11]), ("lo", [12])])
    await drain(request)
    await request.close(200)  # (the end came with the answer: nothing more)

    # then after the read of its whole answer came its end, in one round trip: the load freed,
    # the liveness mark and the stream dropped, the tenant's slot freed and its usage counted
    # (the first token's move to decode, read with the end, is left to the load's free)
    last_read = len(counted_lines) - 1 - counted_lines[::-1].index(("XREAD",))
    end = ("EVALSHA", "DEL", "ZREM", "HINCRBY", "HINCRBY", "HINCRBY", "HINCRBY")
    assert counted_lines[last_read + 1 :] == [end]
    await nothing_left(request.request_id, tenant_caller, ["w1"])
    usage = (await frontend().ausage()).totals([tenant_caller.usage_id])[tenant_caller.usage_id]
    assert (usage["requests"], usage["completion_tokens"]) == (1, 2)


@pytestmark_db
async def test_the_first_token_waits_for_no_round_trip_and_its_load_moves_with_the_next_read(
    served_demo_model, tenant_caller, counted_lines
):
    # given a streamed answer whose first token the worker has sent, and nothing more yet
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    task = await worker.next_task()
    writer = worker.start(task)
    writer.emit(TokenEvent(text="Hel", token_ids=[11]))
    events = request.events()

    # when the first token is read
    first = await events.__anext__()
    read_so_far = list(counted_lines)

    # then it came straight from the read of the stream, the load still counted as prefill
    assert isinstance(first, TokenEvent) and first.text == "Hel"
    assert read_so_far[-1] == ("XREAD",)
    load = LoadTracker(worker.conn, worker.prefix)
    assert (await asyncio.to_thread(load.snapshot, ["w1"]))["w1"].active_prefill_tokens > 0

    # and when the next token comes, the load's move to decode went in that read's round trip
    writer.emit(TokenEvent(text="lo", token_ids=[12]))
    second = await events.__anext__()
    assert isinstance(second, TokenEvent) and second.text == "lo"
    assert counted_lines[len(read_so_far) :] == [("EVALSHA", "XREAD")]
    assert (await asyncio.to_thread(load.snapshot, ["w1"]))["w1"].active_prefill_tokens == 0
    writer.emit(DoneEvent(text="Hello", prompt_tokens=20, completion_tokens=2, worker="w1"))
    assert [event.completion_tokens async for event in events] == [2]
    await nothing_left(request.request_id, tenant_caller, ["w1"])


@pytestmark_db
@pytest.mark.parametrize(("ttl_s", "follow_after_s"), [(60.0, 0.0), (0.4, 0.15)])
async def test_the_follow_renews_the_mark_and_reservation_a_quarter_ttl_after_the_send_not_at_once(
    served_demo_model, tenant_caller, settings, monkeypatch, ttl_s, follow_after_s
):
    # given liveness marks of `ttl_s` (renewed every quarter of it) and spies on both renewals
    from inference_platform.serving import dispatch
    from routing.kv.lease import RequestLease

    settings.REQUEST_LIVENESS_TTL_SECS = ttl_s
    marks: list[str] = []
    renewals: list[str] = []
    mark, renew = dispatch._mark_command, RequestLease.arenew

    def counted_mark(follow_id: str) -> tuple[object, ...]:  # each mark set: the send's, the renewals'
        marks.append(follow_id)
        return mark(follow_id)

    async def counted_renew(self, *args, **kwargs):
        renewals.append(self.request_id)
        return await renew(self, *args, **kwargs)

    monkeypatch.setattr(dispatch, "_mark_command", counted_mark)
    monkeypatch.setattr(RequestLease, "arenew", counted_renew)
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    rid = request.request_id
    task = await worker.next_task()
    worker.answer(task, [("Hi", [11])])  # the whole answer waits on its stream
    assert marks == [rid] and renewals == []  # the send set the mark; the decision reserved

    # when it is followed at once (well within 15 s), or after a quarter of a 0.4 s TTL
    await asyncio.sleep(follow_after_s)
    events = await drain(request)

    # then the prompt follow renewed neither again; the late one renewed both before reading
    assert isinstance(events[-1], DoneEvent)
    assert marks == [rid] * (2 if follow_after_s else 1)
    assert renewals == ([rid] if follow_after_s else [])


@pytestmark_db
async def test_a_streamed_answer_releases_each_resource_once(
    served_demo_model, tenant_key, tenant_caller, releases
):
    # given a worker that answers, and a client that asks for a stream through the API
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    body = json.dumps(chat_body(served_demo_model, stream=True))
    client = KeyedAsyncClient({"Authorization": f"Bearer {tenant_key}"})

    async def answer() -> None:
        worker.answer(await worker.next_task(), [("Hel", [11]), ("lo", [12])])

    # when the stream is read to its end
    answering = asyncio.ensure_future(answer())
    response = await client.post("/v1/chat/completions", data=body, content_type="application/json")
    chunks = b"".join([chunk async for chunk in response.streaming_content]).decode()
    await answering
    rid = response["X-Request-Id"]

    # then the client got the whole answer, and each resource was released exactly once
    assert response.status_code == 200 and chunks.endswith("data: [DONE]\n\n")
    assert '"Hel"' in chunks and '"lo"' in chunks
    assert releases.tenant_slot[rid] == 1 and releases.load[("w1", rid)] == 1
    assert releases.media[rid] == 1 and releases.lease_callbacks[rid] == 1
    assert releases.clock == Counter({200: 1}) and releases.cancels[rid] == 0
    await nothing_left(rid, tenant_caller, ["w1"])
    # and the answer's stream went with the liveness mark, read to its end
    conn = redis.Redis.from_url(django_settings.REDIS_URL)
    assert not conn.exists(response_key(django_settings.REDIS_KEY_PREFIX, rid))


def gone_lines(caplog: pytest.LogCaptureFixture, request_id: str) -> list[str]:
    """What the frontend said of a request whose client went away."""
    return [
        record.getMessage()
        for record in caplog.records
        if request_id in record.getMessage() and "client went away" in record.getMessage()
    ]


@pytestmark_db
async def test_a_client_gone_before_the_first_token_cancels_the_worker_and_releases_each_resource_once(
    served_demo_model, tenant_caller, releases, caplog
):
    # given a request its worker has started
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    rid = request.request_id
    worker.start(await worker.next_task())

    # when the client goes away before any token (its task is cancelled)
    following = asyncio.ensure_future(drain(request))
    await asyncio.sleep(0.3)
    with caplog.at_level(logging.INFO, logger="inference_platform.serving"):
        following.cancel()
        with pytest.raises(asyncio.CancelledError):
            await following

    # then the worker is told to stop, and each resource was released exactly once
    assert releases.cancels[rid] == 1
    assert gone_lines(caplog, rid) == [
        f"request {rid}: the client went away after 0 pieces of the answer; worker w1 told to stop"
    ]
    assert releases.tenant_slot[rid] == 1 and releases.load[("w1", rid)] == 1
    assert releases.media[rid] == 1 and releases.lease_callbacks[rid] == 1
    assert releases.clock == Counter({served.CLIENT_CLOSED: 1})
    await nothing_left(rid, tenant_caller, ["w1"])


@pytestmark_db
async def test_a_client_gone_after_the_first_token_cancels_the_worker_and_releases_each_resource_once(
    served_demo_model, tenant_caller, releases, caplog
):
    # given a request whose first token reached the client
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    rid = request.request_id
    worker.start(await worker.next_task()).emit(TokenEvent(text="Hel", token_ids=[11]))
    events = request.events()
    first = await anext(events)
    assert isinstance(first, TokenEvent) and first.text == "Hel"

    # when the client goes away (the stream is closed), twice over
    with caplog.at_level(logging.INFO, logger="inference_platform.serving"):
        await events.aclose()
        await request.close(served.CLIENT_CLOSED)

    # then the worker is told to stop, and each resource was released exactly once (said once)
    assert releases.cancels[rid] == 1
    assert gone_lines(caplog, rid) == [
        f"request {rid}: the client went away after 1 piece of the answer; worker w1 told to stop"
    ]
    assert releases.tenant_slot[rid] == 1 and releases.load[("w1", rid)] == 1
    assert releases.media[rid] == 1 and releases.lease_callbacks[rid] == 1
    assert releases.clock == Counter({served.CLIENT_CLOSED: 1})
    await nothing_left(rid, tenant_caller, ["w1"])


@pytestmark_db
async def test_a_worker_error_answers_its_status_and_releases_each_resource_once(
    served_demo_model, tenant_caller, releases
):
    # given a request whose worker fails it
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    rid = request.request_id
    worker.start(await worker.next_task()).emit(ErrorEvent(status=502, code="worker_error", message="boom"))

    # when it is followed
    with pytest.raises(ApiError) as failed:
        await drain(request)

    # then the client gets the worker's error, and each resource was released exactly once
    assert (failed.value.status, failed.value.code) == (502, "worker_error")
    assert releases.tenant_slot[rid] == 1 and releases.load[("w1", rid)] == 1
    assert releases.media[rid] == 1 and releases.lease_callbacks[rid] == 1
    assert releases.clock == Counter({502: 1}) and releases.cancels[rid] == 0
    await nothing_left(rid, tenant_caller, ["w1"])


@pytestmark_db
async def test_a_worker_dying_mid_answer_fault_injected_is_continued_elsewhere_releasing_each_once(
    served_demo_model, tenant_caller, releases
):
    # given two workers, and a request whose first worker sent one token, then died
    workers = {
        name: await asyncio.to_thread(ScriptedWorker, name, served_demo_model) for name in ("w1", "w2")
    }
    request = await open_request(tenant_caller, chat_request(served_demo_model, max_tokens=6))
    rid = request.request_id
    first, other = workers[request.worker], workers["w2" if request.worker == "w1" else "w1"]
    first.start(await first.next_task()).emit(TokenEvent(text="Hel", token_ids=[11]))
    first.die()

    # when the request is followed, and the other worker answers what it is sent
    async def answer() -> GenerateTask:
        task = await other.next_task()
        other.answer(task, [("lo", [12])])
        return task

    answering = asyncio.ensure_future(answer())
    events = await drain(request)
    moved = await answering

    # then the other worker continued after the token the client had, within the budget
    assert (moved.request_id, moved.continued_token_ids, moved.max_tokens) == (f"{rid}-m1", (11,), 5)
    # and the client got one answer, each token counted once
    assert [e.text for e in events if isinstance(e, TokenEvent)] == ["Hel", "lo"]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert (done.text, done.prompt_tokens, done.completion_tokens) == ("Hello", 20, 2)
    # and each resource was released exactly once: the dead worker's load at the move, its task
    # cancelled there, the rest at the end
    assert releases.load[(first.name, rid)] == 1 and releases.load[(other.name, rid)] == 1
    assert releases.cancels == Counter({rid: 1})
    assert releases.tenant_slot[rid] == 1 and releases.media[rid] == 1
    assert releases.lease_callbacks[rid] == 1 and releases.clock == Counter({200: 1})
    await nothing_left(rid, tenant_caller, ["w1", "w2"])


@pytestmark_db
async def test_a_picture_changed_at_its_origin_fault_injected_is_planned_again_releasing_each_resource_once(
    served_demo_model, tenant_caller, releases
):
    # given a request whose worker finds its picture changed
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    rid = request.request_id
    first = await worker.next_task()
    worker.start(first).emit(ErrorEvent(status=409, code="image_changed", message="Image 0 changed."))

    # when it is followed, and the new plan's task is answered
    async def answer() -> GenerateTask:
        task = await worker.next_task()
        worker.answer(task, [("Hi", [11])])
        return task

    answering = asyncio.ensure_future(answer())
    events = await drain(request)
    again = await answering

    # then it was planned again once, and each resource was released exactly once
    assert again.request_id == f"{rid}-r1" and isinstance(events[-1], DoneEvent)
    assert releases.tenant_slot[rid] == 1 and releases.load[("w1", rid)] == 1
    assert releases.media[rid] == 1 and releases.lease_callbacks[rid] == 1
    assert releases.clock == Counter({200: 1}) and releases.cancels[rid] == 0
    await nothing_left(rid, tenant_caller, ["w1"])


@pytestmark_db
async def test_every_worker_busy_answers_503_and_releases_the_slot_and_clock_once(
    served_demo_model, tenant_caller, releases, settings
):
    # given the only worker past the busy threshold, and no admission queue to wait in
    settings.ROUTER_BUSY_MAX_REQUESTS = 1
    settings.ROUTER_QUEUE_ENABLED = False
    await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model, running=1)
    request = ServedRequest(new_request_id(), tenant_caller)

    # when the request is opened
    with pytest.raises(ApiError) as refused:
        await request.open(chat_request(served_demo_model), {})

    # then it is refused at once, nothing reserved, and its slot and clock released once
    assert (refused.value.status, refused.value.code) == (503, "all_workers_busy")
    assert request.lease is None and not releases.load and not releases.media
    assert releases.tenant_slot[request.request_id] == 1 and releases.clock == Counter({503: 1})
    await nothing_left(request.request_id, tenant_caller, ["w1"])


@pytestmark_db
async def test_a_request_refused_while_prepared_releases_the_slot_and_clock_once(
    served_demo_model, tenant_caller, releases
):
    # given a request for a model this platform does not serve
    await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = ServedRequest(new_request_id(), tenant_caller)
    chat = dataclasses.replace(chat_request(served_demo_model), model="no-such-model")

    # when it is opened
    with pytest.raises(ApiError) as refused:
        await request.open(chat, {})

    # then it is a 404, and the slot and clock it took are released once, nothing else taken
    assert (refused.value.status, refused.value.code) == (404, "model_not_found")
    assert request.lease is None and not releases.load and not releases.media
    assert releases.tenant_slot[request.request_id] == 1 and releases.clock == Counter({404: 1})


@pytestmark_db
async def test_redis_failing_while_following_fault_injected_answers_503_and_releases_each_resource_once(
    served_demo_model, tenant_caller, releases, monkeypatch
):
    # given a sent request, whose response stream then cannot be read (Redis failed)
    await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    request = await open_request(tenant_caller, chat_request(served_demo_model))
    rid = request.request_id

    async def failing_follow(lease, task_id, marked_at=0.0):
        raise redis.ConnectionError("fault injected")
        yield  # an async generator, as follow_task is

    monkeypatch.setattr(served, "follow_task", failing_follow)

    # when it is followed
    with pytest.raises(ApiError) as failed:
        await drain(request)
    await asyncio.gather(*served._background)  # the slot is freed in the background after a failure

    # then the client gets a 503, and each resource was released exactly once
    assert (failed.value.status, failed.value.code) == (503, "state_unavailable")
    assert releases.tenant_slot[rid] == 1 and releases.load[("w1", rid)] == 1
    assert releases.media[rid] == 1 and releases.lease_callbacks[rid] == 1
    assert releases.clock == Counter({503: 1}) and releases.cancels[rid] == 1
    await nothing_left(rid, tenant_caller, ["w1"])


# --- a worker killed mid-answer, with real processes -------------------------------------------
MIGRANT = "migrant"  # the worker the test starts beside the session's pool, and kills


@pytest.fixture
def beside_the_pool(pooled_platform):
    """The session's two pool workers and one more with the demo model, MIGRANT, which the test
    may kill, behind a frontend that deals requests round the three in turn (so the test knows
    which request goes where); once MIGRANT is gone, the pool is as it was."""
    platform = pooled_platform(
        ROUTER_MODE="round_robin", REQUEST_LIVENESS_TTL_SECS="2", REQUEST_FIRST_TOKEN_TIMEOUT_SECS="60"
    )
    platform.start_worker(MIGRANT)
    platform.wait_for_workers(MIGRANT)
    platform.start_server()
    yield platform
    # a killed worker's heartbeat lapses within its TTL (2 s): no later test's frontend sees it
    deadline = time.monotonic() + 30
    while (
        platform.redis.exists(platform.heartbeat_key(MIGRANT))
        and platform.workers[MIGRANT].poll() is not None
    ):
        assert time.monotonic() < deadline, "the killed worker's heartbeat outlived its TTL"
        time.sleep(0.1)


def stream_answer(platform, *, kill: str | None = None) -> tuple[str, dict, list[dict], str]:
    """A streamed greedy answer: its text, usage, every event and the worker it was routed to;
    with `kill`, that worker, if the answer was routed there, is SIGKILLed once five content
    chunks arrived."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events: list[dict] = []
    content = 0
    url = f"{platform.base_url}/v1/chat/completions"
    with httpx.stream("POST", url, json=body, headers=platform.headers, timeout=90) as response:
        assert response.status_code == 200, response.read()
        worker = response.headers["X-Routed-Worker"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[len("data: ") :]))
            if events[-1].get("choices") and events[-1]["choices"][0]["delta"].get("content"):
                content += 1
                if content == 5 and worker == kill:
                    platform.stop_worker(worker, signal.SIGKILL, wait=False)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    usage = next(e["usage"] for e in events if e.get("usage"))
    return text, usage, events, worker


def test_a_worker_killed_mid_stream_leaves_the_client_one_uninterrupted_greedy_answer(beside_the_pool):
    # given the uninterrupted greedy answer to a question
    platform = beside_the_pool
    reference, reference_usage, _events, _worker = stream_answer(platform)
    assert reference_usage["completion_tokens"] == 40  # long enough to be cut mid-way

    # when the same question is streamed again until it goes to MIGRANT (round robin: within
    # three), which is killed after five chunks
    for _ in range(3):
        text, usage, events, routed = stream_answer(platform, kill=MIGRANT)
        if routed == MIGRANT:
            break
        assert text == reference  # every worker answers it alike, uninterrupted
    assert routed == MIGRANT, "round robin never dealt the request to the worker of the test's own"

    # then the client got one stream, no error in it, whose text is the uninterrupted answer's
    assert not any("error" in event for event in events)
    assert text == reference
    # and usage counts each token once
    assert usage["completion_tokens"] == reference_usage["completion_tokens"]
    assert usage["prompt_tokens"] == reference_usage["prompt_tokens"]
    # and the answer did move: another worker continued it
    log = platform.log("server")
    assert f"worker {MIGRANT} went away after" in log and "migrated to" in log
    # and nothing of it is left reserved
    deadline = time.monotonic() + 5
    while platform.redis.hgetall(f"{platform.namespace}load:totals") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert platform.redis.hgetall(f"{platform.namespace}load:totals") == {}


# --- clients that hang up, with real processes ----------------------------------------------------
def test_every_client_that_hangs_up_mid_stream_stops_its_worker(pooled_sim_frontend, sim_pool):
    """The whole way from a closed connection to a stopped worker: uvicorn's disconnect, Django's
    cancellation of the request's task, the request's close, the worker's stop. (That no
    cancellation is lost on the way, as redis-py's sends under asyncio.wait_for lost them on
    Python 3.11, needs more tries than fit here: tests/test_redis_async_client.py.)"""
    platform = pooled_sim_frontend
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 4000,  # about half a minute of a simulated worker's decoding
        "stream": True,
    }
    url = f"{platform.base_url}/v1/chat/completions"
    for _ in range(3):
        # given a streamed answer under way
        with httpx.stream("POST", url, json=body, headers=platform.headers, timeout=60) as response:
            assert response.status_code == 200, response.read()
            worker, rid = response.headers["X-Routed-Worker"], response.headers["X-Request-Id"]
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    break
        # when its client hangs up after the first piece (leaving the block closes the connection)

        # then its worker stops: idle again long before its 4,000 tokens, every time
        platform.wait_until_idle(worker, timeout=10)
        # and says why: its frontend cancelled it (not that its frontend died)
        deadline = time.monotonic() + 10
        while f"request {rid} stopped after" not in (log := sim_pool.processes.log("worker-simpool")):
            assert time.monotonic() < deadline, log[-2000:]
            time.sleep(0.05)
        assert f"request {rid} dropped" not in log
