"""Requests wait their turn in the admission queue (routing.admission) when no worker can take
them, in one process against real Redis, the real router and real broker queues; the workers are
scripted at the task contract's boundary (tests.test_served_request.ScriptedWorker), and a worker
"frees" when its heartbeat says so, so nothing here depends on timing between processes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import redis
from django.conf import settings as django_settings

from inference_platform.api.boundary import new_request_id
from inference_platform.serving.errors import ApiError
from inference_platform.serving.frontend import frontend
from inference_platform.serving.served import ServedRequest
from routing.admission.queue import QueuedRequest
from routing.kv.load import LoadTracker
from tenants.keys import Caller, authenticate
from tests.test_served_request import ScriptedWorker, chat_request, pytestmark_db

pytestmark = pytestmark_db


@pytest.fixture
def busy_at_one(settings):
    """A worker is busy with one request; the queue is on, with a short wait for the tests of it."""
    settings.ROUTER_BUSY_MAX_REQUESTS = 1
    settings.ROUTER_QUEUE_ENABLED = True
    settings.ROUTER_QUEUE_MAX_WAIT_SECS = 20.0
    return settings


async def caller_of(make_api_key, tenant: str, **limits) -> Caller:
    return await asyncio.to_thread(lambda: authenticate(make_api_key(tenant, **limits)))


def queued(model: str) -> int:
    return sum(depth.depth for depth in frontend().admission_queue().depths() if depth.model == model)


def tasks_sent(worker: ScriptedWorker) -> int:
    return int(redis.Redis.from_url(django_settings.REDIS_URL).llen(worker.queue))


async def until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Wait for a state of Redis this test's own process brings about."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await asyncio.to_thread(condition):
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.02)


def free(worker: ScriptedWorker) -> None:
    worker.heartbeat = dataclasses.replace(worker.heartbeat, running=0)
    worker.beat()


async def test_a_request_no_worker_can_take_waits_holding_no_slot_and_goes_when_one_frees(
    served_demo_model, make_api_key, busy_at_one
):
    # given the only worker busy, and a tenant with a concurrency limit
    caller = await caller_of(make_api_key, "waiting-tenant", max_concurrent_requests=2)
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model, running=1)
    request = ServedRequest(new_request_id(), caller)

    # when a request comes
    opening = asyncio.ensure_future(request.open(chat_request(served_demo_model), {}))
    await until(lambda: queued(served_demo_model) == 1, "the request never queued")

    # then it waits: nothing sent, no slot of its tenant held
    assert tasks_sent(worker) == 0
    assert frontend().limiter().active(caller.tenant_id) == 0

    # and when the worker frees, it is sent there, once, with its slot taken
    await asyncio.to_thread(free, worker)
    await asyncio.wait_for(opening, 60)
    task = await worker.next_task()
    assert task.request_id == request.request_id and tasks_sent(worker) == 0
    assert queued(served_demo_model) == 0
    assert frontend().limiter().active(caller.tenant_id) == 1
    await request.close(499)


async def test_a_request_that_finds_others_waiting_goes_behind_them_though_a_worker_is_free(
    served_demo_model, make_api_key, busy_at_one
):
    # given a free worker, and a request of the model already waiting in the queue (in a higher
    # band: first in line whatever the tenants' shares)
    caller = await caller_of(make_api_key, "late-tenant")
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    queue = frontend().admission_queue()
    earlier = QueuedRequest("earlier", served_demo_model, "earlier-tenant", priority=5)
    ahead = await asyncio.to_thread(queue.join, earlier, max_depth=10, max_tenant_depth=10)

    # when a request comes
    request = ServedRequest(new_request_id(), caller)
    opening = asyncio.ensure_future(request.open(chat_request(served_demo_model), {}))
    await until(lambda: queued(served_demo_model) == 2, "the request never queued")

    # then it waits behind it (the decision refused while one waits): nothing sent or reserved
    assert tasks_sent(worker) == 0
    load = LoadTracker(worker.conn, worker.prefix)
    assert (await asyncio.to_thread(load.snapshot, ["w1"]))["w1"].active_requests == 0

    # and once the one ahead has left, it is sent to the free worker
    await asyncio.to_thread(queue.leave, ahead, dispatched=False)
    await asyncio.wait_for(opening, 60)
    assert (await worker.next_task()).request_id == request.request_id
    assert queued(served_demo_model) == 0
    await request.close(499)


async def test_a_client_gone_while_queued_leaves_the_queue_at_once_and_never_reaches_a_worker(
    served_demo_model, make_api_key, busy_at_one
):
    # given a request waiting for the only worker
    caller = await caller_of(make_api_key, "leaving-tenant")
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model, running=1)
    request = ServedRequest(new_request_id(), caller)
    opening = asyncio.ensure_future(request.open(chat_request(served_demo_model), {}))
    await until(lambda: queued(served_demo_model) == 1, "the request never queued")

    # when its client goes away (the view's task is cancelled)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening

    # then its entry is gone at once, and a worker that frees gets nothing
    assert queued(served_demo_model) == 0
    await asyncio.to_thread(free, worker)
    await asyncio.sleep(0.3)
    assert tasks_sent(worker) == 0 and request.status == 499


async def test_a_request_that_waits_past_the_max_wait_is_shed_with_a_retry_after(
    served_demo_model, make_api_key, busy_at_one
):
    # given the only worker busy for longer than a request may wait
    busy_at_one.ROUTER_QUEUE_MAX_WAIT_SECS = 0.3
    caller = await caller_of(make_api_key, "late-tenant")
    await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model, running=1)

    # when a request comes, then it is shed after its wait, with when to retry
    with pytest.raises(ApiError) as shed:
        await ServedRequest(new_request_id(), caller).open(chat_request(served_demo_model), {})
    assert (shed.value.status, shed.value.code) == (503, "queue_timeout")
    assert int(shed.value.headers["Retry-After"]) >= 1
    assert queued(served_demo_model) == 0


async def test_past_its_own_queue_depth_a_tenant_is_refused_429_and_another_tenant_still_queues(
    served_demo_model, make_api_key, busy_at_one
):
    # given a tenant with one request queued, at a depth bound of one per tenant
    busy_at_one.ROUTER_QUEUE_MAX_TENANT_DEPTH = 1
    flooding = await caller_of(make_api_key, "flooding-tenant")
    other = await caller_of(make_api_key, "other-tenant")
    await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model, running=1)
    first = asyncio.ensure_future(
        ServedRequest(new_request_id(), flooding).open(chat_request(served_demo_model), {})
    )
    await until(lambda: queued(served_demo_model) == 1, "the first request never queued")

    # when the same tenant sends another, then it is refused as its own share
    with pytest.raises(ApiError) as refused:
        await ServedRequest(new_request_id(), flooding).open(chat_request(served_demo_model), {})
    assert (refused.value.status, refused.value.code) == (429, "tenant_queue_full")
    assert refused.value.type == "rate_limit_error" and int(refused.value.headers["Retry-After"]) >= 1

    # and another tenant's request still queues
    second = asyncio.ensure_future(
        ServedRequest(new_request_id(), other).open(chat_request(served_demo_model), {})
    )
    await until(lambda: queued(served_demo_model) == 2, "the other tenant's request never queued")
    for opening in (first, second):
        opening.cancel()
    await asyncio.gather(first, second, return_exceptions=True)


async def test_a_priority_above_the_tenants_maximum_is_refused_and_a_lower_one_is_kept(
    served_demo_model, make_api_key, busy_at_one
):
    caller = await caller_of(make_api_key, "modest-tenant")
    await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model)
    asked_too_much = dataclasses.replace(chat_request(served_demo_model), priority=caller.max_priority + 1)
    with pytest.raises(ApiError) as refused:
        await ServedRequest(new_request_id(), caller).open(asked_too_much, {})
    assert (refused.value.status, refused.value.param) == (400, "priority")

    with pytest.raises(ApiError) as bad_header:
        await ServedRequest(new_request_id(), caller).open(
            chat_request(served_demo_model), {"X-Priority": "high"}
        )
    assert (bad_header.value.status, bad_header.value.param) == (400, "x-priority")

    lower = ServedRequest(new_request_id(), caller)
    await lower.open(chat_request(served_demo_model), {"X-Priority": "0"})
    assert lower.priority == 0
    await lower.close(499)


async def test_a_higher_priority_leaves_the_queue_first_and_its_task_carries_it_to_the_engine(
    served_demo_model, make_api_key, busy_at_one
):
    # given a batch request waiting for the only worker, then an interactive one
    batch = await caller_of(make_api_key, "batch-tenant")
    interactive = await caller_of(make_api_key, "interactive-tenant", default_priority=9, max_priority=9)
    worker = await asyncio.to_thread(ScriptedWorker, "w1", served_demo_model, running=1)
    first = ServedRequest(new_request_id(), batch)
    second = ServedRequest(new_request_id(), interactive)
    opening_first = asyncio.ensure_future(first.open(chat_request(served_demo_model), {}))
    await until(lambda: queued(served_demo_model) == 1, "the batch request never queued")
    opening_second = asyncio.ensure_future(second.open(chat_request(served_demo_model), {}))
    await until(lambda: queued(served_demo_model) == 2, "the interactive request never queued")

    # when the worker frees for one request
    await asyncio.to_thread(free, worker)
    await asyncio.wait_for(opening_second, 60)
    busy = dataclasses.replace(worker.heartbeat, running=1)
    worker.heartbeat = busy
    await asyncio.to_thread(worker.beat)

    # then the interactive one went first, its priority in its task; the batch one still waits
    task = await worker.next_task()
    assert (task.request_id, task.priority) == (second.request_id, 9)
    assert not opening_first.done() and queued(served_demo_model) == 1
    await second.close(499)
    opening_first.cancel()
    await asyncio.gather(opening_first, return_exceptions=True)
