"""The real platform under four multimodal chat workloads: KV-aware routing against round robin,
on simulated workers by default, over five runs (seeds), with means and their coefficients of
variation.

Usage: `.venv/bin/python bench/workload.py [--engine sim|native] [--sim-profile NAME]
[--sim-speedup S] [--requests N] [--seeds N] [--modes kv,round_robin,random] [--shapes a,b,c,d]
[--products N] [--kv-blocks N] [--origin-latency-ms MS] [--load F] [--think-ms MS] [--noise-floor]`
(Redis at REDIS_URL, default redis://127.0.0.1:6379/14, under a namespace of its own that is
deleted afterwards; the demo model at MODEL_PATH, default var/models/demo, built into a temporary
directory if absent: the frontends read its tokenizer even in front of simulated workers).

What runs: the real frontend (one uvicorn process per router), the real Redis and the real router,
in front of two workers. `--engine sim` (the default): one `run_worker --engine sim --count 2`
process (workers/sim_engine: the native scheduler and paged prefix pool, the real queues, KV
events and heartbeats, step times from the `cpu-demo` profile, calibrated on the native engine on
this machine), each pool of `--kv-blocks` blocks, the KV_CAPACITY_BLOCKS the native mode gives its
workers, so that the cache pressure is the same; simulated time is real time (`--sim-speedup 1`).
`--engine native`: two `run_worker` processes of the demo model, one torch thread each. Before
every run each worker's caches are flushed (`manage.py flush_caches`, run in this process) and the
router's load, predicted blocks and affinity are deleted, which is what fresh workers would have;
the same seed gives the same requests in every mode.

Bounded: 4 shapes x 2 routers x 5 seeds = 40 runs of REQUESTS (60) requests, 5 to 6.5 minutes on
this 2-core machine shared with other engineers' tests (load average 2.5 to 12);
`--modes kv,round_robin,random` adds random (20 runs more), `--requests 180` triples it.

What it measures, per run, and per shape as the mean over the runs with its coefficient of
variation (CV: standard deviation over mean, across the five seeds), never a median: TTFT falls in
a warm and a cold group, and a median of such a sample lands on either side of the gap by chance.
- hit rate: cached prompt tokens over prompt tokens, as the workers reported them;
- warm requests (half the prompt cached or more) beside the bound: every request but the first to
  show its prefix (its product in (a) and (b), its conversation in (c), the system prompt in (d)),
  the most any router could serve with caches that never evict;
- the cache references: the warm requests of one cache of both workers' blocks that holds each
  prefix once, fed the kv run's requests in their order, by its eviction (cache_reference): the
  least recently asked (the LRU reference: what the engines' LRU eviction leaves a router that
  never keeps a prefix twice), the least often asked so far (LFU: knows the popularity it has
  seen, not the future) and the one asked again last (clairvoyant, Belady's). Not bounds on a
  router; where the LRU reference falls short of the bound (shape (b)), prefixes were evicted
  before their reuse whatever the routing, and where LFU does too, no eviction that does not know
  the future would have kept them;
- engine TTFT: the mean of the workers' `engine_ttft_seconds`, from an engine taking a request to
  its first token, on the engine's clock: simulated time for simulated workers. It leaves out the
  frontend, Celery and the client, whose time on a shared machine moves with the neighbours' load
  (see below), and is the TTFT the acceptance compares;
- client TTFT: the mean wall time to the first streamed token, as a user sees it (warm and cold
  requests' means in each run's line);
- imbalance (the busiest worker's requests over the mean) and the share of the best eligible
  overlap the router gave up (from each decision's log line);
- kv over round robin, run by run (the same seed: the same requests): hit rate, engine and client
  TTFT means, and kv's warm requests over the bound and over the LRU reference, each with its CV;
- an acceptance line per shape (issue 36): kv's hit rate at least round robin's in every run,
  warm requests at least 0.95 x the bound, engine TTFT mean at most 0.8 x round robin's in (a) and
  (c) (a prefix repeats on one worker: kv must win) and 1.05 x in (b) and (d) (it cannot help: kv
  must not harm), and that ratio's CV at most 5%.
The last line:
    shapes=4 runs=5 hit_kv_over_rr=a:…,b:…,c:…,d:… warm_over_bound=a:…,… engine_ttft_mean_kv_over_rr=a:…,…
    its_cv=a:…,… client_ttft_mean_kv_over_rr=a:…,… overlap_given_up=… acceptance_met=<shapes>/4
(on one line; each figure the mean over the runs, its_cv the CV of the engine TTFT ratio).

Measured here (2026-12-03; other engineers' tests and benches running beside it):
`.venv/bin/python bench/workload.py` in 311 s, load average 2.5 to 5.1:
    shapes=4 runs=5 hit_kv_over_rr=a:1.34,b:1.45,c:1.47,d:1.00 warm_over_bound=a:0.97,b:0.73,c:1.00,d:0.98
    engine_ttft_mean_kv_over_rr=a:0.65,b:0.85,c:0.67,d:1.02 its_cv=a:0.087,b:0.123,c:0.055,d:0.016
    client_ttft_mean_kv_over_rr=a:0.80,b:0.93,c:0.76,d:1.03 overlap_given_up=0.013 acceptance_met=1/4
`--shapes a,b,c --requests 180` in 560 s, load average 2.3 to 6.8:
    shapes=3 runs=5 hit_kv_over_rr=a:1.36,b:1.45,c:1.41 warm_over_bound=a:0.91,b:0.59,c:0.99
    engine_ttft_mean_kv_over_rr=a:0.54,b:0.84,c:0.69 its_cv=a:0.049,b:0.035,c:0.036
    client_ttft_mean_kv_over_rr=a:0.78,b:0.87,c:0.79 overlap_given_up=0.011 acceptance_met=1/3
`.venv/bin/python bench/workload.py` (2026-12-06, nothing else running) in 233 s:
    shapes=4 runs=5 hit_kv_over_rr=a:1.44,b:1.49,c:1.55,d:1.00 warm_over_bound=a:0.97,b:0.72,c:1.00,d:0.98
    engine_ttft_mean_kv_over_rr=a:0.58,b:0.84,c:0.63,d:0.99 its_cv=a:0.163,b:0.128,c:0.036,d:0.019
    client_ttft_mean_kv_over_rr=a:0.61,b:0.86,c:0.66,d:0.99 overlap_given_up=0.017 acceptance_met=2/4
  with (b)'s cache references, of 34.6 warm requests at most: LRU 26.8, LFU 29.4, clairvoyant
  34.4; and (c)'s, of 42.4: LRU 42.4, LFU 27.8, clairvoyant 42.4.
What holds of issue 36's acceptance: kv's hit rate is round robin's or more in every run of every
shape; its engine TTFT mean is 0.54 to 0.69 of round robin's in (a) and (c) and 0.84 to 1.02 in
(b) and (d); its warm requests reach 0.95 of the bound in (c) and (d), and in (a) at 60 requests.
What does not, and why:
- the CV of the TTFT ratio at 60 requests a run (9%, 12% and 5.5% in (a), (b) and (c); 1.6% in
  (d)): each seed draws another 60 requests of the shape, and kv's and round robin's hit rates
  move 2-26% (CV) from draw to draw. It is the sample: at 180 requests a run every CV is under
  5%, in three times the time, beyond what this bench may take by default. At one seed, round
  robin against itself (`--noise-floor`, under load 9 to 14) moves by 4-7%: its hit rate depends
  on the order in which the closed loop's users happen to ask, which the frontend's wall time sets.
- warm requests against the bound in (b) (0.73, 0.59 at 180 requests) and in (a) at 180 (0.91):
  the bound counts every repeat as winnable, as caches that never evict would; the workers' 250
  blocks each hold about five products, and one-off products push the hot ones out of their LRU
  pools. kv's warm requests are 0.93-1.00 of the LRU reference in every shape, and it gave up about
  1% of the best overlap: the routing keeps what the pools keep. A clairvoyant cache of the same
  blocks (Belady's eviction) keeps every repeat, and nothing short of clairvoyance does: in (b)
  an eviction that knows the popularity seen so far (LFU) keeps 0.85 of the bound, LRU 0.77; in
  (c) that LFU keeps 0.66 where LRU keeps all (a conversation's history is asked once or twice,
  then never again). The 0.95 asked for (b) is beyond any eviction that does not know the future;
  the pools keep LRU (as vLLM's), which gives up 0.08 of the bound to LFU in (b) where LFU
  would give up 0.34 in (c).
On this machine the frontend, Celery and the client add 40 to 380 ms to an engine TTFT of 85 to 270
ms, depending on the neighbours' load: the client TTFT ratios are nearer 1 and move with it.

The shapes (why each: routing that is right for one can be wrong for another):
(a) sessions about one image: a user opens one product and asks 1-4 questions in a row, each
    after the previous answer (x-session-id per user). Hard session affinity helps here.
(b) sessions unrelated to images: a user asks about a different Zipf-chosen product each turn
    under one session id. Affinity that overrides the cost sends a session's turns to where
    its *previous* image is, away from where this one is cached.
(c) multi-turn conversations: a user opens a conversation with two photos of their own (never
    seen before) and asks 2-5 questions in a row; each turn appends to the previous prompt with the
    assistant's answer (ANSWER_WORDS, a stand-in of a real answer's length), so the prefix that
    matters is the conversation's history, held by whichever worker served its last turn.
(d) a long shared system prompt with unique images: every request's prefix up to the image is
    the same everywhere, its image never seen before: the router must balance load, not chase
    a prefix every worker holds. The control: every request costs the same wherever it goes, so
    in a closed loop each router's throughput, and with it its mean TTFT (Little's law), is the
    same; the ratio there measures harm, around 1.00. Its users ask in bursts (a worker's two
    requests end within a step of each other, so both users ask again at once): the line "arrived
    in a burst of all users" counts them, and `--think-ms` breaks them.

Common to all: PRODUCTS distinct noise PNGs of IMAGE_SIDE px (256 image tokens on the demo
model), Zipf-like popularity, catalogue text per product, CONCURRENCY users in a closed loop,
max_tokens MAX_TOKENS (the figures are about prefill), two workers whose KV cache
(KV_CAPACITY_BLOCKS) cannot hold the working set: the traffic of the report that opened issue 10,
about five products' prefixes per worker. `--products` and `--kv-blocks` change it.

`--noise-floor` runs round robin a second time per seed and shape and prints its figures over
the first run's: how far a ratio moves when nothing differs but the run (the closed loop's
interleaving, which the frontend's wall time sets, and on simulated workers nothing else).

`--load F` runs an open loop instead: sessions start at Poisson times (the same times in every
mode for one seed), each asking its turns one after another, at F times the requests a second
that round robin served in a closed loop of the same shape (one calibration run per shape, not
reported). It shows what a closed loop hides: with no fixed number of users, a router that keeps
requests on the worker holding their prefix can let a queue grow there while another worker
idles.

`--origin-latency-ms` delays every answer of the image origin (a remote one is tens of ms away):
a request pays it wherever the platform asks the origin, the frontend's size read (which
MEDIA_SIZE_CACHE_SECS keeps for repeats) and, on native workers, a worker's fetch of a picture it
does not hold (a simulated worker fetches nothing)."""

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import redis  # noqa: E402

from bench.samples import noise_png, stream_chat  # noqa: E402
from tests.image_server import ImageServer  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402

MODES = ("kv", "round_robin", "random")
DEFAULT_MODES = ("kv", "round_robin")  # the comparison the acceptance is about; random on request
# --noise-floor: round robin once more per seed and shape, on the same frontend; its mean TTFT
# over round robin's is what the kv/rr ratio moves by when nothing differs but the run.
AGAIN = "rr_again"
SHAPES = ("a", "b", "c", "d")
ENGINES = ("sim", "native")
WORKERS = 2
NATIVE_WORKERS = ("w0", "w1")
SIM_PROFILE = "cpu-demo"  # calibrated on the native engine and the demo model on this machine
SEEDS = (20260, 20261, 20262, 20263, 20264)
BLOCK_SIZE = 16
IMAGE_SIDE = 448  # the demo model's max_pixels: 256 image tokens
PRODUCTS = 60  # issue 10's report: 60 pictures of Zipf-like popularity
DESCRIPTION_WORDS = 150
SYSTEM_WORDS = 300  # shape (d)'s shared system prompt
PHOTOS_PER_CONVERSATION = 2  # shape (c): the photos a conversation opens with
ANSWER_WORDS = 40  # shape (c)'s assistant answers in the history (max_tokens keeps real ones short)
ZIPF_EXPONENT = 1.0
CONCURRENCY = 4
MAX_TOKENS = 4
REQUESTS = 60  # per run
KV_CAPACITY_BLOCKS = 250  # per worker, as in that report: ~5 of the products' prefixes
BURST_GAP_S = 0.06  # requests sent closer than this in a row count as one burst (under a prompt's wait)
# The acceptance of issue 36, per shape: kv's mean TTFT over round robin's at most this. Where a
# prefix repeats on one worker (a, c) kv must win; where it cannot help (b: unrelated images; d:
# a prefix every worker holds) it must not harm.
TTFT_RATIO_LIMIT = {"a": 0.8, "b": 1.05, "c": 0.8, "d": 1.05}
WARM_SHARE_OF_BOUND = 0.95
RATIO_CV_LIMIT = 0.05

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
    """One request: whose session, and the chat messages it sends."""

    session: int
    messages: tuple  # JSON-ready messages (tuples of dicts, frozen for hashing by identity)
    key: str  # what makes two turns the same prompt
    # What must have been seen before for this turn to be warm (at least half its prompt cached):
    # its product in (a) and (b), its conversation in (c), the system prompt in (d).
    prefix: str = ""


@dataclass
class Outcome:
    turn: Turn
    sent_at: float
    worker: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float

    @property
    def warm(self) -> bool:
        """At least half the prompt was cached."""
        return self.cached_tokens * 2 >= self.prompt_tokens


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation (sample standard deviation over the mean); NaN under two values."""
    values = [v for v in values if v == v]
    if len(values) < 2 or not statistics.fmean(values):
        return float("nan")
    return statistics.stdev(values) / abs(statistics.fmean(values))


@dataclass
class RunResult:
    shape: str
    mode: str
    seed: int
    outcomes: list[Outcome]
    wall_s: float
    bound: int  # the most warm requests any router could serve (warm_bound)
    # Mean TTFT on the engines' clock, from their engine_ttft_seconds (simulated time for
    # simulated workers): without the frontend, Celery and the client, which a busy machine slows.
    engine_ttft_mean: float = float("nan")
    # warm requests one cache of every worker's blocks serves, by its eviction (cache_reference)
    references: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    reasons: list[tuple[int, int, str]] = field(default_factory=list)  # overlap, best, reason

    @property
    def hit_rate(self) -> float:
        return sum(o.cached_tokens for o in self.outcomes) / max(
            sum(o.prompt_tokens for o in self.outcomes), 1
        )

    @property
    def client_ttft_mean(self) -> float:
        """TTFT as the client saw it, wall time. Means, never medians: TTFT falls in a warm and a
        cold group, and a median of such a sample lands on either side of the gap from run to run."""
        return mean([o.ttft_s for o in self.outcomes])

    @property
    def warm(self) -> int:
        return sum(o.warm for o in self.outcomes)

    @property
    def warm_over_bound(self) -> float:
        return self.warm / self.bound if self.bound else float("nan")

    def split_ttft_mean(self) -> tuple[float, float]:
        """Mean TTFT of the warm requests and of the cold ones (NaN for an empty group)."""
        return (
            mean([o.ttft_s for o in self.outcomes if o.warm]),
            mean([o.ttft_s for o in self.outcomes if not o.warm]),
        )

    def split_by_queue(self) -> tuple[int, float, float]:
        """Requests that reached a worker while another request there had not had its first token
        yet (a prompt still prefilling, which a new one waits behind), and the mean TTFT of those
        and of the rest: once the caches no longer differ (shape (d)), what sets a run's TTFT."""
        behind, rest = [], []
        for o in self.outcomes:
            queued = any(
                q is not o and q.worker == o.worker and q.sent_at < o.sent_at < q.sent_at + q.ttft_s
                for q in self.outcomes
            )
            (behind if queued else rest).append(o.ttft_s)
        return len(behind), mean(behind), mean(rest)

    def burst_share(self, users: int, gap_s: float = BURST_GAP_S) -> float:
        """The share of requests sent in a burst of `users` requests, each within `gap_s` of the one
        before: in a closed loop of that many users, every user asking at once (shape (d))."""
        times = sorted(o.sent_at for o in self.outcomes)
        bursts: list[int] = []
        for k, at in enumerate(times):
            if k and at - times[k - 1] <= gap_s:
                bursts[-1] += 1
            else:
                bursts.append(1)
        return sum(size for size in bursts if size >= users) / max(len(times), 1)

    @property
    def imbalance(self) -> float:
        """The busiest worker's requests over the mean per worker."""
        counts = Counter(o.worker for o in self.outcomes)
        per_worker = [*counts.values(), *[0] * (WORKERS - len(counts))]
        return max(per_worker) / max(sum(per_worker) / len(per_worker), 1e-9)

    @property
    def given_up(self) -> tuple[int, int]:
        """Overlap given up and best overlap (blocks), over the run's decisions."""
        return sum(max(b - o, 0) for o, b, _ in self.reasons), sum(b for _, b, _ in self.reasons)


# --- the workloads ---------------------------------------------------------------------------------
def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    vocabulary = _VOCABULARY.split()
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def description(product: int) -> str:
    return f"Catalogue entry {product}: {words(f'description-{product}', DESCRIPTION_WORDS)}."


def user_turn(image_urls: str | Sequence[str] | None, text: str) -> dict:
    if isinstance(image_urls, str):
        image_urls = [image_urls]
    content: list[dict] = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls or ()]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


class Catalogue:
    """The products' images on a local origin, plus one-off images for shape (d)."""

    def __init__(self, origin: ImageServer, salt: str, products: int = PRODUCTS) -> None:
        self._origin = origin
        self._salt = salt
        self.products = [
            origin.add(f"/{salt}/product-{n}.png", noise_png(f"{salt}-{n}", IMAGE_SIDE))
            for n in range(products)
        ]
        self._unique = 0

    def unique(self) -> str:
        self._unique += 1
        return self._origin.add(
            f"/{self._salt}/unique-{self._unique}.png",
            noise_png(f"{self._salt}-unique-{self._unique}", IMAGE_SIDE),
        )


def zipf_picker(rng: random.Random, products: int) -> Callable[[], int]:
    weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(products)]
    ranking = rng.sample(range(products), products)  # the hot products are not simply the first
    return lambda: rng.choices(ranking, weights)[0]


def plan(shape: str, requests: int, seed: int, catalogue: Catalogue) -> list[list[Turn]]:
    """Sessions of turns for one shape; the same seed and catalogue give the same sessions."""
    rng = random.Random(f"{shape}-{seed}")
    pick = zipf_picker(rng, len(catalogue.products))
    sessions: list[list[Turn]] = []
    planned = 0
    system = {
        "role": "system",
        "content": "You are a catalogue assistant. " + words(f"system-{seed}", SYSTEM_WORDS),
    }
    while planned < requests:
        n = len(sessions)
        length = min(rng.choice((2, 3, 4, 5) if shape == "c" else (1, 2, 3, 4)), requests - planned)
        turns: list[Turn] = []
        if shape == "a":
            product = pick()
            for question in rng.sample(range(len(_QUESTIONS)), length):
                text = f"{description(product)}\n\nQuestion: {_QUESTIONS[question]}"
                turns.append(
                    Turn(
                        n,
                        (user_turn(catalogue.products[product], text),),
                        f"a{product}-{question}",
                        f"p{product}",
                    )
                )
        elif shape == "b":
            for _ in range(length):
                product, question = pick(), rng.randrange(len(_QUESTIONS))
                text = f"{description(product)}\n\nQuestion: {_QUESTIONS[question]}"
                turns.append(
                    Turn(
                        n,
                        (user_turn(catalogue.products[product], text),),
                        f"b{product}-{question}",
                        f"p{product}",
                    )
                )
        elif shape == "c":
            photos = [catalogue.unique() for _ in range(PHOTOS_PER_CONVERSATION)]
            history: list[dict] = []
            for k, question in enumerate(rng.sample(range(len(_QUESTIONS)), length)):
                history = [*history, user_turn(photos if k == 0 else [], _QUESTIONS[question])]
                turns.append(Turn(n, tuple(history), f"c{n}-{k}", f"c{n}"))
                # The answer becomes part of the next turn's prompt (a fixed one: the model's text
                # would make the prompts differ between modes).
                answer = f"About your photo: {words(f'answer-{seed}-{n}-{k}', ANSWER_WORDS)}."
                history = [*history, {"role": "assistant", "content": answer}]
        elif shape == "d":
            for _ in range(length):
                question = rng.randrange(len(_QUESTIONS))
                turns.append(
                    Turn(
                        n,
                        (system, user_turn(catalogue.unique(), _QUESTIONS[question])),
                        f"d{n}-{len(turns)}",
                        "system",
                    )
                )
        else:
            raise ValueError(f"unknown shape {shape!r}")
        sessions.append(turns)
        planned += len(turns)
    return sessions


# --- driving the platform --------------------------------------------------------------------------
def send(client: httpx.Client, base_url: str, turn: Turn, session_salt: str) -> Outcome:
    """One streamed request; TTFT is the time to the first chunk carrying generated text."""
    body = {
        "model": "demo",
        "messages": list(turn.messages),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": f"bench-{session_salt}-{turn.session}"}
    answer = stream_chat(client, base_url, body, headers)
    if not answer.usage or answer.worker is None:
        raise RuntimeError("the answer did not say its usage or its worker")
    return Outcome(
        turn=turn,
        sent_at=answer.sent_at,
        worker=answer.worker,
        prompt_tokens=int(answer.usage["prompt_tokens"]),
        cached_tokens=int(answer.usage["prompt_tokens_details"]["cached_tokens"]),
        ttft_s=answer.ttft_s,
    )


def run_sessions(
    base_url: str,
    sessions: list[list[Turn]],
    session_salt: str,
    headers: dict[str, str],
    session_rate: float | None = None,
    arrivals_seed: int = 0,
    think_s: float = 0.0,
) -> tuple[list[Outcome], float, list[str]]:
    """Closed loop (session_rate None): CONCURRENCY users, each taking the next session and asking
    its turns one after another. Open loop: sessions start at Poisson times, `session_rate` a
    second (the same times in every mode for one seed), each asking its turns one after another,
    however many are open at once. `think_s` > 0: a user waits an exponential time of that mean
    before each turn (the same waits in every mode for one seed)."""
    pending: queue.Queue[list[Turn]] = queue.Queue()
    for session in sessions:
        pending.put(session)
    outcomes: list[Outcome] = []
    failures: list[str] = []
    lock = threading.Lock()

    def ask(client: httpx.Client, session: list[Turn]) -> None:
        for turn in session:
            if think_s > 0:
                time.sleep(random.Random(f"think-{arrivals_seed}-{turn.key}").expovariate(1 / think_s))
            try:
                outcome = send(client, base_url, turn, session_salt)
            except (httpx.HTTPError, RuntimeError, KeyError) as exc:
                with lock:
                    failures.append(f"{turn.key}: {exc}")
                continue
            with lock:
                outcomes.append(outcome)

    def user() -> None:
        with httpx.Client(timeout=180, headers=headers) as client:
            while True:
                try:
                    session = pending.get_nowait()
                except queue.Empty:
                    return
                ask(client, session)

    started = time.perf_counter()
    if session_rate is not None:
        rng = random.Random(f"arrivals-{arrivals_seed}")
        at, starts = 0.0, []
        for _ in sessions:
            starts.append(at)
            at += rng.expovariate(session_rate)

        def arriving(session: list[Turn], start: float) -> None:
            time.sleep(max(0.0, started + start - time.perf_counter()))
            with httpx.Client(timeout=180, headers=headers) as client:
                ask(client, session)

        users = [
            threading.Thread(target=arriving, args=(session, start), name=f"session-{n}")
            for n, (session, start) in enumerate(zip(sessions, starts, strict=True))
        ]
    else:
        users = [threading.Thread(target=user, name=f"user-{n}") for n in range(CONCURRENCY)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join()
    outcomes.sort(key=lambda o: o.sent_at)
    return outcomes, time.perf_counter() - started, failures


class Bench:
    """One platform (two workers, one frontend per mode) reused across runs, reset before each.

    `engine` "sim": one `run_worker --engine sim --count 2` process (workers.sim_engine, the
    profile's timing over the native scheduler and a prefix pool of `kv_blocks`); "native": two
    `run_worker` processes of the demo model, one torch thread each."""

    def __init__(
        self,
        tmp: Path,
        model: Path,
        redis_url: str,
        kv_blocks: int = KV_CAPACITY_BLOCKS,
        engine: str = "sim",
        sim_profile: str = SIM_PROFILE,
        sim_speedup: float = 1.0,
        modes: Sequence[str] = DEFAULT_MODES,
    ) -> None:
        self.engine = engine
        self.kv_blocks = kv_blocks
        self.sim_profile = sim_profile
        self.sim_speedup = sim_speedup
        self.modes = list(modes)
        self.workers: list[str] = []
        self.namespace = f"bench:workload:{uuid.uuid4().hex[:10]}:"
        self.redis = redis.Redis.from_url(redis_url)
        self.platform = PlatformProcesses(
            tmp,
            model,
            redis_url,
            self.namespace,
            {
                "KV_CAPACITY_BLOCKS": str(kv_blocks),
                "KV_BLOCK_SIZE": str(BLOCK_SIZE),
                "MEDIA_ALLOWED_HOSTS": "127.0.0.1",
                "WORKER_TORCH_THREADS": "1",
                "LOG_LEVEL": "WARNING",
                # Each decision's overlap, best overlap and reason, to explain what kv gave up.
                "LOG_LEVELS": "inference_platform.serving=info",
            },
        )
        self.frontends: dict[str, str] = {}

    def start(self) -> None:
        started = time.perf_counter()
        if self.engine == "sim":
            self.workers = self.platform.start_sim_workers(
                "w", WORKERS, "--sim-profile", self.sim_profile,
                "--sim-speedup", f"{self.sim_speedup:g}", "--sim-kv-blocks", str(self.kv_blocks),
            )  # fmt: skip
        else:
            self.workers = list(NATIVE_WORKERS)
            for name in self.workers:
                self.platform.start_worker(name)
                time.sleep(1.5)  # registrations at one instant can lock SQLite
        self.platform.wait_for_workers(*self.workers)
        for mode in self.modes:
            self.platform.env["ROUTER_MODE"] = mode
            self.frontends[mode] = self.platform.start_server()
        self._django()
        print(f"platform up in {time.perf_counter() - started:.1f} s", flush=True)

    def _django(self) -> None:
        """This process reads the platform's settings, to run its management commands in-process
        (a Django start per reset would cost seconds on a busy machine)."""
        for key in ("DJANGO_SETTINGS_MODULE", "DATABASE_URL", "REDIS_URL", "REDIS_KEY_PREFIX", "MODEL_PATH"):
            os.environ[key] = self.platform.env[key]
        os.environ["LOG_LEVEL"] = "WARNING"
        os.environ.pop("LOG_LEVELS", None)
        import django

        django.setup()

    def reset(self) -> None:
        """Empty caches on both workers, and no load, predicted blocks or affinity left over."""
        from django.core.management import call_command

        out = io.StringIO()
        caches = ("--cache", "kv", "--cache", "embeddings", "--cache", "images")
        call_command("flush_caches", *caches, "--json", stdout=out)
        answers = json.loads(out.getvalue().strip().splitlines()[-1])["workers"]
        failed = {name: a for name, a in answers.items() if "error" in a}
        if failed or set(answers) != set(self.workers):
            raise RuntimeError(f"flush_caches: {answers}")
        for pattern in ("aff:*", "kv:approx*", "load:*"):
            for key in self.redis.scan_iter(match=f"{self.namespace}{pattern}", count=1000):
                self.redis.delete(key)

    def decisions(self, mode: str) -> list[tuple[int, int, str]]:
        """(overlap, best overlap, reason) of every decision the mode's frontend logged so far."""
        mode = _frontend_mode(mode)
        started = list(self.frontends).index(mode)  # the harness's label for the nth frontend
        label = "server" if started == 0 else f"server-{started}"
        return [(int(o), int(b), r) for o, b, r in _SENT_LINE.findall(self.platform.log(label))]

    def run(
        self,
        shape: str,
        mode: str,
        seed: int,
        sessions: list[list[Turn]],
        session_rate: float | None = None,
        think_s: float = 0.0,
    ) -> RunResult:
        self.reset()
        logged = len(self.decisions(mode))
        engine_before = self.engine_ttft_totals()
        outcomes, wall_s, failures = run_sessions(
            self.frontends[_frontend_mode(mode)],
            sessions,
            f"{shape}{mode}{seed}",
            self.platform.headers,
            session_rate,
            seed,
            think_s,
        )
        result = RunResult(shape, mode, seed, outcomes, wall_s, warm_bound(sessions), failures=failures)
        # A decision is logged before its task is sent, so every one of this run's is there.
        result.reasons = self.decisions(mode)[logged:]
        result.references = {
            eviction: cache_reference(outcomes, WORKERS * self.kv_blocks, eviction) for eviction in REFERENCES
        }
        # The workers flush their metrics about once a second: wait for this run's last ones.
        deadline = time.monotonic() + 10
        while True:
            seconds, count = (a - b for a, b in zip(self.engine_ttft_totals(), engine_before, strict=True))
            if count >= len(outcomes) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if count == len(outcomes):
            result.engine_ttft_mean = seconds / count
        return result

    def engine_ttft_totals(self) -> tuple[float, int]:
        """The workers' engine_ttft_seconds so far: the sum of the seconds, and how many."""
        totals = self.redis.hgetall(f"{self.platform.statistics_namespace}m:total")
        seconds, count = 0.0, 0
        for raw_field, value in totals.items():
            name, part, _ = raw_field.decode(errors="replace").split("\x1f", 2)
            if name == "engine_ttft_seconds" and part == "sum":
                seconds += float(value)
            elif name == "engine_ttft_seconds" and part == "count":
                count += int(float(value))
        return seconds, count

    def close(self) -> None:
        self.platform.close()
        self.redis.close()


def _frontend_mode(mode: str) -> str:
    return "round_robin" if mode == AGAIN else mode


_SENT_LINE = re.compile(
    r"\(\d+ prompt tokens, (\d+)/\d+ blocks cached, best (\d+), ([\w-]+)\)$", re.MULTILINE
)


def warm_bound(sessions: list[list[Turn]]) -> int:
    """The most warm requests any router could serve: every request but the first to show its
    prefix (its product, conversation or system prompt)."""
    turns = [turn for session in sessions for turn in session]
    return len(turns) - len({t.prefix for t in turns})


REFERENCES = ("lru", "lfu", "clairvoyant")


def cache_reference(outcomes: Sequence[Outcome], blocks: int, eviction: str = "lru") -> int:
    """Warm requests, in the order they were sent, of one cache of `blocks` (every worker's
    together) holding each prefix once, at the size of its latest prompt, that keeps every prompt
    it sees and evicts, while it is over its size, another prefix:
    - `lru`, the least recently asked (as the engines do). Not a bound: this is what LRU eviction
      leaves a router that never holds a prefix twice, where a prefix no cache could keep (its
      reuse further away than the cache's reach) is lost whatever the router does;
    - `lfu`, the least often asked so far, the least recent of those: a policy that knows the
      prefixes' popularity as far as it has seen it, and nothing of what comes next;
    - `clairvoyant`, the one asked again furthest in the future, or never (Belady's): it knows
      the whole sequence; what it leaves out, no eviction could keep."""
    if eviction not in REFERENCES:
        raise ValueError(f"unknown eviction {eviction!r}; expected one of {REFERENCES}")
    sent = sorted(outcomes, key=lambda o: o.sent_at)
    order = [o.turn.prefix for o in sent]
    sizes = [o.prompt_tokens // BLOCK_SIZE for o in sent]
    next_use: list[float] = [float("inf")] * len(order)
    upcoming: dict[str, int] = {}
    for i in range(len(order) - 1, -1, -1):
        next_use[i] = upcoming.get(order[i], float("inf"))
        upcoming[order[i]] = i
    held: dict[str, int] = {}  # prefix -> blocks, least recently asked first
    asked: dict[str, int] = {}  # prefix -> times asked so far
    due: dict[str, float] = {}  # prefix -> when it is asked next
    warm = 0
    for i, (prefix, size) in enumerate(zip(order, sizes, strict=True)):
        asked[prefix] = asked.get(prefix, 0) + 1
        due[prefix] = next_use[i]
        if prefix in held:
            warm += 1
            del held[prefix]
        held[prefix] = size
        while sum(held.values()) > blocks and len(held) > 1:
            others = [p for p in held if p != prefix]  # least recently asked first
            if eviction == "lru":
                victim = others[0]
            elif eviction == "lfu":
                victim = min(others, key=lambda p: asked[p])  # min keeps the first: the least recent
            else:
                victim = max(others, key=lambda p: due[p])
            del held[victim]
    return warm


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


def figure(values: Sequence[float], digits: int = 3, scale: float = 1.0) -> str:
    """The mean over the runs and its coefficient of variation."""
    return f"{mean(values) * scale:.{digits}f} (cv {cv(values):.1%})"


def ratios(kv: Sequence[RunResult], rr: Sequence[RunResult], of: Callable[[RunResult], float]) -> list[float]:
    """kv's figure over round robin's, run by run (the same seed: the same requests)."""
    return [of(k) / of(r) if of(r) else float("nan") for k, r in zip(kv, rr, strict=True)]


def pooled_ttft_ratio(kv: Sequence[RunResult], rr: Sequence[RunResult]) -> float:
    """Engine TTFT mean over every request of every run, kv's over round robin's."""

    def pooled(runs: Sequence[RunResult]) -> float:
        return sum(r.engine_ttft_mean * len(r.outcomes) for r in runs) / max(
            sum(len(r.outcomes) for r in runs), 1
        )

    return pooled(kv) / pooled(rr)


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="sim",
        help="sim: two simulated workers (workers.sim_engine, no model; default); native: two workers"
        " of the demo model, one torch thread each",
    )
    parser.add_argument(
        "--sim-profile", default=SIM_PROFILE, help=f"--engine sim: the timing profile (default {SIM_PROFILE})"
    )
    parser.add_argument(
        "--sim-speedup",
        type=float,
        default=1.0,
        help="--engine sim: simulated seconds per wall second (default 1: TTFT in real time, the"
        " frontend's share included)",
    )
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help=f"requests per run (default {REQUESTS})"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=len(SEEDS),
        help=f"runs per shape and mode, one seed each (default {len(SEEDS)})",
    )
    parser.add_argument(
        "--modes",
        default=",".join(DEFAULT_MODES),
        help=f"comma-separated routers among {','.join(MODES)} (default {','.join(DEFAULT_MODES)})",
    )
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes (default a,b,c,d)")
    parser.add_argument(
        "--products", type=int, default=PRODUCTS, help=f"products in the catalogue (default {PRODUCTS})"
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=KV_CAPACITY_BLOCKS,
        help=f"each worker's KV cache, blocks of {BLOCK_SIZE} tokens (default {KV_CAPACITY_BLOCKS})",
    )
    parser.add_argument(
        "--origin-latency-ms",
        type=float,
        default=0.0,
        help="delay before the image origin answers, standing in for a remote one (default 0)",
    )
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help="run round robin a second time per seed and shape (after the others) and print its mean"
        " TTFT and hit rate over round robin's: how far a ratio moves when only the run differs",
    )
    parser.add_argument(
        "--think-ms",
        type=float,
        default=0.0,
        help="each user waits an exponential time of this mean before each turn (default 0)",
    )
    parser.add_argument(
        "--load",
        type=float,
        default=None,
        help="open loop: sessions arrive at Poisson times, at this fraction of the requests a second"
        " round robin serves in a closed loop of the shape (measured first, per shape); default: closed loop",
    )
    args = parser.parse_args(argv)
    if args.load is not None and not 0 < args.load < float("inf"):
        parser.error("--load must be a positive fraction of the closed-loop rate")
    if not 0 <= args.think_ms < float("inf"):
        parser.error("--think-ms must be a finite number of milliseconds >= 0")
    if not 0 < args.sim_speedup < float("inf"):
        parser.error("--sim-speedup must be a positive number")
    if args.seeds < 1 or args.requests < 1:
        parser.error("--seeds and --requests must be >= 1")
    shapes = [s for s in args.shapes.split(",") if s]
    modes = [m for m in MODES if m in args.modes.split(",")]
    if "round_robin" not in modes and args.noise_floor:
        modes.append("round_robin")
    if not modes:
        parser.error(f"--modes names none of {', '.join(MODES)}")
    seeds = (
        SEEDS[: args.seeds] if args.seeds <= len(SEEDS) else tuple(SEEDS[0] + i for i in range(args.seeds))
    )
    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    results: dict[tuple[str, str], list[RunResult]] = {}
    started = time.perf_counter()
    loads = [load_average()]
    engine = (
        f"simulated workers, profile {args.sim_profile}, speed-up {args.sim_speedup:g}"
        if args.engine == "sim"
        else "native workers, the demo model"
    )
    print(
        f"{WORKERS} {engine}, {args.kv_blocks}-block KV caches; {len(seeds)} runs of {args.requests}"
        f" requests per shape and mode; load average {loads[0]}",
        flush=True,
    )

    capacity: dict[str, float] = {}  # requests a second, for --load
    with (
        tempfile.TemporaryDirectory(prefix="workload-") as scratch,
        ImageServer(latency=args.origin_latency_ms / 1000) as origin,
    ):
        bench = Bench(
            Path(scratch),
            model_dir(Path(scratch)),
            redis_url,
            args.kv_blocks,
            args.engine,
            args.sim_profile,
            args.sim_speedup,
            modes,
        )
        try:
            bench.start()
            for seed in seeds:
                catalogue = Catalogue(origin, f"s{seed}", args.products)
                for shape in shapes:
                    sessions = plan(shape, args.requests, seed, catalogue)
                    turns = [turn for session in sessions for turn in session]
                    # Rotate the modes' order per seed: no mode always runs first after a reset.
                    order = modes[seed % len(modes) :] + modes[: seed % len(modes)]
                    if args.noise_floor:
                        order.append(AGAIN)
                    rate = None
                    if args.load is not None:
                        if shape not in capacity:
                            calibration = bench.run(shape, "round_robin", seed, sessions)
                            capacity[shape] = len(calibration.outcomes) / calibration.wall_s
                            print(
                                f"[{shape} capacity] round robin, closed loop: "
                                f"{capacity[shape]:.2f} requests/s",
                                flush=True,
                            )
                        rate = args.load * capacity[shape] / (len(turns) / len(sessions))
                    for mode in order:
                        result = bench.run(shape, mode, seed, sessions, rate, args.think_ms / 1000)
                        results.setdefault((shape, mode), []).append(result)
                        warm_ms, cold_ms = (t * 1000 for t in result.split_ttft_mean())
                        print(
                            f"[{shape} {mode:<11} seed {seed}] hit {result.hit_rate:.3f}"
                            f" warm {result.warm}/{len(result.outcomes)} (bound {result.bound},"
                            f" LRU {result.references['lru']}, LFU {result.references['lfu']},"
                            f" clairvoyant {result.references['clairvoyant']}) engine ttft mean"
                            f" {result.engine_ttft_mean * 1000:.0f} ms, client"
                            f" {result.client_ttft_mean * 1000:.0f} ms (warm {warm_ms:.0f},"
                            f" cold {cold_ms:.0f}) imbalance {result.imbalance:.2f}"
                            f" failed {len(result.failures)} load {os.getloadavg()[0]:.1f}",
                            flush=True,
                        )
                        for failure in result.failures[:2]:
                            print(f"  failed: {failure}", flush=True)
                loads.append(load_average())
        finally:
            bench.close()
    return report(results, shapes, modes, args, loads, time.perf_counter() - started)


def report(
    results: dict[tuple[str, str], list[RunResult]],
    shapes: Sequence[str],
    modes: Sequence[str],
    args: argparse.Namespace,
    loads: Sequence[str],
    seconds: float,
) -> int:
    shown_modes = (*modes, AGAIN) if args.noise_floor else tuple(modes)
    clock = "simulated" if args.engine == "sim" else "wall"
    summary: dict[str, dict[str, float]] = {}
    verdicts: dict[str, bool] = {}
    best = given_up = 0
    for shape in shapes:
        first = next((results[(shape, m)] for m in shown_modes if (shape, m) in results), None)
        if first is None:
            continue
        print(
            f"\nshape ({shape}): means over {len(first)} runs, one seed each"
            " (coefficient of variation over the runs)"
        )
        print(
            f"{'mode':<12} {'hit rate':>17} {'warm requests':>17} {'warm / bound':>17}"
            f" {f'engine ttft ms ({clock})':>24} {'client ttft ms':>17} {'imbalance':>16} {'given up':>8}"
        )
        for mode in shown_modes:
            runs = results.get((shape, mode))
            if not runs:
                continue
            lost, of = (sum(x) for x in zip(*(r.given_up for r in runs), strict=True))
            print(
                f"{mode:<12} {figure([r.hit_rate for r in runs]):>17}"
                f" {figure([r.warm for r in runs], 1):>17}"
                f" {figure([r.warm_over_bound for r in runs], 3):>17}"
                f" {figure([r.engine_ttft_mean for r in runs], 0, 1000):>24}"
                f" {figure([r.client_ttft_mean for r in runs], 0, 1000):>17}"
                f" {figure([r.imbalance for r in runs], 2):>16} {lost / max(of, 1):8.3f}"
            )
            if mode == "kv":
                best += of
                given_up += lost
        referenced = results.get((shape, "kv"), first)
        print(
            f"warm requests at most, for any router (every request but the first to show its prefix):"
            f" {figure([r.bound for r in first], 1)}; one cache of both workers'"
            f" {WORKERS * args.kv_blocks} blocks, each prefix once, in kv's order, evicting the least"
            f" recently asked (LRU reference): {figure([r.references['lru'] for r in referenced], 1)},"
            f" the least often asked so far: {figure([r.references['lfu'] for r in referenced], 1)},"
            f" the one asked again last (clairvoyant):"
            f" {figure([r.references['clairvoyant'] for r in referenced], 1)}"
        )
        queueing = []
        for mode in shown_modes:
            runs = results.get((shape, mode))
            if runs:
                counts, behind, rest = zip(*(r.split_by_queue() for r in runs), strict=True)
                queueing.append(
                    f"{mode} {mean(counts):.1f}/{args.requests}"
                    f" ({mean(behind) * 1000:.0f} vs {mean(rest) * 1000:.0f} ms)"
                )
        print(
            "arrived behind a prompt still prefilling on its worker (client ttft mean of those vs the"
            " rest): " + ", ".join(queueing)
        )
        if args.load is None:
            bursts = [
                f"{mode} {mean([r.burst_share(CONCURRENCY) for r in results[(shape, mode)]]):.0%}"
                for mode in shown_modes
                if (shape, mode) in results
            ]
            print(
                f"arrived in a burst of all {CONCURRENCY} users (each within"
                f" {BURST_GAP_S * 1000:.0f} ms of the one before), means: " + ", ".join(bursts)
            )
        kv, rr = results.get((shape, "kv"), []), results.get((shape, "round_robin"), [])
        by_reason: Counter[str] = Counter()
        lost_by_reason: Counter[str] = Counter()
        for run in kv:
            for overlap, best_overlap, reason in run.reasons:
                by_reason[reason] += 1
                lost_by_reason[reason] += max(best_overlap - overlap, 0)
        if kv:
            print(
                "kv decisions by reason (blocks given up): "
                + ", ".join(
                    f"{reason} {count} ({lost_by_reason[reason]})"
                    for reason, count in by_reason.most_common()
                )
            )
        again = results.get((shape, AGAIN), [])
        if again and rr:
            print(
                "noise floor, round robin again over round robin, run by run: engine ttft mean"
                f" {figure(ratios(again, rr, lambda r: r.engine_ttft_mean), 3)}, client ttft mean"
                f" {figure(ratios(again, rr, lambda r: r.client_ttft_mean), 3)},"
                f" hit rate {figure(ratios(again, rr, lambda r: r.hit_rate), 3)}"
            )
        if not (kv and rr):
            continue
        hit = ratios(kv, rr, lambda r: r.hit_rate)
        ttft = ratios(kv, rr, lambda r: r.engine_ttft_mean)
        client = ratios(kv, rr, lambda r: r.client_ttft_mean)
        warm = [r.warm_over_bound for r in kv]
        summary[shape] = {"hit": mean(hit), "warm": mean(warm), "ttft": mean(ttft), "client": mean(client)}
        limit = TTFT_RATIO_LIMIT.get(shape, 1.05)
        checks = {
            "hit rate >= round robin's in every run": min(hit) >= 1.0,
            f"warm >= {WARM_SHARE_OF_BOUND:g} x bound": mean(warm) >= WARM_SHARE_OF_BOUND,
            f"engine ttft mean <= {limit:g} x round robin's": mean(ttft) <= limit,
            f"its cv <= {RATIO_CV_LIMIT:.0%}": cv(ttft) <= RATIO_CV_LIMIT,
        }
        summary[shape]["cv"] = cv(ttft)
        verdicts[shape] = all(checks.values())
        print(
            f"kv/rr, run by run: hit rate {figure(hit)}, engine ttft mean {figure(ttft)}"
            f" (every request of every run pooled: {pooled_ttft_ratio(kv, rr):.3f}),"
            f" client ttft mean {figure(client)}; kv's warm requests over the bound {figure(warm)},"
            f" over the LRU reference {figure([r.warm / max(r.references['lru'], 1) for r in kv])}"
        )
        print(
            "acceptance: " + "; ".join(f"{name} {'yes' if held else 'NO'}" for name, held in checks.items())
        )
    runs = sum(len(r) for r in results.values())
    print(
        f"\n{runs} runs of {args.requests} requests in {seconds:.0f} s; load average (1/5/15 min)"
        f" at the start {loads[0]}, after each seed {', '.join(loads[1:])}"
    )
    if not summary:
        return 0

    def per_shape(name: str, digits: int = 2) -> str:
        return ",".join(f"{shape}:{figures[name]:.{digits}f}" for shape, figures in summary.items())

    print(
        f"shapes={len(summary)} runs={len(results[(next(iter(summary)), 'kv')])}"
        f" hit_kv_over_rr={per_shape('hit')} warm_over_bound={per_shape('warm')}"
        f" engine_ttft_mean_kv_over_rr={per_shape('ttft')} its_cv={per_shape('cv', 3)}"
        f" client_ttft_mean_kv_over_rr={per_shape('client')}"
        f" overlap_given_up={given_up / max(best, 1):.3f}"
        f" acceptance_met={sum(verdicts.values())}/{len(verdicts)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
