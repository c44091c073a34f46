"""Simulated workers behind the real platform: one `run_worker --engine sim --count 3` process (the
session's `sim_pool`) serves real chat requests routed by the real router over the real index,
fed by its pools' KV events; a repeated image goes back to the worker that cached it and is
answered from its pool."""

from __future__ import annotations

import json

import httpx

from routing.kv.index import KvIndex
from tests.image_server import ImageServer
from tests.test_routing_end_to_end import image_request, overlap_of, picture


def test_simulated_workers_serve_chat_and_a_repeated_image_goes_back_to_its_worker(
    pooled_sim_platform, sim_pool
):
    # given: three simulated workers in one process, and a frontend (a tenant of the test's own)
    platform = pooled_sim_platform()
    names = sim_pool.names
    base_url = platform.start_server()
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
