"""The frontend keeps the sizes it read by URL (routing.media.images.ImageSizes), so a repeat question
about a picture is routed without a round trip to its origin; scoped, bounded, as fresh as the
origin allows, and forgotten when a worker finds the picture changed."""

from __future__ import annotations

import httpx
import pytest

from bench.samples import noise_png
from routing.media.images import ImageSizes, MediaError, MediaPolicy, freshness, resolve_images, url_identity
from tests.image_server import ImageServer

LOCAL = MediaPolicy(allowed_hosts=("127.0.0.1",), connect_timeout=2.0, read_timeout=2.0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def origin():
    with ImageServer() as server:
        yield server


@pytest.mark.parametrize(
    ("cache_control", "seconds"),
    [
        ("", 60.0),
        ("public, max-age=5", 5.0),
        ("max-age=3600", 60.0),  # never longer than the platform's own bound
        ("max-age=30, s-maxage=10", 10.0),  # the shared-cache figure: this is a shared cache
        ('max-age="20"', 20.0),
        ("max-age=0", 0.0),
        ("max-age=soon", 0.0),  # unreadable: nothing kept rather than a guess
        ("no-store", 0.0),
        ("no-cache, max-age=600", 0.0),
        ("Private, max-age=600", 0.0),  # another user's picture, maybe
    ],
)
def test_a_size_stays_as_long_as_the_origins_cache_control_allows(cache_control: str, seconds: float) -> None:
    assert freshness(cache_control, 60.0) == seconds


def test_a_size_read_by_url_is_not_asked_of_the_origin_again_in_the_same_scope(origin) -> None:
    url = origin.add("/p.png", noise_png("p", 64))
    sizes = ImageSizes(60.0)

    first = resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=("tenant", None))
    again = resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=("tenant", None))
    assert origin.hits("/p.png") == 1
    assert (again[0].width, again[0].height, again[0].identity) == (64, 64, first[0].identity)

    # another partition (tenant or session) pays its own round trip: no timing tells it what
    # the first one asked about
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=("other", None))
    assert origin.hits("/p.png") == 2
    # and without the cache every request asks
    resolve_images([url], LOCAL, frontend_decoding=False)
    assert origin.hits("/p.png") == 3


def test_an_origin_that_says_no_store_is_asked_every_time(origin) -> None:
    url = origin.add("/p.png", noise_png("p", 64), headers={"Cache-Control": "no-store"})
    sizes = ImageSizes(60.0)
    for _ in range(3):
        resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=None)
    assert origin.hits("/p.png") == 3
    assert len(sizes) == 0


def test_a_kept_size_is_read_afresh_once_its_max_age_has_passed(origin) -> None:
    url = origin.add("/p.png", noise_png("p", 64), headers={"Cache-Control": "max-age=5"})
    clock = Clock()
    sizes = ImageSizes(60.0, clock=clock)
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=None)
    clock.now += 4.9
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=None)
    assert origin.hits("/p.png") == 1
    clock.now += 0.1
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=None)
    assert origin.hits("/p.png") == 2


def test_the_least_recently_used_size_goes_first_past_the_bound() -> None:
    sizes = ImageSizes(60.0, max_entries=2)
    sizes.put(None, "a", (1, 1))
    sizes.put(None, "b", (2, 2))
    assert sizes.get(None, "a") == (1, 1)  # "a" is now the more recent
    sizes.put(None, "c", (3, 3))
    assert (sizes.get(None, "a"), sizes.get(None, "b"), sizes.get(None, "c")) == ((1, 1), None, (3, 3))


def test_a_kept_size_still_meets_a_lowered_pixel_limit(origin) -> None:
    url = origin.add("/p.png", noise_png("p", 64))
    sizes = ImageSizes(60.0)
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope=None)
    strict = MediaPolicy(allowed_hosts=("127.0.0.1",), max_pixels=32 * 32)
    with pytest.raises(MediaError) as refused:
        resolve_images([url], strict, frontend_decoding=False, sizes=sizes, scope=None)
    assert (refused.value.status, refused.value.code, refused.value.image_index) == (
        422,
        "decompression_bomb",
        0,
    )


def test_forgetting_a_requests_sizes_sends_the_next_one_to_the_origin(origin) -> None:
    url = origin.add("/p.png", noise_png("p", 64))
    sizes = ImageSizes(60.0)
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope="s")
    sizes.forget("s", [url_identity(url)])
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope="s")
    assert origin.hits("/p.png") == 2


def test_sizes_are_forgotten_at_the_first_look_after_the_flush_token_moved() -> None:
    clock, token = Clock(), ["t1"]
    sizes = ImageSizes(60.0, clock=clock, flush_token=lambda: token[0], flush_check_s=1.0)
    sizes.follow_flushes()  # the first look only learns the token
    sizes.put(None, "a", (1, 1))

    token[0] = "t2"  # an operator flushed images
    clock.now += 0.5
    sizes.follow_flushes()  # looked less than a second ago: no round trip to Redis yet
    assert sizes.get(None, "a") == (1, 1)
    clock.now += 0.6
    sizes.follow_flushes()
    assert sizes.get(None, "a") is None
    # and a token that stays put keeps what was read since
    sizes.put(None, "b", (2, 2))
    clock.now += 5
    sizes.follow_flushes()
    assert sizes.get(None, "b") == (2, 2)


@pytest.mark.django_db
def test_flush_caches_of_images_makes_every_frontend_ask_the_origin_again(origin, monkeypatch) -> None:
    """No worker is live: the frontends' sizes are flushed all the same, through Redis."""
    import io
    import time

    import redis as redis_py
    from django.conf import settings
    from django.core.management import call_command

    from inference_platform.serving.frontend import frontend
    from routing.media.images import SIZES_FLUSHED_KEY

    url = origin.add("/p.png", noise_png("p", 64))
    sizes = frontend().image_sizes()
    sizes.follow_flushes()
    resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope="s")
    try:
        printed = io.StringIO()
        call_command("flush_caches", "--cache", "images", stdout=printed)
        assert "frontends: image sizes forgotten" in printed.getvalue()
        later = time.monotonic() + 2.0  # past the frontend's once-a-second look
        monkeypatch.setattr(time, "monotonic", lambda: later)
        sizes.follow_flushes()
        resolve_images([url], LOCAL, frontend_decoding=False, sizes=sizes, scope="s")
        assert origin.hits("/p.png") == 2
    finally:
        redis_py.Redis.from_url(settings.REDIS_URL).delete(f"{settings.REDIS_KEY_PREFIX}{SIZES_FLUSHED_KEY}")


def _chat(url: str, question: str = "What is in the picture?") -> dict:
    return {
        "model": "demo",
        "max_tokens": 2,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": question},
                ],
            }
        ],
    }


def test_a_picture_that_changed_size_at_its_origin_is_read_afresh_and_answered(pooled_frontend) -> None:
    with ImageServer() as origin:
        url = origin.add("/product.png", noise_png("before", 448))
        platform = pooled_frontend
        base_url = platform.base_url
        with httpx.Client(base_url=base_url, headers=platform.headers, timeout=120) as client:
            first = client.post("/v1/chat/completions", json=_chat(url))
            assert first.status_code == 200, first.text
            asked = origin.hits("/product.png")  # the frontend's size read and the worker's fetch

            # a repeat: the frontend kept the size, the worker's cache holds the picture's tokens
            repeat = client.post("/v1/chat/completions", json=_chat(url))
            assert repeat.status_code == 200, repeat.text
            assert origin.hits("/product.png") == asked
            assert repeat.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            worker = repeat.headers["X-Routed-Worker"]

            # the origin now serves a smaller picture, and the worker no longer holds the old one:
            # the worker refuses the kept size, and the frontend reads it afresh and plans the
            # request again; the client gets the answer about the picture the origin has now
            origin.add("/product.png", noise_png("after", 224))
            # (the worker's caches only: a flush of every worker's would make the frontend forget
            # the size as well)
            every_cache = ("--cache", "kv", "--cache", "embeddings", "--cache", "images")
            platform.manage("flush_caches", "--worker", worker, *every_cache)
            changed = client.post("/v1/chat/completions", json=_chat(url))
            assert changed.status_code == 200, changed.text
            assert changed.json()["usage"]["prompt_tokens"] < first.json()["usage"]["prompt_tokens"]
            request_id = changed.headers["X-Request-Id"]
            assert f"request {request_id}: a picture changed at its origin" in platform.log("server")

            # the fresh size is kept in turn: a repeat is answered without asking the origin
            asked = origin.hits("/product.png")
            again = client.post("/v1/chat/completions", json=_chat(url))
            assert again.status_code == 200, again.text
            assert again.json()["usage"]["prompt_tokens"] == changed.json()["usage"]["prompt_tokens"]
            assert origin.hits("/product.png") == asked
