"""Simulated workers behind the real platform: one `run_worker --engine sim --count 3` process (the
session's `sim_pool`) serves real chat requests routed by the real router over the real index,
fed by its pools' KV events; a repeated image goes back to the worker that cached it and is
answered from its pool. An operator's `flush_caches` empties a simulated pool as it empties a
native one, and a simulated worker's engine TTFT is on its simulated clock (what
bench/workload.py compares): the session's held worker (`held_worker_pool`), whose pool has a
size of its own and whose clock runs faster than real time."""

from __future__ import annotations

import json

import httpx
import pytest

from routing.fleet.registry import WorkerRegistry
from routing.kv.index import KvIndex
from tests.conftest import HELD_KV_BLOCKS, HELD_WORKER, WorkerPool
from tests.image_server import ImageServer
from tests.platform_harness import PlatformProcesses
from tests.test_observability_end_to_end import eventually, scrape
from tests.test_routing_end_to_end import image_request, overlap_of, picture
from workers.sim_engine.profile import load_profile


def test_simulated_workers_serve_chat_and_a_repeated_image_goes_back_to_its_worker(
    pooled_sim_frontend, sim_pool
):
    # given: three simulated workers in one process, and a frontend (a tenant of the test's own)
    platform = pooled_sim_frontend
    names = sim_pool.names
    base_url = platform.base_url
    with ImageServer() as origin:
        url = origin.add("/demo.png", picture(1), content_type="image/png")
        # when
        first, second = (
            httpx.post(
                f"{base_url}/v1/chat/completions",
                json=image_request(url),
                headers=platform.headers,
                timeout=60,
            )
            for _ in range(2)
        )
        streamed = httpx.post(
            f"{base_url}/v1/chat/completions",
            json={**image_request(url), "stream": True},
            headers=platform.headers,
            timeout=60,
        )
        route = httpx.post(
            f"{base_url}/v1/route", json=image_request(url), headers=platform.headers, timeout=60
        )
    # then
    assert first.status_code == 200, first.text
    assert second.status_code == 200, second.text
    worker = first.headers["X-Routed-Worker"]
    assert worker in names
    assert second.headers["X-Routed-Worker"] == worker
    usage = first.json()["usage"]
    assert usage["completion_tokens"] == 4 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    overlap, total = overlap_of(second)
    assert overlap >= total - 1 > 0
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= overlap * 16 > 0
    # the pool's KV events reached the index under the worker's own name, and nobody else's (the
    # workers are the session's: other tests' blocks are theirs, the prompt's are the worker's)
    blocks = set(route.json()["block_hashes"][:overlap])
    index = KvIndex(platform.redis, platform.namespace)
    assert blocks and blocks <= index.worker_blocks(worker)
    assert not any(blocks & index.worker_blocks(other) for other in names if other != worker)
    # streaming: the tokens arrive as server-sent events
    chunks = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert streamed.headers["X-Routed-Worker"] == worker
    assert len(chunks) >= 4 and json.loads(chunks[0][6:])["object"] == "chat.completion.chunk"


def ask(base_url: str, platform, url: str) -> httpx.Response:
    response = httpx.post(
        f"{base_url}/v1/chat/completions", json=image_request(url), headers=platform.headers, timeout=60
    )
    assert response.status_code == 200, response.text
    return response


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


TUNED = HELD_WORKER


@pytest.fixture
def tuned(held_worker_pool: WorkerPool) -> PlatformProcesses:
    """The session's held worker, TUNED, alone in its platform, given a pool size of its own (as
    bench/workload.py gives it a native worker's KV_CAPACITY_BLOCKS) and running HELD_SPEEDUP
    times faster than real time, and its running frontend (a tenant of the test's own): the
    module's tests each read it from a state they make or measure from (those that freeze it thaw
    it before they end)."""
    platform = held_worker_pool.running_frontend()
    platform.wait_until_idle(TUNED)  # no earlier test's request still running, nor counted later
    return platform


def test_flush_caches_empties_a_simulated_workers_pool_and_the_index_so_the_next_request_is_cold(tuned):
    # given: a simulated worker whose pool is given a size of its own, emptied first (other tests
    # may have used it), which has served a picture twice
    platform, name, base_url = tuned, TUNED, tuned.base_url
    platform.manage("flush_caches")
    index = KvIndex(platform.redis, platform.namespace)
    assert not index.worker_blocks(name)
    with ImageServer() as origin:
        url = origin.add("/flushed.png", picture(7), content_type="image/png")
        ask(base_url, platform, url)
        warm = ask(base_url, platform, url)
        blocks = index.worker_blocks(name)
        assert cached_tokens(warm) > 0 and blocks
        capacity = WorkerRegistry(platform.redis, platform.namespace).alive([name])[name].kv_capacity_blocks
        assert capacity == HELD_KV_BLOCKS
        # when
        report = json.loads(platform.manage("flush_caches", "--json").strip().splitlines()[-1])
        # then: the worker dropped what it held and said so to the index
        assert report["workers"][name]["kv_blocks"] == len(blocks)
        assert not index.worker_blocks(name)
        # and the same picture is computed again, then held and announced again
        again = ask(base_url, platform, url)
        assert cached_tokens(again) == 0
        assert index.worker_blocks(name) == blocks


def test_a_simulated_workers_engine_ttft_is_on_its_simulated_clock(tuned):
    # given: a simulated worker running 50 times faster than real time, its caches emptied and
    # its engine's TTFT figures so far read (other tests may have used it)
    platform, base_url = tuned, tuned.base_url
    platform.manage("flush_caches")
    labels = (("worker", TUNED),)
    count, total = ("mmr_engine_ttft_seconds_count", labels), ("mmr_engine_ttft_seconds_sum", labels)
    before = scrape(base_url, platform.headers)
    with ImageServer() as origin:
        url = origin.add("/fast.png", picture(8), content_type="image/png")
        # when: a prompt no cache holds
        answer = ask(base_url, platform, url)
    assert cached_tokens(answer) == 0
    # then: the engine TTFT /metrics shows is at least what the profile models for its prefill, in
    # simulated seconds (the wall clock saw a fiftieth of it); the engine takes it as a difference of two
    # clock readings, so it may round a few ulps under the profile's own figure
    modelled = load_profile("cpu-demo").step_seconds(answer.json()["usage"]["prompt_tokens"], 0, images=1)
    samples = eventually(
        lambda: scrape(base_url, platform.headers),
        lambda s: s.get(count, 0) == before.get(count, 0) + 1,
    )
    assert samples.get(count, 0) == before.get(count, 0) + 1
    assert samples[total] - before.get(total, 0) >= modelled * (1 - 1e-9)
