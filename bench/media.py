"""Benchmark of the frontend's per-request media work: URL identities, header-only size reads,
and full frontend decoding of 8 images one after another vs on resolve_images' thread pool.

Run: .venv/bin/python bench/media.py [--runs 7] [--latency-ms 20]
"""

from __future__ import annotations

import argparse
import io
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from the repo root

from PIL import Image

from routing.media.images import MediaPolicy, resolve_images, url_identity
from tests.image_server import ImageServer

IMAGES = 8
WIDTH, HEIGHT = 1024, 768


def _images() -> list[tuple[str, bytes, str]]:
    """8 distinct noise pictures (incompressible, so decoding does real work), half JPEG, half PNG."""
    images = []
    for i in range(IMAGES):
        picture = Image.frombytes("RGB", (WIDTH, HEIGHT), random.Random(i).randbytes(WIDTH * HEIGHT * 3))
        buffer = io.BytesIO()
        if i % 2:
            picture.save(buffer, "PNG", compress_level=1)
            images.append((f"/img{i}.png", buffer.getvalue(), "image/png"))
        else:
            picture.save(buffer, "JPEG", quality=90)
            images.append((f"/img{i}.jpg", buffer.getvalue(), "image/jpeg"))
    return images


def _median_seconds(action: Callable[[], object], runs: int) -> float:
    action()  # warm-up: first connections, plugin imports, pool threads
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--latency-ms", type=float, default=20.0)
    args = parser.parse_args()

    images = _images()
    total_bytes = sum(len(body) for _, body, _ in images)
    policy = MediaPolicy(allowed_hosts=("127.0.0.1",))
    with ImageServer(latency=args.latency_ms / 1000) as origin:
        urls = [origin.add(path, body, content_type=mime) for path, body, mime in images]
        print(
            f"origin: local image server on 127.0.0.1, {args.latency_ms:.0f} ms added per request "
            f"to stand in for a remote origin; {IMAGES} images {WIDTH}x{HEIGHT} "
            f"(JPEG + PNG noise, {total_bytes / 2**20:.1f} MiB); median of {args.runs} runs"
        )

        identity = _median_seconds(lambda: [url_identity(url) for url in urls], args.runs * 100)
        size_parallel = _median_seconds(
            lambda: resolve_images(urls, policy, frontend_decoding=False), args.runs
        )
        size_sequential = _median_seconds(
            lambda: [resolve_images([url], policy, frontend_decoding=False) for url in urls], args.runs
        )
        size_read_bytes = sum(origin.bytes_sent(path) for path, _, _ in images)
        size_read_requests = sum(origin.hits(path) for path, _, _ in images)
        decode_sequential = _median_seconds(
            lambda: [resolve_images([url], policy, frontend_decoding=True) for url in urls], args.runs
        )
        decode_parallel = _median_seconds(
            lambda: resolve_images(urls, policy, frontend_decoding=True), args.runs
        )

    rows = [
        ("URL identities (url mode)", identity, "xxh3-128 of 8 URLs"),
        ("size read, header only, pool", size_parallel, "resolve_images(frontend_decoding=False)"),
        ("size read, header only, one by one", size_sequential, ""),
        ("frontend decoding, one by one", decode_sequential, "fetch + decode + pixel hash"),
        ("frontend decoding, pool", decode_parallel, "resolve_images(frontend_decoding=True)"),
    ]
    print(f"{'per request of 8 images':<38}{'median':>12}  note")
    for name, seconds, note in rows:
        print(f"{name:<38}{seconds * 1e6:>10.0f}us  {note}")
    print(
        f"a header-only size read took {size_read_bytes / size_read_requests / 1024:.0f} KiB from the origin "
        f"(images average {total_bytes / IMAGES / 1024:.0f} KiB)"
    )
    speedup = decode_sequential / decode_parallel
    print(
        f"identity_us={identity * 1e6:.0f} size_read_us={size_parallel * 1e6:.0f} "
        f"decode_parallel_speedup={speedup:.2f}"
    )


if __name__ == "__main__":
    main()
