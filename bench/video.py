"""Time to first token for a 30-second clip asked about twice on one worker, through the real
platform (uvicorn frontend → Celery → run_worker), against the frontend's own decode-and-hash time.

Usage: `.venv/bin/python bench/video.py [--family qwen2_vl|qwen3_vl] [--clips N]` (Redis at
REDIS_URL, default redis://127.0.0.1:6379/14, under a namespace of its own that is deleted
afterwards; the demo model of the family is built into a temporary directory unless MODEL_PATH
names one). Takes about a minute or two on a laptop-class CPU. The last line is machine-readable:
    video_ttft_cold_ms=<x> video_ttft_warm_ms=<x> speedup=<x.xx> frontend_decode_ms=<x>

What it does, and why:
- Each clip is 30 seconds of 320x240 H.264 at 24 frames per second (720 frames), made here with
  PyAV, each clip's pattern its own (so nothing is shared between clips), served by a local origin.
- The cold question is the clip's first: the frontend fetches and decodes it (sampling 60 frames at
  2 per second), the worker reads the frames from the side store, runs the vision tower and
  prefills the whole video. The warm question is another question about the same clip: the
  frontend fetches it again (the origin may have changed) but finds its decode by the bytes' hash,
  routes to the worker holding its blocks, and the worker prefills only the question.
- TTFT is what a client sees: from sending the request to the first streamed token.
- frontend_decode_ms is the median time of `routing.media.video.sample_video` on one clip with its decode
  cache off (fetch, decode, sample, hash, resize), measured in this process.
- Cold and warm are medians over the clips (--clips, default 3). One worker, one frontend, no other
  load. Figures on a shared machine are noisy: compare the ratio, not the milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.samples import stream_chat  # noqa: E402
from tests.image_server import ImageServer  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402
from tests.video_files import make_clip  # noqa: E402

CLIP_SECONDS = 30
CLIP_FPS = 24
CLIP_SIZE = (320, 240)
QUESTIONS = ("What happens in this video?", "Which colours appear, and when do they change?")


def model_dir(family: str, scratch: Path) -> Path:
    from workers.demo_model import build_demo_family

    if os.environ.get("MODEL_PATH"):
        return Path(os.environ["MODEL_PATH"]).resolve()
    path = scratch / f"demo-{family}"
    print(f"building the {family} demo model into {path}", flush=True)
    build_demo_family(path, family)
    return path


def stream_ttft(base_url: str, headers: dict[str, str], url: str, question: str) -> tuple[float, dict, str]:
    """(ms to the first token, usage, worker) of one streamed request."""
    body = {
        "model": "demo",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
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
    try:
        with httpx.Client(timeout=300) as client:
            answer = stream_chat(client, base_url, body, headers)
    except RuntimeError as exc:
        raise SystemExit(f"request failed: {exc}") from None
    return answer.ttft_s * 1000, dict(answer.usage), answer.worker or "?"


def cached(usage: dict) -> int | None:
    return usage.get("prompt_tokens_details", {}).get("cached_tokens")


def frontend_decode_ms(model: Path, clip: bytes, runs: int = 3) -> float:
    from routing.media.images import MediaPolicy
    from routing.media.video import VideoLimits, sample_video
    from routing.prompt.video_layouts import video_layout_for_model_dir
    from tests.video_files import data_url

    layout = video_layout_for_model_dir(model)
    limits = VideoLimits(decode_cache_bytes=0)
    url = data_url(clip)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        sample_video(0, url, MediaPolicy(), layout, limits)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("qwen2_vl", "qwen3_vl"), default="qwen2_vl")
    parser.add_argument("--clips", type=int, default=3)
    args = parser.parse_args()
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    with tempfile.TemporaryDirectory(prefix="bench-video-") as scratch_name:
        scratch = Path(scratch_name)
        model = model_dir(args.family, scratch)
        clips = [
            make_clip(CLIP_SECONDS * CLIP_FPS, *CLIP_SIZE, fps=CLIP_FPS, seed=100 + n)
            for n in range(args.clips)
        ]
        print(
            f"{len(clips)} clips of {CLIP_SECONDS} s, {CLIP_SIZE[0]}x{CLIP_SIZE[1]} at {CLIP_FPS} fps, "
            f"{len(clips[0]) // 1024} KiB each",
            flush=True,
        )
        decode_ms = frontend_decode_ms(model, clips[0])
        print(f"frontend decode-and-hash per clip: {decode_ms:.1f} ms", flush=True)

        platform = PlatformProcesses(
            scratch,
            model,
            redis_url,
            f"bench-video:{uuid.uuid4().hex[:8]}:",
            {"MEDIA_ALLOWED_HOSTS": "127.0.0.1", "MODEL_NAME": "demo"},
        )
        try:
            platform.start_worker("solo")
            platform.wait_for_workers("solo")
            base_url = platform.start_server()
            cold, warm = [], []
            with ImageServer() as origin:
                for n, clip in enumerate(clips):
                    url = origin.add(f"/clip-{n}.mp4", clip, content_type="video/mp4")
                    cold_ms, cold_usage, _ = stream_ttft(base_url, platform.headers, url, QUESTIONS[0])
                    warm_ms, warm_usage, worker = stream_ttft(base_url, platform.headers, url, QUESTIONS[1])
                    cold.append(cold_ms)
                    warm.append(warm_ms)
                    print(
                        f"clip {n}: cold {cold_ms:.1f} ms ({cold_usage.get('prompt_tokens')} prompt tokens, "
                        f"{cached(cold_usage)} cached), warm {warm_ms:.1f} ms ({cached(warm_usage)} cached) "
                        f"on {worker}",
                        flush=True,
                    )
        finally:
            platform.close()
    cold_ms, warm_ms = statistics.median(cold), statistics.median(warm)
    print(
        f"video_ttft_cold_ms={cold_ms:.1f} video_ttft_warm_ms={warm_ms:.1f} "
        f"speedup={cold_ms / warm_ms:.2f} frontend_decode_ms={decode_ms:.1f}"
    )


if __name__ == "__main__":
    main()
