"""E/PD across real processes: a uvicorn frontend, an `llm` worker and an `encode` worker (real
`run_worker` processes, Celery over the real Redis broker), one set shared by the module's tests,
which run in order: the encoder drained, killed, then gone.
"""

from __future__ import annotations

import base64
import io
import json
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy
import pytest
from PIL import Image

from routing.fleet.encoders import EncoderPool
from tests.conftest import TEST_REDIS_URL
from tests.image_server import ImageServer
from tests.platform_harness import PlatformProcesses

pytestmark = pytest.mark.integration


def png(seed: int, size: tuple[int, int] = (140, 112)) -> bytes:
    """The same bytes for the same seed (the identity of a data URL is its bytes')."""
    pixels = numpy.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=numpy.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


def body(text: str, *image_urls: str, max_tokens: int = 8) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return {
        "model": "demo",
        "max_tokens": max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
    }


@pytest.fixture(scope="module")
def origin() -> Iterator[ImageServer]:
    with ImageServer() as server:
        yield server


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Iterator[PlatformProcesses]:
    namespace = f"test:epd{time.monotonic_ns() % 10**9}:"
    processes = PlatformProcesses(
        tmp_path_factory.mktemp("epd"),
        demo_model_dir,
        TEST_REDIS_URL,
        namespace,
        {"MEDIA_ALLOWED_HOSTS": "127.0.0.1", "EPD_ENCODE_WAIT_SECS": "20"},
    )
    try:
        processes.start_worker("llm", "--role", "llm")
        processes.start_worker("enc", "--role", "encode")
        processes.wait_for_workers("llm", "enc")
        processes.start_server()
        yield processes
    finally:
        processes.close()


@pytest.fixture(scope="module")
def admin(platform: PlatformProcesses) -> httpx.Client:
    """A staff session in the platform's own admin."""
    created = platform.manage("ensure_admin")
    password = re.search(r"password '([^']+)'", created).group(1)
    client = httpx.Client(base_url=platform.base_url, timeout=30)
    client.get("/admin/login/")
    login = client.post(
        "/admin/login/?next=/admin/",
        data={"username": "admin", "password": password, "csrfmiddlewaretoken": client.cookies["csrftoken"]},
        headers={"Referer": f"{platform.base_url}/admin/login/"},
    )
    assert login.status_code in (200, 302) and "sessionid" in client.cookies
    return client


def admin_action(admin: httpx.Client, action: str, worker: str) -> None:
    listing = admin.get("/admin/routing/worker/")
    row_id = re.search(rf'href="/admin/routing/worker/(\d+)/change/[^"]*">{worker}<', listing.text).group(1)
    done = admin.post(
        "/admin/routing/worker/",
        data={
            "action": action,
            "_selected_action": row_id,
            "index": "0",
            "csrfmiddlewaretoken": admin.cookies["csrftoken"],
        },
        headers={"Referer": f"{admin.base_url}/admin/routing/worker/"},
    )
    assert done.status_code in (200, 302), done.text[:500]


def counters(platform: PlatformProcesses, worker: str) -> dict[str, int]:
    return EncoderPool(
        platform.redis, platform.namespace, statistics_namespace=platform.statistics_namespace
    ).snapshot([worker])[worker]


def ask(platform: PlatformProcesses, payload: dict) -> httpx.Response:
    response = httpx.post(
        f"{platform.base_url}/v1/chat/completions", json=payload, headers=platform.headers, timeout=90
    )
    assert response.status_code == 200, response.text
    return response


@pytest.fixture(scope="module")
def remembered() -> dict[str, str]:
    """Answers one test keeps for a later one (the module's tests share their processes)."""
    return {}


def test_an_epd_request_is_answered_with_the_llm_workers_encoder_never_called(
    platform, admin, remembered
) -> None:
    # given the admin lists both roles, and the route shows the image going to the encoder
    listing = admin.get("/admin/routing/worker/").text
    assert "Generate (LLM worker, E/PD)" in listing and "Encode images (encode worker, E/PD)" in listing
    request = body("What is in this picture?", data_url(1))
    route = httpx.post(
        f"{platform.base_url}/v1/route", json=request, headers=platform.headers, timeout=30
    ).json()
    assert route["choice"]["worker"] == "llm"
    assert route["encode"]["mode"] == "epd" and route["encode"]["images"] == [0]
    assert route["encode"]["choice"] == "enc"
    (candidate,) = route["encode"]["candidates"]
    assert (candidate["worker"], candidate["cached"], candidate["pending"], candidate["cost"]) == (
        "enc",
        0,
        0,
        1.0,
    )

    # when the request is sent
    answer = ask(platform, request)

    # then the LLM worker answered with features it received, and its tower's forward hook never fired
    assert answer.headers["X-Routed-Worker"] == "llm"
    remembered["first"] = answer.json()["choices"][0]["message"]["content"]
    assert remembered["first"]
    time.sleep(0.3)
    llm, enc = counters(platform, "llm"), counters(platform, "enc")
    assert llm["tower_forwards"] == 0
    assert llm["received"] == 1 and llm["received_bytes"] > 0
    assert enc["tower_forwards"] == 1 and (enc["images"], enc["cache_misses"]) == (1, 1)
    assert "fallback" not in platform.log("worker-llm")


def test_the_same_image_again_hits_the_encode_workers_embedding_cache(platform, admin) -> None:
    # given the image was encoded by the first test; another question about it is not covered by
    # the LLM worker's cached prefix (the text comes before the image)
    request = body("Name the colours you can see in it.", data_url(1))
    route = httpx.post(
        f"{platform.base_url}/v1/route", json=request, headers=platform.headers, timeout=30
    ).json()
    assert route["encode"]["candidates"][0]["cached"] == 1, route["encode"]

    ask(platform, request)
    ask(platform, body("Name the colours you can see in it.", data_url(1)) | {"max_tokens": 3})

    time.sleep(0.3)
    enc = counters(platform, "enc")
    assert enc["cache_hits"] >= 1 and enc["cache_misses"] == 1 and enc["tower_forwards"] == 1
    assert counters(platform, "llm")["tower_forwards"] == 0

    # and the operator sees it: the dashboard's E/PD figures and /metrics
    section = admin.get("/admin/dashboard.json").json()["encoders"]
    figures = {entry["name"]: entry for entry in section["workers"]}
    assert figures["enc"]["role"] == "encode" and figures["llm"]["role"] == "llm"
    assert figures["enc"]["embedding_cache_hit_rate"] == enc["cache_hits"] / (enc["cache_hits"] + 1)
    assert figures["enc"]["put_bytes_per_image"] > 0 and figures["llm"]["get_ms_per_image"] is not None
    assert (figures["enc"]["pending"], figures["enc"]["busy"]) == (0, 0)
    metrics = httpx.get(f"{platform.base_url}/metrics", headers=platform.headers, timeout=30).text
    assert 'mmr_vision_tower_forwards_total{worker="llm"} 0.0' in metrics
    assert f'mmr_epd_embedding_cache_hits_total{{worker="enc"}} {float(enc["cache_hits"])}' in metrics
    assert 'mmr_encoder_pending_images{worker="enc"} 0.0' in metrics


def test_flush_caches_empties_the_encode_workers_embedding_cache_and_its_affinity(platform) -> None:
    # given the encoder holds the first tests' image
    request = body("Name the colours you can see in it.", data_url(1))

    flushed = platform.manage("flush_caches", "--worker", "enc", "--cache", "embeddings", "--json")

    assert json.loads(flushed.splitlines()[-1])["workers"]["enc"]["embeddings"] == 1
    route = httpx.post(
        f"{platform.base_url}/v1/route", json=request, headers=platform.headers, timeout=30
    ).json()
    assert route["encode"]["candidates"][0]["cached"] == 0


def test_a_drained_encode_worker_gets_nothing_new(platform, admin) -> None:
    before = counters(platform, "enc")["images"]
    admin_action(admin, "drain", "enc")
    time.sleep(1.2)  # the frontend rereads the workers' rows per request; give the admin's write a moment

    route = httpx.post(
        f"{platform.base_url}/v1/route",
        json=body("And now?", data_url(2)),
        headers=platform.headers,
        timeout=30,
    ).json()
    assert route["encode"]["mode"] == "aggregated"
    assert route["encode"]["candidates"][0]["ineligible_because"] == "draining"
    ask(platform, body("And now?", data_url(2)))

    time.sleep(0.3)
    assert counters(platform, "enc")["images"] == before
    # the LLM worker encoded the image itself: its tower was loaded back and ran once
    assert counters(platform, "llm")["tower_forwards"] == 1
    admin_action(admin, "enable", "enc")


def test_a_backlogged_encoder_leaves_the_image_on_the_llm_worker_with_the_same_answer(
    platform, remembered
) -> None:
    # given the encoder re-enabled (previous test) with a simulated backlog: five images reserved
    # on it as a frontend does, and the LLM worker's cached prefix of the first question forgotten
    time.sleep(1.2)  # the admin's "enable"
    platform.manage("flush_caches", "--worker", "llm", "--json")
    pool = EncoderPool(
        platform.redis,
        platform.namespace,
        pending_ttl_s=30,
        statistics_namespace=platform.statistics_namespace,
    )
    backlog = [f"simulated-backlog:{n}" for n in range(5)]
    pool.reserve("enc", backlog)
    try:
        request = body("What is in this picture?", data_url(1))
        route = httpx.post(
            f"{platform.base_url}/v1/route", json=request, headers=platform.headers, timeout=30
        ).json()
        # then the route shows the split: the encoder's backlog outweighs encoding it locally
        split = route["encode"]["split"]
        assert route["encode"]["mode"] == "epd" and route["encode"]["kept_local"] == [0], route["encode"]
        assert route["encode"]["images"] == [] and split["to_encoder"] == []
        assert split["encoder_backlog_ms"] == pytest.approx(5 * split["encode_ms"])
        assert split["local_weight"] == 1.5 and split["enabled"] is True
        before_llm, before_enc = counters(platform, "llm"), counters(platform, "enc")

        answer = ask(platform, request)
    finally:
        pool.release("enc", backlog)

    # and the LLM worker encoded the image itself, with the answer the encoder's features gave
    time.sleep(0.3)
    assert answer.json()["choices"][0]["message"]["content"] == remembered["first"]
    assert counters(platform, "llm")["tower_forwards"] == before_llm["tower_forwards"] + 1
    assert counters(platform, "llm")["received"] == before_llm["received"]
    assert counters(platform, "enc")["images"] == before_enc["images"]
    assert "image(s) 0 stay on llm" in platform.log("server")


def test_an_encode_worker_killed_mid_request_leaves_it_answered_through_the_fallback(
    platform, origin
) -> None:
    # given an image whose origin takes seconds to send it: the encoder is still fetching it when killed
    url = origin.add("/slow.png", png(3), content_type="image/png", body_delay=2.5)
    time.sleep(1.2)  # the admin's "enable" from the previous test
    fallbacks_before = counters(platform, "llm")["fallback_encoder_gone"]

    with httpx.Client(timeout=90, headers=platform.headers) as client:
        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answers.append(
                client.post(f"{platform.base_url}/v1/chat/completions", json=body("What is this?", url))
            )
        )
        sender.start()
        deadline = time.monotonic() + 15
        while counters(platform, "enc")["busy"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counters(platform, "enc")["busy"] == 1, "the encoder never started the image"
        platform.stop_worker("enc", signal.SIGKILL)
        sender.join(60)

    assert answers and answers[0].status_code == 200, answers and answers[0].text
    assert answers[0].json()["choices"][0]["message"]["content"]
    time.sleep(0.3)
    assert counters(platform, "llm")["fallback_encoder_gone"] == fallbacks_before + 1
    assert "encoding image(s) 0 locally (fallback): encode worker enc went away" in platform.log("worker-llm")


def test_with_no_live_encode_worker_requests_take_the_aggregated_path_with_the_same_answer(
    platform, remembered
) -> None:
    # given the encoder is gone (killed above), and the first test's question asked again after
    # the LLM worker forgot its cached prefix
    platform.redis.delete(f"{platform.namespace}hb:enc")
    platform.manage("flush_caches", "--worker", "llm", "--json")
    request = body("What is in this picture?", data_url(1))
    route = httpx.post(
        f"{platform.base_url}/v1/route", json=request, headers=platform.headers, timeout=30
    ).json()
    assert route["encode"]["mode"] == "aggregated"
    received = counters(platform, "llm")["received"]

    answer = ask(platform, request)

    time.sleep(0.3)
    assert counters(platform, "llm")["received"] == received
    assert counters(platform, "llm")["tower_forwards"] >= 2  # encoded locally this time
    assert answer.json()["choices"][0]["message"]["content"] == remembered["first"]
