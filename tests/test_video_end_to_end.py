"""Video across real processes: uvicorn frontend (fetches and decodes the clip) → Celery → run_worker.

The clip is made here with PyAV and served by a real HTTP origin on 127.0.0.1, which counts its
requests: the frontend fetches each time, the worker never does.
"""

from __future__ import annotations

import httpx

from tests.image_server import ImageServer
from tests.video_files import make_clip


def ask(base_url: str, headers: dict[str, str], url: str, question: str) -> httpx.Response:
    body = {
        "model": "demo",
        "max_tokens": 6,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "video_url", "video_url": {"url": url}},
                    {"type": "text", "text": question},
                ],
            }
        ],
    }
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_the_same_video_twice_goes_back_to_its_worker_with_its_blocks_cached_and_no_encoder(
    pooled_frontend,
):
    # given idle workers (the session's pool), a frontend, and a clip at an origin
    platform = pooled_frontend
    base_url = platform.base_url
    with ImageServer() as origin:
        url = origin.add(
            "/clip.mp4", make_clip(frames=96, width=160, height=120, fps=12), content_type="video/mp4"
        )
        route = httpx.post(
            f"{base_url}/v1/route",
            json={
                "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}]
            },
            headers=platform.headers,
            timeout=60,
        ).json()
        (video,) = route["videos"]

        # when one question about the clip is answered, then another while the workers are idle
        first = ask(base_url, platform.headers, url, "What happens in this clip?")
        assert first.status_code == 200, first.text
        second = ask(base_url, platform.headers, url, "Which colours do you see?")
        assert second.status_code == 200, second.text

        # then the second goes to the worker that holds the video, reusing all of its full blocks,
        # without running the vision encoder, and no worker ever fetched the origin
        assert second.headers["X-Routed-Worker"] == first.headers["X-Routed-Worker"]
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert video["full_blocks"] >= 4
        assert cached >= video["full_blocks"] * route["block_size"]
        assert cached >= (video["start"] + video["tokens"]) // route["block_size"] * route["block_size"]
        assert first.headers["X-Encoder-Calls"] == "1"
        assert second.headers["X-Encoder-Calls"] == "0"
        overlap = int(second.headers["X-Routing-Overlap"].split("/")[0])
        assert overlap * route["block_size"] >= video["start"] + video["tokens"] - route["block_size"]
        assert origin.hits("/clip.mp4") == 3  # /v1/route and the two requests: the frontend only
