"""The real platform under a multimodal chat workload: KV-aware routing against round robin and
random, each on fresh workers, with the hit rate an infinite single cache would reach (the oracle).

Usage: `.venv/bin/python bench/workload.py [--quick]` (Redis at REDIS_URL, default
redis://127.0.0.1:6379/14, under a namespace of its own that is deleted afterwards; the model at
MODEL_PATH, default var/models/demo, built into a temporary directory if absent). The last line
is machine-readable:
    kv_hit=<x.xxx> oracle_hit=<x.xxx> rr_hit=<x.xxx> random_hit=<x.xxx>
    ttft_p50_kv_over_rr=<x.xx> imbalance_kv=<x.xx>  (on one line)

The workload, and why it is shaped so (numbers are the full run's; `--quick` sends fewer requests):
- A catalogue of IMAGES distinct 448x448 noise PNGs (256 image tokens each, the demo model's
  max_pixels) served by a local origin. Popularity is Zipf-like (exponent ZIPF_EXPONENT): a few
  products are asked about often, most rarely, as in a shop or a shared reference picture.
- Every request is one user turn: the image, then that product's catalogue text
  (DESCRIPTION_WORDS words, ~930 tokens with the demo tokenizer, the same for every question
  about it), then one of QUESTIONS questions. The image and its text are ~97% of a prompt of
  ~1,220 tokens (76 blocks), so a worker holding the product's prefix prefills one or two
  blocks instead of 76, and the ~0.25 s a cold prefill costs on one CPU thread dominates TTFT.
- Requests come in sessions (x-session-id): a user opens one product and asks 1-4 questions in
  a row, each after the previous answer, as a chat about one picture does. Session affinity is
  left at its default (on); it sends the follow-ups where the product already is.
- CONCURRENCY sessions run at once (closed loop), so the workers stay busy and queueing shows
  in TTFT, as it does in production; max_tokens is 4 so the figures are about prefill.
- KV_CAPACITY_BLOCKS per worker (700, ~9 products) is about 40% of the full run's working set
  (1,760 distinct blocks): one worker cannot hold the catalogue, three partitioned ones can. Round
  robin and random spread every product over every worker, so each worker needs the whole
  catalogue and evicts; the KV router keeps each product where it is cached.
- The same seed gives the same sessions in every mode; each mode starts the platform afresh
  (empty caches, nothing warmed) and stops it afterwards. The router keeps its defaults
  (overlap credit 1, prefill load scale 1, temperature 0).

The oracle replays the kv run's requests in the order they were sent against one infinite
cache: each request reuses the longest run of full blocks any earlier request shared with it,
counted as the engine counts (full blocks, at most prompt tokens - 1), on the exact block hashes
that POST /v1/route reports, which are the ones the workers use.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import random
import re
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from PIL import Image  # noqa: E402

from tests.image_server import ImageServer  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402

MODES = ("kv", "round_robin", "random")
WORKERS = ("w0", "w1", "w2")
BLOCK_SIZE = 16
IMAGE_SIDE = 448  # the demo model's max_pixels: 256 image tokens
IMAGES = 24
QUESTIONS = 6
DESCRIPTION_WORDS = 300
ZIPF_EXPONENT = 1.0
SESSION_LENGTHS = (1, 2, 3, 4)  # questions per session, equally likely
CONCURRENCY = 6
MAX_TOKENS = 4
SEED = 20260
REQUESTS_FULL = 240
REQUESTS_QUICK = 60
KV_CAPACITY_BLOCKS = 700

_VOCABULARY = (
    "matte steel frame walnut handle linen cover brass hinge oak veneer ceramic glaze woven strap "
    "leather sole cotton lining glass lid copper base rubber grip velvet seat maple drawer wool "
    "blend zinc buckle bamboo tray marble top nylon mesh canvas panel chrome knob cedar shelf"
)
_QUESTIONS = (
    "What colour is the main object in this picture?",
    "Is this product suitable for outdoor use?",
    "Describe the texture of the surface you can see.",
    "How many distinct parts can you count in the image?",
    "Would this fit in a small apartment kitchen?",
    "Write a one-line advertisement for this item.",
    "What material does the frame appear to be made of?",
    "Is there any visible damage or wear on it?",
)


@dataclass(frozen=True)
class Turn:
    """One request of the workload: which session, product and question."""

    session: int
    image: int
    question: int


@dataclass
class Outcome:
    """What one request did on the platform."""

    turn: Turn
    sent_at: float
    request_id: str
    worker: str
    overlap: str  # X-Routing-Overlap, "<blocks the chosen worker held>/<prompt blocks>"
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    reason: str = ""  # the router's: cost | affinity | round_robin | random (from the server's log)


@dataclass
class ModeResult:
    mode: str
    outcomes: list[Outcome]
    wall_s: float
    failures: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return sum(o.cached_tokens for o in self.outcomes) / max(
            sum(o.prompt_tokens for o in self.outcomes), 1
        )

    def ttft_quantile(self, q: float) -> float:
        return quantile([o.ttft_s for o in self.outcomes], q)

    @property
    def requests_per_s(self) -> float:
        return len(self.outcomes) / self.wall_s

    @property
    def imbalance(self) -> float:
        counts = Counter(o.worker for o in self.outcomes)
        per_worker = [counts.get(name, 0) for name in WORKERS]
        return max(per_worker) / (sum(per_worker) / len(per_worker))


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: the value at least a fraction q of the sample does not exceed."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


# --- the workload ----------------------------------------------------------------------------------
def noise_png(seed: int) -> bytes:
    """A distinct incompressible picture: no two products share a pixel pattern."""
    pixels = random.Random(seed).randbytes(IMAGE_SIDE * IMAGE_SIDE * 3)
    buffer = io.BytesIO()
    Image.frombytes("RGB", (IMAGE_SIDE, IMAGE_SIDE), pixels).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def description(image: int) -> str:
    rng = random.Random(f"description-{image}")
    vocabulary = _VOCABULARY.split()
    words = [rng.choice(vocabulary) for _ in range(DESCRIPTION_WORDS)]
    return f"Catalogue entry {image}: " + " ".join(words) + "."


def plan_sessions(requests: int, seed: int) -> list[list[Turn]]:
    """Sessions of 1-4 questions about one Zipf-chosen product, `requests` turns in all."""
    rng = random.Random(seed)
    weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(IMAGES)]
    # The popularity ranking is drawn too, so the hot products are not simply the first ones served.
    products = rng.sample(range(IMAGES), IMAGES)
    sessions: list[list[Turn]] = []
    planned = 0
    while planned < requests:
        image = rng.choices(products, weights)[0]
        length = min(rng.choice(SESSION_LENGTHS), requests - planned)
        questions = rng.sample(range(QUESTIONS), length)
        sessions.append([Turn(len(sessions), image, question) for question in questions])
        planned += length
    return sessions


def chat_body(turn: Turn, image_urls: Sequence[str], *, stream: bool) -> dict:
    text = f"{description(turn.image)}\n\nQuestion: {_QUESTIONS[turn.question]}"
    body: dict = {
        "model": "demo",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image_urls[turn.image]}},
                    {"type": "text", "text": text},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


# --- driving the platform --------------------------------------------------------------------------
def send(client: httpx.Client, base_url: str, turn: Turn, image_urls: Sequence[str]) -> Outcome:
    """One streamed request; TTFT is the time to the first chunk carrying generated text."""
    sent_at = time.perf_counter()
    first_token: float | None = None
    usage: dict | None = None
    headers = {"x-session-id": f"bench-session-{turn.session}"}
    with client.stream(
        "POST",
        f"{base_url}/v1/chat/completions",
        json=chat_body(turn, image_urls, stream=True),
        headers=headers,
    ) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                # The first chunk only announces the role; a random model may also end at once.
                if first_token is None and (choice["delta"].get("content") or choice.get("finish_reason")):
                    first_token = time.perf_counter()
        request_id, worker = response.headers["X-Request-Id"], response.headers["X-Routed-Worker"]
        overlap = response.headers.get("X-Routing-Overlap", "")
    if usage is None or first_token is None:
        raise RuntimeError("the stream ended without a token or usage")
    return Outcome(
        turn=turn,
        sent_at=sent_at,
        request_id=request_id,
        worker=worker,
        overlap=overlap,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int(usage["prompt_tokens_details"]["cached_tokens"]),
        ttft_s=first_token - sent_at,
    )


def run_sessions(
    base_url: str,
    sessions: list[list[Turn]],
    image_urls: Sequence[str],
    headers: dict[str, str] | None = None,
) -> ModeResult:
    """CONCURRENCY users, each taking the next session and asking its questions one after another."""
    pending: queue.Queue[list[Turn]] = queue.Queue()
    for session in sessions:
        pending.put(session)
    outcomes: list[Outcome] = []
    failures: list[str] = []
    lock = threading.Lock()

    def user() -> None:
        with httpx.Client(timeout=120, headers=headers) as client:
            while True:
                try:
                    session = pending.get_nowait()
                except queue.Empty:
                    return
                for turn in session:
                    try:
                        outcome = send(client, base_url, turn, image_urls)
                    except (httpx.HTTPError, RuntimeError, KeyError) as exc:
                        with lock:
                            failures.append(f"{turn}: {exc}")
                        continue
                    with lock:
                        outcomes.append(outcome)

    started = time.perf_counter()
    users = [threading.Thread(target=user, name=f"user-{n}") for n in range(CONCURRENCY)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join()
    outcomes.sort(key=lambda o: o.sent_at)
    return ModeResult("", outcomes, time.perf_counter() - started, failures)


def route_views(
    base_url: str, turns: set[Turn], image_urls: Sequence[str], headers: dict[str, str] | None = None
) -> dict[tuple[int, int], dict]:
    """The router's view (block hashes, prompt tokens) of each distinct (product, question)."""
    views: dict[tuple[int, int], dict] = {}
    with httpx.Client(timeout=60, headers=headers) as client:
        for turn in sorted(turns, key=lambda t: (t.image, t.question)):
            key = (turn.image, turn.question)
            if key in views:
                continue
            response = client.post(f"{base_url}/v1/route", json=chat_body(turn, image_urls, stream=False))
            response.raise_for_status()
            views[key] = response.json()
    return views


def oracle_cached_tokens(outcomes: Sequence[Outcome], views: dict[tuple[int, int], dict]) -> list[int]:
    """Per request, what one worker with an infinite cache would reuse, replaying `outcomes` in
    the order they were sent."""
    seen: set[int] = set()
    cached: list[int] = []
    for outcome in outcomes:
        view = views[(outcome.turn.image, outcome.turn.question)]
        hashes: list[int] = view["block_hashes"]
        tokens: int = view["prompt_tokens"]
        # Sequence hashes chain the whole prefix, so the longest shared prefix ends at the last seen one.
        matched = 0
        for position, block_hash in enumerate(hashes):
            if block_hash in seen:
                matched = position + 1
            else:
                break
        cached.append(min(matched * BLOCK_SIZE, tokens - 1))
        seen.update(hashes)
    return cached


def explain_kv_loss(outcomes: Sequence[Outcome], oracle: Sequence[int]) -> str:
    """Where the kv run's reuse fell short of the oracle's, as fractions of all prompt tokens.

    A request routed to a worker holding less than the oracle's prefix lost either because no
    request of its product had produced a first token yet (its prefix was still being computed:
    the oracle does not wait, a real cache must), or because the prefix was stored elsewhere
    and the router preferred another worker (load) or the holder had evicted it. "run" losses:
    the chosen worker held the prefix at the decision but evicted it before the request ran.
    """
    lost: Counter[str] = Counter()
    first_answered: dict[int, float] = {}  # product -> earliest first token of a request sent so far
    for outcome, best in zip(outcomes, oracle, strict=True):
        held = int(outcome.overlap.partition("/")[0] or 0) * BLOCK_SIZE
        at_decision = min(held, outcome.prompt_tokens - 1)
        if at_decision < best:
            answered = first_answered.get(outcome.turn.image, float("inf")) < outcome.sent_at
            cause = "stored elsewhere" if answered else "still in flight"
            lost[f"{cause} ({outcome.reason or 'unknown'})"] += best - at_decision
        lost["evicted before the run"] += at_decision - outcome.cached_tokens
        answer = outcome.sent_at + outcome.ttft_s
        first_answered[outcome.turn.image] = min(first_answered.get(outcome.turn.image, answer), answer)
    total = sum(outcome.prompt_tokens for outcome in outcomes)
    return ", ".join(f"{cause} {tokens / total:.3f}" for cause, tokens in lost.most_common())


def read_reasons(server_log: str, outcomes: Sequence[Outcome]) -> None:
    """Fill each outcome's routing reason from the frontend's "request ... sent to worker" lines."""
    reasons = dict(_SENT_LINE.findall(server_log))
    for outcome in outcomes:
        outcome.reason = reasons.get(outcome.request_id, "")


_SENT_LINE = re.compile(r"request (\S+) sent to worker \S+ \(.*?, ([\w-]+)\)$", re.MULTILINE)


def run_mode(
    mode: str,
    model_dir: Path,
    redis_url: str,
    sessions: list[list[Turn]],
    image_urls: Sequence[str],
    route: bool,
) -> tuple[ModeResult, dict[tuple[int, int], dict]]:
    namespace = f"bench:workload:{uuid.uuid4().hex[:10]}:"
    with tempfile.TemporaryDirectory(prefix=f"workload-{mode}-") as tmp:
        platform = PlatformProcesses(
            Path(tmp),
            model_dir,
            redis_url,
            namespace,
            {
                "ROUTER_MODE": mode,
                "KV_CAPACITY_BLOCKS": str(KV_CAPACITY_BLOCKS),
                "KV_BLOCK_SIZE": str(BLOCK_SIZE),
                "MEDIA_ALLOWED_HOSTS": "127.0.0.1",
                "WORKER_TORCH_THREADS": "1",
                "LOG_LEVEL": "WARNING",
                # Each request's routing reason (cost or affinity), for explaining the hit rate.
                "LOG_LEVELS": "inference_platform.serving=info",
            },
        )
        try:
            started = time.perf_counter()
            for name in WORKERS:
                platform.start_worker(name)
                # Registrations at the same instant can fail on SQLite ("database is locked",
                # see the report); loads started apart register apart.
                time.sleep(1.5)
            platform.wait_for_workers(*WORKERS)
            base_url = platform.start_server()
            print(f"[{mode}] platform up in {time.perf_counter() - started:.1f} s", flush=True)
            result = run_sessions(base_url, sessions, image_urls, platform.headers)
            result.mode = mode
            read_reasons(platform.log("server"), result.outcomes)
            views = (
                route_views(base_url, {o.turn for o in result.outcomes}, image_urls, platform.headers)
                if route
                else {}
            )
        finally:
            platform.close()
    return result, views


def model_dir(scratch: Path) -> Path:
    configured = os.environ.get("MODEL_PATH")
    path = Path(configured) if configured else REPO / "var" / "models" / "demo"
    path = path if path.is_absolute() else REPO / path
    if (path / "config.json").exists():
        return path
    from workers.demo_model import build_demo_model

    path = scratch / "demo"
    print(f"building the demo model into {path}", flush=True)
    build_demo_model(path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{REQUESTS_QUICK} requests per mode")
    args = parser.parse_args(argv)
    requests = REQUESTS_QUICK if args.quick else REQUESTS_FULL
    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    sessions = plan_sessions(requests, SEED)

    with tempfile.TemporaryDirectory(prefix="workload-model-") as scratch, ImageServer() as origin:
        model = model_dir(Path(scratch))
        image_urls = [origin.add(f"/product-{n}.png", noise_png(SEED + n)) for n in range(IMAGES)]
        results: dict[str, ModeResult] = {}
        views: dict[tuple[int, int], dict] = {}
        for mode in MODES:
            results[mode], mode_views = run_mode(
                mode, model, redis_url, sessions, image_urls, route=mode == "kv"
            )
            views.update(mode_views)

    kv = results["kv"]
    oracle_cached = oracle_cached_tokens(kv.outcomes, views)
    oracle = sum(oracle_cached) / sum(o.prompt_tokens for o in kv.outcomes)
    working_set = len({block for view in views.values() for block in view["block_hashes"]})
    mismatched = sum(
        1 for o in kv.outcomes if views[(o.turn.image, o.turn.question)]["prompt_tokens"] != o.prompt_tokens
    )
    popularity = Counter(turn.image for session in sessions for turn in session)
    print(
        f"\n{requests} requests in {len(sessions)} sessions, {IMAGES} images (top image "
        f"{popularity.most_common(1)[0][1]} requests), {QUESTIONS} questions, concurrency {CONCURRENCY}, "
        f"KV capacity {KV_CAPACITY_BLOCKS} blocks/worker, prompt ~"
        f"{round(statistics.mean(o.prompt_tokens for o in kv.outcomes))} tokens"
    )
    print(
        f"working set {working_set} blocks (capacity {KV_CAPACITY_BLOCKS / working_set:.0%} of it"
        f" per worker); route view vs engine prompt tokens mismatches: {mismatched}"
    )
    print(f"oracle (one infinite cache): hit {oracle:.3f}; kv short of it by {oracle - kv.hit_rate:.3f}:")
    print(f"  losses: {explain_kv_loss(kv.outcomes, oracle_cached)}")
    header = f"{'mode':<12} {'hit':>6} {'ttft p50':>9} {'ttft p90':>9} {'req/s':>6} {'imbal':>6}"
    print(f"{header}  per worker  failed")
    for result in results.values():
        counts = Counter(o.worker for o in result.outcomes)
        print(
            f"{result.mode:<12} {result.hit_rate:6.3f} {result.ttft_quantile(0.5) * 1000:7.0f}ms"
            f" {result.ttft_quantile(0.9) * 1000:7.0f}ms {result.requests_per_s:6.2f} {result.imbalance:6.2f}"
            f"  {'/'.join(str(counts.get(w, 0)) for w in WORKERS):<11} {len(result.failures)}"
        )
        for failure in result.failures[:3]:
            print(f"  failed: {failure}")
    rr = results["round_robin"]
    print(
        f"kv_hit={kv.hit_rate:.3f} oracle_hit={oracle:.3f} rr_hit={rr.hit_rate:.3f}"
        f" random_hit={results['random'].hit_rate:.3f}"
        f" ttft_p50_kv_over_rr={kv.ttft_quantile(0.5) / rr.ttft_quantile(0.5):.2f}"
        f" imbalance_kv={kv.imbalance:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
