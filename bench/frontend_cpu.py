"""The frontend's own CPU per chat request, against simulated workers (issue 36): what one web
process spends to admit, tokenize, hash, route and answer a request whose generation costs it
nothing, so that the figure is the frontend's alone.

Two simulated workers (`run_worker --engine sim --count 2`, another process) serve the demo
model; the frontend runs in this process, and the requests are driven straight into its API
handler (`ApiHandler`, as bench/api_handler.py does: no socket, no server), one at a time, each
`max_tokens` 1 and not streamed. CPU is `time.process_time()` of this process (every thread: the
hand-overs' threads count), over REQUESTS requests per round; the figure is the median of the
rounds. Three requests:
  text       a short question;
  image      a 300-word system prompt and a 448x448 PNG sent as a data URL (issue 36's item 4), a
             new question each time so that no answer is cached anywhere; the picture is the same
             each time, as a chat client sends a conversation's pictures with every turn (the
             frontend keeps it decoded: MEDIA_DATA_URL_CACHE_MB);
  image_new  the same, with a picture never sent before each time (the same pixels and a text
             chunk of its own: as many bytes to decode as `image`'s first sight).

Usage: `.venv/bin/python bench/frontend_cpu.py [--requests N] [--rounds N] [--kinds text,image]`
(Redis at REDIS_URL, default redis://127.0.0.1:6379/14, under a namespace of its own that is
deleted afterwards; `--kinds` runs some of the three). A shared machine moves the figures; the
spread of the rounds is printed. Last line (the kinds run):
    frontend_cpu_ms_text=<x.xx> frontend_cpu_ms_image=<x.xx> frontend_cpu_ms_image_new=<x.xx>
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import struct
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.api_handler import asgi_scope, serve  # noqa: E402
from bench.samples import demo_model_dir, noise_png  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402

SYSTEM_PROMPT = " ".join(f"rule{k % 97} applies to every answer about the catalogue" for k in range(38))[
    : 300 * 6
]  # ~300 words


KINDS = ("text", "image", "image_new")


def _picture_of_its_own(png: bytes, k: int) -> bytes:
    """`png` with a tEXt chunk naming `k` after its header: a picture no earlier request sent."""
    chunk = b"tEXt" + b"bench\0" + str(k).encode()
    own = struct.pack(">I", len(chunk) - 4) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return png[:33] + own + png[33:]  # the signature (8 bytes), then IHDR (25)


def _bodies(kind: str, png: bytes, count: int, start: int) -> list[bytes]:
    image_url = "data:image/png;base64," + base64.b64encode(png).decode()
    out = []
    for k in range(start, start + count):
        question = f"Question {k}: what does item {k * 7919 % 100_003} look like?"
        if kind == "text":
            messages = [{"role": "user", "content": question}]
        else:
            if kind == "image_new":
                image_url = "data:image/png;base64," + base64.b64encode(_picture_of_its_own(png, k)).decode()
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image_url}},
                        {"type": "text", "text": question},
                    ],
                },
            ]
        out.append(json.dumps({"model": "demo", "messages": messages, "max_tokens": 1}).encode())
    return out


async def _cpu_ms_per_request(app, key: str, bodies: list[bytes]) -> float:
    started = time.process_time()
    for body in bodies:
        status, answer = await serve(app, asgi_scope("/v1/chat/completions", key, "POST", body), body)
        if status != 200:
            raise RuntimeError(f"the chat request answered {status}: {answer[:300]!r}")
    return (time.process_time() - started) * 1000 / len(bodies)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150, help="requests per kind per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"which requests, comma-separated (of {', '.join(KINDS)})"
    )
    args = parser.parse_args()
    kinds = [kind for kind in args.kinds.split(",") if kind]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes some of {', '.join(KINDS)}")

    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    namespace = f"bench:fcpu:{uuid.uuid4().hex[:10]}:"
    model = demo_model_dir()
    png = noise_png("frontend-cpu", 448)
    with tempfile.TemporaryDirectory(prefix="bench-frontend-cpu-") as tmp:
        platform = PlatformProcesses(Path(tmp), model, redis_url, namespace, {"LOG_LEVEL": "WARNING"})
        try:
            names = platform.start_sim_workers("sim", 2)
            platform.wait_for_workers(*names)
            for name, value in platform.env.items():  # this process is the platform's frontend
                if os.environ.get(name) != value:
                    os.environ[name] = value
            import django

            django.setup()
            from inference_platform.api.handler import ApiHandler

            app = ApiHandler()

            async def run() -> dict[str, list[float]]:
                figures: dict[str, list[float]] = {kind: [] for kind in kinds}
                sent = 0
                for kind in figures:  # warm: imports, the model card, the first connections
                    await _cpu_ms_per_request(app, platform.api_key, _bodies(kind, png, 10, sent))
                    sent += 10
                for _ in range(args.rounds):
                    for kind, values in figures.items():
                        bodies = _bodies(kind, png, args.requests, sent)
                        sent += args.requests
                        values.append(await _cpu_ms_per_request(app, platform.api_key, bodies))
                return figures

            figures = asyncio.run(run())
        finally:
            platform.close()
    for kind, values in figures.items():
        print(f"{kind:9} frontend CPU per request: median {statistics.median(values):.2f} ms over "
              f"{args.rounds} rounds of {args.requests} [{min(values):.2f}-{max(values):.2f}]")  # fmt: skip
    medians = {kind: statistics.median(values) for kind, values in figures.items()}
    print(" ".join(f"frontend_cpu_ms_{kind}={median:.2f}" for kind, median in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
