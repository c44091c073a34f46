"""Video parts in the frontend: fetched through the guard, decoded with PyAV, sampled as the family
samples, hashed by content; hostile files are a 4xx naming the problem, within the deadline.

Clips are made here with PyAV (tests/video_files.py); the origin is a real HTTP server on 127.0.0.1.
"""

from __future__ import annotations

import json
import time

import pytest

from inference_platform.api.chat_request import parse_chat_request
from inference_platform.serving.prepare import prepare
from routing.media.images import MediaError, MediaPolicy
from routing.media.video import VideoLimits, resolve_videos, sample_video
from routing.prompt.video_layouts import video_layout_for_config
from tests.api_client import KeyedAsyncClient
from tests.image_server import ImageServer
from tests.video_files import (
    data_url,
    empty_clip,
    endless_stream,
    faststart_clip,
    huge_frame_clip,
    make_clip,
    playlist_pointing_at,
)

LOCAL = MediaPolicy(allowed_hosts=("127.0.0.1",), connect_timeout=2.0, read_timeout=2.0, max_bytes=8 << 20)
QWEN2 = video_layout_for_config(
    {"model_type": "qwen2_vl"}, {"size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}}
)
QWEN3 = video_layout_for_config({"model_type": "qwen3_vl"}, {})
LIMITS = VideoLimits(deadline_s=10.0)
UNCACHED = VideoLimits(deadline_s=10.0, decode_cache_bytes=0)


@pytest.fixture(scope="module")
def origin():
    with ImageServer() as server:
        yield server


def test_the_same_clip_behind_two_urls_has_one_identity(origin):
    # given one clip served over http and sent as a data URL
    clip = make_clip(frames=24, width=64, height=48, fps=12)
    url = origin.add("/clip.mp4", clip, content_type="video/mp4")
    # when both are sampled
    by_http = sample_video(0, url, LOCAL, QWEN2, UNCACHED)
    by_data = sample_video(0, data_url(clip), LOCAL, QWEN2, UNCACHED)
    # then the identity is the content's, and the frames kept are the family's
    assert by_http.identity == by_data.identity
    assert by_http.indices == tuple(QWEN2.sample_indices(24, 12.0)) == (0, 6, 12, 18)
    assert (by_http.width, by_http.height, by_http.fps, by_http.total_frames) == (64, 48, 12.0, 24)
    assert len(by_http.frames) == 4 * by_http.expansion.resized_height * by_http.expansion.resized_width * 3


def test_a_repeated_clip_is_decoded_once_per_frontend_process(origin):
    from routing.media.video import DECODE_CACHE

    # given a clip sampled once (cold)
    clip = make_clip(frames=24, seed=7)
    first = sample_video(0, origin.add("/again.mp4", clip, content_type="video/mp4"), LOCAL, QWEN2, LIMITS)
    hits = DECODE_CACHE.hits
    # when the same bytes come again, from another URL
    second = sample_video(0, data_url(clip), LOCAL, QWEN2, LIMITS)
    # then the decode is reused, with the same identity and frames
    assert DECODE_CACHE.hits == hits + 1
    assert (second.identity, second.frames) == (first.identity, first.frames)


def test_another_clip_of_the_same_shape_has_another_identity():
    first = sample_video(0, data_url(make_clip(seed=1)), LOCAL, QWEN2, LIMITS)
    second = sample_video(0, data_url(make_clip(seed=2)), LOCAL, QWEN2, LIMITS)
    assert first.identity != second.identity
    assert first.routing_hash != second.routing_hash


def test_qwen3_vl_keeps_its_own_frames_and_timestamps():
    video = sample_video(0, data_url(make_clip(frames=48, fps=12)), LOCAL, QWEN3, LIMITS)
    assert list(video.indices) == QWEN3.sample_indices(48, 12.0)
    assert video.expansion.timestamps == QWEN3.timestamps_text(list(video.indices), 12.0)
    assert video.expansion.timestamps[0] == "<0.3 seconds>"  # frames 0 and 7 of 12 per second, averaged
    assert len(video.expansion.timestamps) == video.expansion.grid_thw[0]


def _hostile() -> dict[str, tuple[bytes, VideoLimits]]:
    clip = make_clip(frames=24)
    return {
        "truncated": (clip[: len(clip) // 2], LIMITS),
        "truncated_after_its_index": (faststart_clip()[:12_000], LIMITS),
        "garbage": (b"\x00\x00\x00\x18ftypmp42" + b"\xff" * 4000, LIMITS),
        "zero_frames": (empty_clip(), LIMITS),
        "huge_dimensions": (huge_frame_clip(), LIMITS),
        "endless_stream": (endless_stream(3000), VideoLimits(deadline_s=10.0, max_frames=1000)),
        "endless_stream_duration": (endless_stream(3000), VideoLimits(deadline_s=10.0, max_duration_s=60)),
    }


@pytest.fixture(scope="module")
def hostile():
    return _hostile()


@pytest.mark.parametrize(
    "name, code",
    [
        ("truncated", "video_undecodable"),
        ("truncated_after_its_index", "video_truncated"),
        ("garbage", "video_undecodable"),
        ("zero_frames", "video_undecodable"),
        ("huge_dimensions", "video_frame_too_large"),
        ("endless_stream", "video_too_long"),
        ("endless_stream_duration", "video_too_long"),
    ],
)
def test_each_hostile_video_is_a_4xx_within_the_deadline(origin, hostile, name, code):
    # given a hostile file at the origin
    data, limits = hostile[name]
    url = origin.add(f"/{name}.bin", data, content_type="video/mp4")
    # when the frontend samples it
    started = time.monotonic()
    with pytest.raises(MediaError) as refused:
        sample_video(3, url, LOCAL, QWEN2, limits)
    # then it is refused as the client's problem, naming the video, before the deadline
    assert 400 <= refused.value.status < 500
    assert refused.value.code == code
    assert refused.value.message.startswith("video 3: ")
    assert time.monotonic() - started < limits.deadline_s


def test_a_limit_refused_names_its_setting(hostile):
    data, limits = hostile["endless_stream"]
    with pytest.raises(MediaError) as refused:
        sample_video(0, data_url(data, "video/mp2t"), LOCAL, QWEN2, limits)
    assert "VIDEO_MAX_FRAMES=1000" in refused.value.message


def test_a_clip_that_takes_too_long_to_decode_is_a_4xx_naming_the_deadline(hostile):
    data, _ = hostile["endless_stream"]
    with pytest.raises(MediaError) as refused:
        sample_video(0, data_url(data, "video/mp2t"), LOCAL, QWEN2, VideoLimits(deadline_s=0.001))
    assert refused.value.status == 422
    assert "VIDEO_DECODE_DEADLINE_SECS" in refused.value.message


def test_a_playlist_is_refused_and_never_opens_what_it_points_at(origin):
    # given an HLS playlist whose segment is on an origin the guard would allow
    segment = origin.add("/segment.ts", endless_stream(10), content_type="video/mp2t")
    playlist = origin.add("/playlist.m3u8", playlist_pointing_at(segment), content_type="video/mp4")
    # when it is sent as a video
    with pytest.raises(MediaError) as refused:
        sample_video(0, playlist, LOCAL, QWEN2, LIMITS)
    # then the demuxer never ran: refused, and the segment was never fetched
    assert refused.value.status == 400
    assert origin.hits("/segment.ts") == 0


def test_an_endless_body_stops_at_the_size_cap(origin):
    url = origin.add_stream_forever("/forever.mp4", content_type="video/mp4")
    with pytest.raises(MediaError) as refused:
        sample_video(0, url, LOCAL, QWEN2, LIMITS)
    assert refused.value.status == 413


def test_the_guard_refuses_a_private_address_for_videos_too():
    with pytest.raises(MediaError) as refused:
        sample_video(0, "http://169.254.169.254/clip.mp4", MediaPolicy(), QWEN2, LIMITS)
    assert refused.value.status == 403


def test_a_model_without_a_video_layout_refuses_videos():
    with pytest.raises(MediaError) as refused:
        resolve_videos([data_url(make_clip())], LOCAL, None, LIMITS)
    assert refused.value.status == 400
    assert refused.value.code == "video_unsupported"


def _video_request(url: str, text: str = "What happens in this video?") -> dict:
    return {
        "model": "demo",
        "max_tokens": 4,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": text}],
            }
        ],
    }


@pytest.fixture
def served_demo(settings, demo_model_dir):
    settings.MODEL_PATH = demo_model_dir
    settings.MODEL_NAME = "demo"
    return demo_model_dir


@pytest.mark.django_db(transaction=True)
def test_the_token_view_holds_the_video_and_its_identity_reaches_the_block_hashes(served_demo):
    # given two requests that differ only in the video's content
    first = prepare(parse_chat_request(_video_request(data_url(make_clip(seed=1))), max_tokens_limit=64))
    second = prepare(parse_chat_request(_video_request(data_url(make_clip(seed=2))), max_tokens_limit=64))
    # then each view expands the video's placeholder into its tokens
    video = first.view.videos[0]
    assert video.tokens == first.videos[0].expansion.placeholder_tokens > 0
    assert first.view.prompt_tokens == second.view.prompt_tokens
    assert first.view.tokens == second.view.tokens  # the same token ids...
    # ...but the video's blocks hash differently, from its first block on
    first_video_block = video.start // first.view.block_size
    assert first.view.block_hashes[:first_video_block] == second.view.block_hashes[:first_video_block]
    assert first.view.block_hashes[first_video_block] != second.view.block_hashes[first_video_block]


@pytest.mark.django_db(transaction=True)
async def test_route_shows_each_video(served_demo, api_headers):
    body = _video_request(data_url(make_clip(frames=48, width=160, height=120, fps=12)))
    response = await KeyedAsyncClient(api_headers).post(
        "/v1/route", data=json.dumps(body), content_type="application/json"
    )
    assert response.status_code == 200, response.content
    (video,) = json.loads(response.content)["videos"]
    assert len(video["identity"]) == 32
    assert video["frames_kept"] == len(video["frame_indices"]) == 8
    assert video["total_frames"] == 48
    assert video["tokens"] > 0 and video["blocks"] >= video["full_blocks"] >= 1


@pytest.mark.django_db(transaction=True)
def test_inspect_request_prints_each_video(served_demo, tmp_path, capsys):
    from django.core.management import call_command

    body = _video_request(data_url(make_clip(frames=48, width=160, height=120, fps=12)))
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    call_command("inspect_request", str(path))
    printed = capsys.readouterr().out
    assert "video 0" in printed and "8 of 48 frames kept" in printed


@pytest.mark.django_db(transaction=True)
async def test_a_hostile_video_in_a_chat_request_is_a_4xx_in_openai_format(served_demo, api_headers):
    body = _video_request(data_url(b"not a video at all" * 10))
    response = await KeyedAsyncClient(api_headers).post(
        "/v1/chat/completions", data=json.dumps(body), content_type="application/json"
    )
    assert response.status_code == 400
    error = json.loads(response.content)["error"]
    assert error["code"] == "video_undecodable" and error["param"] == "messages"


@pytest.fixture
def ghost_worker(served_demo, settings):
    """A registered worker with a heartbeat but no process: it never takes its tasks (fault injection)."""
    import redis

    from routing.fleet.registry import Heartbeat, WorkerRegistry
    from routing.models import Worker

    settings.REQUEST_FIRST_TOKEN_TIMEOUT_SECS = 2.0
    conn = redis.Redis.from_url(settings.REDIS_URL)
    registry = WorkerRegistry(conn, settings.REDIS_KEY_PREFIX)
    Worker.objects.create(name="video-ghost", model_name="demo")
    registry.beat(Heartbeat(name="video-ghost", model="demo", block_size=settings.KV_BLOCK_SIZE), 30)
    yield conn
    registry.remove("video-ghost")
    conn.delete(f"{settings.REDIS_KEY_PREFIX}worker.video-ghost")


@pytest.mark.django_db(transaction=True)
async def test_video_frames_travel_to_the_worker_through_the_side_store_not_the_task(
    ghost_worker, settings, api_headers
):
    import asyncio
    import base64

    from routing.media.store import MediaRef, MediaStore

    # given a request with a clip, and a worker that never answers (its task stays queued to read)
    body = _video_request(data_url(make_clip(frames=48, width=160, height=120, fps=12)))
    queue = f"{settings.REDIS_KEY_PREFIX}worker.video-ghost"
    store = MediaStore(ghost_worker, settings.REDIS_KEY_PREFIX)
    seen: dict = {}

    async def read_the_task() -> None:
        while not (raw := ghost_worker.lindex(queue, 0)):
            await asyncio.sleep(0.05)
        seen["message_bytes"] = len(raw)
        args = json.loads(base64.b64decode(json.loads(raw)["body"]))[0][0]
        seen["video"] = args["videos"][0]
        seen["frames"] = store.get(MediaRef.from_payload(seen["video"]))

    # when it is dispatched
    reader = asyncio.create_task(read_the_task())
    response = await KeyedAsyncClient(api_headers).post(
        "/v1/chat/completions", data=json.dumps(body), content_type="application/json"
    )
    await reader
    # then the task names the frames in the side store and carries none of them
    assert response.status_code == 504
    video = seen["video"]
    frames, height, width, channels = video["frame_shape"]
    assert len(seen["frames"]) == frames * height * width * channels == video["media_bytes"]
    assert seen["message_bytes"] < 10_000 < len(seen["frames"])
    assert video["indices"] == [0, 6, 12, 18, 24, 30, 36, 42]  # Qwen2-VL demo: 2 fps of a 12 fps clip
