"""KV-aware routing across real processes: the seed's example, and frontends that agree.

Real `run_worker` processes publish their KV events to Redis; real uvicorn frontends route on
the shared index; a local image server stands in for the image's origin.
"""

from __future__ import annotations

import io
import json
import re
import time

import httpx
import pytest
from PIL import Image

from routing.kv.index import KvIndex
from tests.conftest import POOL_WORKERS
from tests.image_server import ImageServer


def picture(seed: int, size: tuple[int, int] = (336, 280)) -> bytes:
    image = Image.effect_noise(size, 40 + seed).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_request(url: str, question: str = "Describe this image.") -> dict:
    return {
        "model": "demo",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "max_tokens": 4,
        "temperature": 0,
    }


@pytest.fixture
def origin():
    with ImageServer() as server:
        yield server


def overlap_of(response: httpx.Response) -> tuple[int, int]:
    done, total = response.headers["X-Routing-Overlap"].split("/")
    return int(done), int(total)


def route_until_overlap(base_url: str, headers: dict, body: dict, within_s: float = 20.0) -> dict | None:
    """`/v1/route`'s choice for `body` once it shows an overlap (Redis, or the index, may be
    coming back meanwhile: errors are retried), or None if none does within `within_s`."""
    since = time.monotonic()
    while time.monotonic() - since < within_s:
        try:
            seen = httpx.post(f"{base_url}/v1/route", json=body, headers=headers, timeout=10)
        except httpx.HTTPError:
            seen = None
        if seen is not None and seen.status_code == 200 and (seen.json().get("choice") or {}).get("overlap"):
            return seen.json()["choice"]
        time.sleep(0.2)
    return None


def test_the_same_image_twice_goes_back_to_the_worker_that_served_it(pooled_platform, origin):
    # the session's pool of workers, and a frontend that logs its routing decisions
    platform = pooled_platform(LOG_LEVELS="routing=debug")
    base_url = platform.start_server()
    url = origin.add("/demo.png", picture(1), content_type="image/png")

    first = httpx.post(
        f"{base_url}/v1/chat/completions", json=image_request(url), headers=platform.headers, timeout=60
    )
    second = httpx.post(
        f"{base_url}/v1/chat/completions", json=image_request(url), headers=platform.headers, timeout=60
    )
    assert first.status_code == 200, first.text
    assert second.status_code == 200, second.text

    worker = first.headers["X-Routed-Worker"]
    assert second.headers["X-Routed-Worker"] == worker
    (first_overlap, total), (second_overlap, second_total) = overlap_of(first), overlap_of(second)
    assert second_total == total
    assert second_overlap > first_overlap
    assert second_overlap == total - 1 or second_overlap == total  # all full blocks of the prompt
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= second_overlap * 16

    # The routing log says the same, as the seed's [ROUTING] line.
    best = re.findall(
        r"\[ROUTING\] Best: worker_(\w+) with (\d+)/(\d+) blocks overlap", platform.log("server")
    )
    assert best[-2:] == [(worker, str(first_overlap), str(total)), (worker, str(second_overlap), str(total))]
    # one formula line per worker for each of the two decisions
    formulas = re.findall(r"\[ROUTING\] Formula for worker_", platform.log("server"))
    assert len(formulas) >= 2 * len(POOL_WORKERS)

    # A different image under the same question shares only the text before it.
    other = origin.add("/other.png", picture(2), content_type="image/png")
    third = httpx.post(
        f"{base_url}/v1/chat/completions", json=image_request(other), headers=platform.headers, timeout=60
    )
    assert overlap_of(third)[0] < second_overlap

    # The worker that prefilled the picture reports its measured prefill rate in its heartbeat
    # (the router drains the prefill it reserves there at that rate).
    deadline, rate = time.monotonic() + 10, 0.0
    while rate <= 0 and time.monotonic() < deadline:
        time.sleep(0.5)
        rate = json.loads(platform.redis.get(platform.heartbeat_key(worker)))["prefill_tokens_per_s"]
    assert rate > 0


def test_two_frontend_processes_make_identical_choices(pooled_frontend, pooled_platform, origin):
    # the session's running frontend, and one of the test's own that has served nothing
    platform = pooled_frontend
    first_frontend = platform.base_url
    second_frontend = pooled_platform().start_server()
    url = origin.add("/shared.png", picture(3), content_type="image/png")

    served = httpx.post(
        f"{first_frontend}/v1/chat/completions", json=image_request(url), headers=platform.headers, timeout=60
    )
    assert served.status_code == 200

    body = image_request(url, "Describe this image.")
    seen = [
        httpx.post(f"{frontend}/v1/route", json=body, headers=platform.headers, timeout=30).json()
        for frontend in (first_frontend, second_frontend)
    ]
    assert seen[0]["choice"] == seen[1]["choice"]
    assert seen[0]["candidates"] == seen[1]["candidates"]
    assert seen[0]["choice"]["worker"] == served.headers["X-Routed-Worker"]
    assert seen[0]["choice"]["overlap"] > 0
    # The second frontend never served anything, yet routes the repeat to the worker holding it.
    repeat = httpx.post(
        f"{second_frontend}/v1/chat/completions", json=body, headers=platform.headers, timeout=60
    )
    assert repeat.headers["X-Routed-Worker"] == served.headers["X-Routed-Worker"]


def test_a_worker_without_kv_events_is_routed_in_approximate_mode(platform_processes, origin):
    # given: two simulated workers that publish no KV events (one process), idle
    platform = platform_processes(MEDIA_ALLOWED_HOSTS="127.0.0.1", ROUTER_APPROXIMATE_TTL_SECS="600")
    names = platform.start_sim_workers("quiet", 2, "--no-kv-events")
    platform.wait_for_workers(*names)
    base_url = platform.start_server()
    url = origin.add("/quiet.png", picture(7), content_type="image/png")
    first = httpx.post(
        f"{base_url}/v1/chat/completions", json=image_request(url), headers=platform.headers, timeout=60
    )
    served_by = first.headers["X-Routed-Worker"]
    (other,) = set(names) - {served_by}
    assert not platform.redis.exists(f"{platform.namespace}kv:w:{served_by}"), "it published no events"

    # The other worker is as idle as ever. The router remembered its own decision, so the repeat
    # still goes to the worker that cached the prompt, credited with it, and it really hits.
    platform.wait_until_idle(served_by)
    again = httpx.post(
        f"{base_url}/v1/chat/completions", json=image_request(url), headers=platform.headers, timeout=60
    )
    assert again.headers["X-Routed-Worker"] == served_by
    assert overlap_of(again)[0] == overlap_of(first)[1] - 1 or overlap_of(again)[0] == overlap_of(first)[1]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    index = KvIndex(platform.redis, platform.namespace)
    assert index.worker_blocks(served_by), "approximate blocks, with a TTL"
    assert not index.worker_blocks(other), "nothing credited to the worker that served nothing"
