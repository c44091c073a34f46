"""The operator's worker rows a frontend keeps between requests (routing.fleet.worker_rows): read once
while their generation in the real Redis stands, read again at the next request after any
change Django makes, and never trusted across a Redis that lost the generation."""

from __future__ import annotations

import dataclasses

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings as django_settings
from django.db import connection

from inference_platform.serving import dispatch
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.fleet.worker_rows import GENERATION_KEY, KeptRows, WorkerRow, announce_change
from routing.models import Worker
from routing.state import pacing
from routing.state.redis_keys import sync_client

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "rows-model"


@pytest.fixture
def redis_conn():
    return sync_client(django_settings.REDIS_URL)


@pytest.fixture
def generation_key(redis_conn):
    key = f"{django_settings.REDIS_KEY_PREFIX}{GENERATION_KEY}"
    yield key
    redis_conn.delete(key)


@pytest.fixture
def live_worker(redis_conn, generation_key):
    """One registered worker whose heartbeat says it serves MODEL."""
    registry = WorkerRegistry(redis_conn, django_settings.REDIS_KEY_PREFIX)
    Worker.objects.create(name="rows-w", model_name=MODEL)
    registry.beat(Heartbeat(name="rows-w", model=MODEL, block_size=django_settings.KV_BLOCK_SIZE), 30)
    yield "rows-w"
    registry.remove("rows-w")


async def why_not(name: str) -> str | None:
    states = await dispatch.worker_states(MODEL, django_settings.KV_BLOCK_SIZE)
    return {state.name: state.ineligible_because for state in states}[name]


def disable_around_django(name: str) -> None:
    """A change no signal tells of (a database edited by hand): only the generation or the
    rows' age can bring it in."""
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {Worker._meta.db_table} SET enabled = %s WHERE name = %s", [False, name])


async def test_kept_rows_serve_until_the_generation_moves(live_worker, redis_conn):
    # given rows read once
    assert await why_not(live_worker) is None

    # when the row changes where no frontend hears of it
    await sync_to_async(disable_around_django)(live_worker)

    # then the kept rows still serve (no query per request)
    assert await why_not(live_worker) is None
    # and once another frontend announces a change, the next request reads the rows again
    announce_change(redis_conn, django_settings.REDIS_KEY_PREFIX)
    assert await why_not(live_worker) == "disabled in the admin"


async def test_a_save_an_update_and_a_delete_each_reach_the_next_request(
    live_worker, redis_conn, generation_key
):
    # given rows read once, under a generation
    assert await why_not(live_worker) is None
    generation = redis_conn.get(generation_key)
    assert generation

    # when an operator drains the worker with the admin's action (a queryset update, no signal)
    await Worker.objects.filter(name=live_worker).aupdate(draining=True)
    # then the next request sees it, and so would every other frontend: the generation moved
    assert await why_not(live_worker) == "draining"
    assert redis_conn.get(generation_key) not in (None, generation)

    # when an operator saves the row in the admin's form
    worker = await Worker.objects.aget(name=live_worker)
    worker.draining, worker.enabled = False, False
    await worker.asave()
    assert await why_not(live_worker) == "disabled in the admin"

    # when the row is deleted, the worker is gone from the next decision
    await worker.adelete()
    states = await dispatch.worker_states(MODEL, django_settings.KV_BLOCK_SIZE)
    assert live_worker not in {state.name for state in states}


async def test_a_redis_that_lost_the_generation_never_vouches_for_kept_rows(
    live_worker, redis_conn, generation_key
):
    # given rows kept under the generation Redis had
    assert await why_not(live_worker) is None
    before = redis_conn.get(generation_key)

    # when Redis loses its data (restarted empty) and the row changes meanwhile
    redis_conn.delete(generation_key)
    await sync_to_async(disable_around_django)(live_worker)

    # then the next request finds a fresh generation, not the one its rows were read under
    assert await why_not(live_worker) == "disabled in the admin"
    assert redis_conn.get(generation_key) not in (None, before)


def test_rows_older_than_their_bound_are_not_trusted_whatever_the_generation() -> None:
    now = [100.0]
    kept = KeptRows(max_age_s=10.0, clock=lambda: now[0])
    rows = (WorkerRow("w", True, False),)
    kept.put(b"g1", rows)

    now[0] += 9.9
    assert kept.get() == (b"g1", rows)
    now[0] += 0.2
    assert kept.get() is None
    kept.put(b"g2", rows)
    kept.clear()
    assert kept.get() is None


async def test_a_fleet_read_made_in_the_background_has_the_last_reads_answers_ready(live_worker):
    # given: a read that a request asked for the eligible workers
    first = await dispatch.eligible_workers(MODEL, django_settings.KV_BLOCK_SIZE)
    assert live_worker in first

    # when: the next read is made, as the background does once the read ages
    read = await dispatch._read_again(MODEL)

    # then: the request that asks next finds the answer worked out, reports included
    def asked_again(_read):
        raise AssertionError("worked out in the request's path")

    eligible = read.derived(("eligible", django_settings.KV_BLOCK_SIZE, ""), asked_again)
    assert eligible is not first and live_worker in eligible
    assert "reports" in vars(eligible) and live_worker in eligible.reports


async def test_a_fleet_read_made_in_the_background_works_out_again_only_the_workers_whose_beat_changed(
    live_worker, redis_conn
):
    # given: a second worker, and a read whose states, eligible workers and reports were asked
    registry = WorkerRegistry(redis_conn, django_settings.REDIS_KEY_PREFIX)
    await sync_to_async(Worker.objects.create)(name="rows-x", model_name=MODEL)
    beat = Heartbeat(name="rows-x", model=MODEL, block_size=django_settings.KV_BLOCK_SIZE)
    registry.beat(beat, 30)
    try:
        block_size = django_settings.KV_BLOCK_SIZE
        states = {s.name: s for s in await dispatch.worker_states(MODEL, block_size)}
        first = await dispatch.eligible_workers(MODEL, block_size)
        assert set(first) == {live_worker, "rows-x"}
        reports = first.reports

        # when: rows-x beats again saying it is stopping, the other's beat is as it was, and the
        # next read is made, as the background makes it
        registry.beat(dataclasses.replace(beat, stopping=True, beat_at=1.0), 30)
        read = await dispatch._read_again(MODEL)

        # then: what was worked out of the unchanged beat stands, the same objects; the changed
        # beat's worker is worked out again, now not eligible
        again = {s.name: s for s in await dispatch.worker_states(MODEL, block_size)}
        assert again[live_worker] is states[live_worker]
        assert again["rows-x"] is not states["rows-x"]
        assert again["rows-x"].ineligible_because == "shutting down"
        eligible = read.derived(("eligible", block_size, ""), lambda _read: pytest.fail("not prepared"))
        assert set(eligible) == {live_worker} and eligible.reports[live_worker] is reports[live_worker]
        assert eligible.earlier is None  # a read holds on to nothing of the one before it

        # and: once the operator's rows move, the next read works everything out afresh
        await sync_to_async(Worker.objects.filter(name="rows-x").update)(enabled=False)
        await dispatch._read_again(MODEL)
        afresh = {s.name: s for s in await dispatch.worker_states(MODEL, block_size)}
        assert afresh[live_worker] is not states[live_worker] and afresh[live_worker] == states[live_worker]
        assert afresh["rows-x"].ineligible_because == "disabled in the admin"
    finally:
        registry.remove("rows-x")


async def test_a_fleet_read_reads_and_works_out_its_workers_as_paced_passes(live_worker, monkeypatch):
    # given: a read that a request asked for the eligible workers, and the passes that run paced
    # (routing.state.pacing: they let the event loop's decisions in while they work) recorded
    await dispatch.eligible_workers(MODEL, django_settings.KV_BLOCK_SIZE)
    passes: list[str] = []

    def recorded(fn, *args, **kwargs):
        passes.append(fn.__name__)
        return pacing.paced(fn, *args, **kwargs)

    monkeypatch.setattr(dispatch, "paced", recorded)

    # when: the next read is made, as the background makes it
    await dispatch._read_again(MODEL)

    # then: its heartbeats were read, and the last read's answers worked out again, paced
    assert passes in (["_heartbeats_if_current", "prepare_like"], ["_heartbeats", "prepare_like"])
