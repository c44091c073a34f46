"""Encoder disaggregation (E/PD) against the aggregated path, on the real platform, at equal
process counts: 2 `both` workers against 1 `llm` + 1 `encode` worker, one torch thread each, the
demo model with the heavy vision tower (`build_demo_model --heavy-vision`).

Usage: `.venv/bin/python bench/encoder_disagg.py [--quick]` (Redis at REDIS_URL, default
redis://127.0.0.1:6379/14, under a namespace of its own that is deleted afterwards; the heavy
model at HEAVY_MODEL_PATH if set, else built into a temporary directory). A few minutes at most
(`--quick`: about half; `--rounds N`: N rounds of both modes, alternating, default 2; each round
about a minute and a half here). The last line is machine-readable:
    ttft_p50_images_epd_over_agg=<x.xx> ttft_p50_text_epd_over_agg=<x.xx> transfer_ms_per_image=<x.xx>

The workload, and why it is shaped so:
- An image-heavy stream: IMAGE_USERS closed-loop users, each sending IMAGE_REQUESTS requests of
  IMAGES_PER_REQUEST new images (IMAGE_SIDE pixels square, served by a local origin; never seen
  before, so every image is encoded) and a short question. With the heavy tower, encoding is most
  of such a request's cost, as with a real model on a GPU.
- A text-only stream beside it, open loop: a short distinct question every TEXT_INTERVAL_S for as
  long as the image stream runs, each sent on schedule whether or not earlier ones were answered.
  So both modes get the same text load, and every text request counts: a closed loop would send
  fewer requests while blocked (hiding the wait from the percentiles) and, in E/PD, many more
  whose CPU would then compete with the encoder. In the aggregated mode a text request routed to
  a worker that is encoding waits behind the vision tower; in E/PD the LLM worker never encodes.
- E/PD runs with the platform's split policy as configured (EPD_SPLIT, EPD_LOCAL_ENCODE_WEIGHT
  from the environment, else their defaults): the images the encoder's backlog would delay more
  than the LLM worker's own stay on the LLM worker; the summary says how many it encoded.
- max_tokens is MAX_TOKENS, so the figures are about the time to the first token. Each mode
  starts the platform afresh (empty caches); TTFT is measured at the client (streamed).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import redis  # noqa: E402

from bench.samples import noise_png, quantile, stream_chat  # noqa: E402
from routing.fleet.encoders import EncoderPool, summarize  # noqa: E402
from tests.image_server import ImageServer  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402

MODES = {
    "agg": (("a0", "both"), ("a1", "both")),
    "epd": (("llm0", "llm"), ("enc0", "encode")),
}
IMAGE_SIDE = 336  # 144 image tokens each with the demo's patch 14, merge 2
IMAGES_PER_REQUEST = 3
IMAGE_USERS = 2
TEXT_INTERVAL_S = 0.4
IMAGE_REQUESTS = {"full": 6, "quick": 3}  # per image user
MAX_TOKENS = 4
SEED = 1313

_WORDS = [
    "red",
    "apple",
    "garden",
    "river",
    "tower",
    "window",
    "quiet",
    "bright",
    "table",
    "chair",
    "cloud",
    "winter",
    "summer",
    "bridge",
    "forest",
    "island",
    "camera",
    "music",
    "market",
    "street",
    "ticket",
    "train",
    "plane",
    "boat",
    "castle",
    "mountain",
]


@dataclass
class Sample:
    stream: str  # "images" | "text"
    ttft_s: float
    total_s: float


@dataclass
class ModeResult:
    mode: str
    samples: list[Sample] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    counters: dict[str, dict[str, int]] = field(default_factory=dict)

    def ttft(self, stream: str, q: float) -> float:
        return quantile([s.ttft_s for s in self.samples if s.stream == stream], q)

    def count(self, stream: str) -> int:
        return sum(1 for s in self.samples if s.stream == stream)

    def transfer(self) -> dict[str, float | None]:
        """Bytes and milliseconds per image moved from the encoder to the LLM worker (E/PD only)."""
        summed: dict[str, int] = {}
        for counters in self.counters.values():
            for name, value in counters.items():
                summed[name] = summed.get(name, 0) + value
        figures = summarize(summed)
        put, get = figures["put_ms_per_image"], figures["get_ms_per_image"]
        return {
            "bytes": figures["put_bytes_per_image"],
            "ms": None if put is None or get is None else put + get,
            "encode_ms": figures["encode_ms_per_image"],
            "fallbacks": figures["fallbacks"],
            "llm_tower_runs": sum(
                c.get("tower_forwards", 0) for n, c in self.counters.items() if n == "llm0"
            ),
        }


def chat_body(text: str, image_urls: Sequence[str]) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": [*content, {"type": "text", "text": text}]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
    }


def send(client: httpx.Client, base_url: str, body: dict) -> tuple[float, float]:
    """One streamed request: (time to the first generated text, time to the end)."""
    answer = stream_chat(client, base_url, body)
    return answer.ttft_s, answer.ended_at - answer.sent_at


def run_streams(
    base_url: str, headers: dict[str, str], image_urls: list[list[str]], image_users: int
) -> ModeResult:
    result = ModeResult("")
    lock = threading.Lock()
    images_done = threading.Event()
    plans = [image_urls[user::image_users] for user in range(image_users)]

    def record(stream: str, body: dict, client: httpx.Client) -> None:
        try:
            ttft, total = send(client, base_url, body)
        except (httpx.HTTPError, RuntimeError) as exc:
            with lock:
                result.failures.append(f"{stream}: {exc}")
            return
        with lock:
            result.samples.append(Sample(stream, ttft, total))

    def image_user(plan: list[list[str]]) -> None:
        with httpx.Client(timeout=180, headers=headers) as client:
            for n, urls in enumerate(plan):
                record("images", chat_body(f"Compare these {len(urls)} pictures, request {n}.", urls), client)

    def text_stream() -> list[threading.Thread]:
        rng = random.Random("text")
        client = httpx.Client(timeout=180, headers=headers, limits=httpx.Limits(max_connections=64))
        sent: list[threading.Thread] = []
        next_at = time.perf_counter()
        while not images_done.is_set() or not sent:
            time.sleep(max(0.0, next_at - time.perf_counter()))
            next_at += TEXT_INTERVAL_S
            words = " ".join(rng.choice(_WORDS) for _ in range(12))
            body = chat_body(f"Question {len(sent)}: {words}?", [])
            thread = threading.Thread(target=record, args=("text", body, client))
            thread.start()
            sent.append(thread)
        for thread in sent:
            thread.join()
        client.close()
        return sent

    started = time.perf_counter()
    image_threads = [threading.Thread(target=image_user, args=(plan,)) for plan in plans]
    text_threads = [threading.Thread(target=text_stream)]
    for thread in [*image_threads, *text_threads]:
        thread.start()
    for thread in image_threads:
        thread.join()
    images_done.set()
    for thread in text_threads:
        thread.join()
    result.wall_s = time.perf_counter() - started
    return result


def run_mode(
    mode: str, model: Path, redis_url: str, image_urls: list[list[str]], image_users: int
) -> ModeResult:
    namespace = f"bench:epd:{uuid.uuid4().hex[:10]}:"
    workers = MODES[mode]
    with tempfile.TemporaryDirectory(prefix=f"epd-{mode}-") as tmp:
        platform = PlatformProcesses(
            Path(tmp),
            model,
            redis_url,
            namespace,
            {"MEDIA_ALLOWED_HOSTS": "127.0.0.1", "WORKER_TORCH_THREADS": "1", "LOG_LEVEL": "WARNING"},
        )
        try:
            started = time.perf_counter()
            for name, role in workers:
                platform.start_worker(name, "--role", role, "--threads", "1")
                time.sleep(1.5)  # registrations at one instant can lock SQLite
            platform.wait_for_workers(*(name for name, _ in workers))
            base_url = platform.start_server()
            print(f"[{mode}] platform up in {time.perf_counter() - started:.1f} s", flush=True)
            # One request of each kind first, so neither mode's figures include lazy start-up work.
            with httpx.Client(timeout=180, headers=platform.headers) as client:
                send(client, base_url, chat_body("Warm up.", []))
            result = run_streams(base_url, platform.headers, image_urls, image_users)
            result.mode = mode
            time.sleep(1.2)  # counters are written as they happen; let the last ones land
            pool = EncoderPool(
                redis.Redis.from_url(redis_url), namespace, statistics_namespace=platform.statistics_namespace
            )
            snapshot = pool.snapshot([name for name, _ in workers])
            result.counters = {
                name: {k: v for k, v in figures.items() if isinstance(v, int)}
                for name, figures in snapshot.items()
            }
            for failure in result.failures[:3]:
                print(f"[{mode}] failed: {failure}", flush=True)
        finally:
            platform.close()
    return result


def heavy_model(scratch: Path) -> Path:
    configured = os.environ.get("HEAVY_MODEL_PATH")
    if configured and (Path(configured) / "config.json").exists():
        return Path(configured)
    from workers.demo_model import build_demo_model

    path = scratch / "demo"  # served as model "demo", as the harness expects
    print(f"building the demo model with the heavy vision tower into {path}", flush=True)
    build_demo_model(path, heavy_vision=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer image requests per user")
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds of both modes, alternating, pooled (default 2)"
    )
    parser.add_argument(
        "--image-users", type=int, default=IMAGE_USERS, help=f"concurrent image users (default {IMAGE_USERS})"
    )
    args = parser.parse_args(argv)
    image_users = args.image_users
    per_user = IMAGE_REQUESTS["quick" if args.quick else "full"]
    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"

    results: dict[str, ModeResult] = {}
    per_round: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="epd-model-") as scratch, ImageServer() as origin:
        model = heavy_model(Path(scratch))
        # The modes alternate round by round (agg, epd, agg, epd, ...): on a shared machine a burst
        # of someone else's load then falls on both, and the figures pool every round's samples.
        for round_no in range(args.rounds):
            this_round: dict[str, ModeResult] = {}
            for mode in MODES:
                # New images for each mode and round (no cache on any side may help either).
                offset = SEED + (0 if mode == "agg" else 10_000) + round_no * 100_000
                image_urls = [
                    [
                        origin.add(
                            f"/{mode}-{round_no}-{r}-{i}.png",
                            noise_png(offset + r * IMAGES_PER_REQUEST + i, IMAGE_SIDE),
                        )
                        for i in range(IMAGES_PER_REQUEST)
                    ]
                    for r in range(per_user * image_users)
                ]
                this_round[mode] = run_mode(mode, model, redis_url, image_urls, image_users)
                results[mode] = merged(results.get(mode), this_round[mode])
            ratios = tuple(
                this_round["epd"].ttft(stream, 0.5) / this_round["agg"].ttft(stream, 0.5)
                for stream in ("images", "text")
            )
            per_round.append(ratios)
            print(f"[round {round_no + 1}] ttft p50 epd/agg: images {ratios[0]:.2f}, text {ratios[1]:.2f}")

    agg, epd = results["agg"], results["epd"]
    print(
        f"\n{args.rounds} round(s) per mode, alternating; {image_users} image users x {per_user} requests"
        f" of {IMAGES_PER_REQUEST} new {IMAGE_SIDE}px "
        f"images, a text request every {TEXT_INTERVAL_S:g} s alongside (open loop); "
        f"max_tokens {MAX_TOKENS}; heavy vision tower; one torch thread per worker"
    )
    print(
        f"{'mode':<5} {'img p50':>8} {'img p90':>8} {'txt p50':>8} {'txt p90':>8} {'img n':>6} {'txt n':>6}"
        f" {'req/s':>6} {'img/s':>6} {'bytes/img':>10} {'ms/img':>7} {'enc ms/img':>10} fails"
    )
    for result in results.values():
        transfer = (
            result.transfer() if result.mode == "epd" else {"bytes": None, "ms": None, "encode_ms": None}
        )
        requests = len(result.samples)
        images = result.count("images") * IMAGES_PER_REQUEST
        images_ms = (result.ttft("images", 0.5) * 1000, result.ttft("images", 0.9) * 1000)
        print(
            f"{result.mode:<5} {images_ms[0]:6.0f}ms {images_ms[1]:6.0f}ms"
            f" {result.ttft('text', 0.5) * 1000:6.0f}ms {result.ttft('text', 0.9) * 1000:6.0f}ms"
            f" {result.count('images'):6d} {result.count('text'):6d} {requests / result.wall_s:6.2f}"
            f" {images / result.wall_s:6.2f} {_fmt(transfer['bytes'], 0):>10} {_fmt(transfer['ms'], 2):>7}"
            f" {_fmt(transfer['encode_ms'], 0):>10} {len(result.failures)}"
        )
    detail = epd.transfer()
    spread = ", ".join(f"{images:.2f}/{text:.2f}" for images, text in per_round)
    print(f"per round (images/text p50 ratio): {spread}; the table and last line pool all rounds")
    print(
        f"E/PD: fallbacks {detail['fallbacks']}, LLM worker tower runs {detail['llm_tower_runs']} of "
        f"{result_images(epd)} images (kept on it by the split, EPD_SPLIT="
        f"{os.environ.get('EPD_SPLIT', 'default')} EPD_LOCAL_ENCODE_WEIGHT="
        f"{os.environ.get('EPD_LOCAL_ENCODE_WEIGHT', 'default')}, or fallbacks); "
        "agg has no transfer (the worker that encodes also generates)"
    )
    print(
        f"ttft_p50_images_epd_over_agg={epd.ttft('images', 0.5) / agg.ttft('images', 0.5):.2f}"
        f" ttft_p50_text_epd_over_agg={epd.ttft('text', 0.5) / agg.ttft('text', 0.5):.2f}"
        f" transfer_ms_per_image={_fmt(detail['ms'], 2)}"
    )
    return 0 if not (agg.failures or epd.failures) else 1


def merged(into: ModeResult | None, more: ModeResult) -> ModeResult:
    """Rounds of one mode pooled: samples, failures, time and counters summed."""
    if into is None:
        return more
    into.samples.extend(more.samples)
    into.failures.extend(more.failures)
    into.wall_s += more.wall_s
    for worker, counters in more.counters.items():
        summed = into.counters.setdefault(worker, {})
        for name, value in counters.items():
            summed[name] = summed.get(name, 0) + value
    return into


def result_images(result: ModeResult) -> int:
    return result.count("images") * IMAGES_PER_REQUEST


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


if __name__ == "__main__":
    sys.exit(main())
